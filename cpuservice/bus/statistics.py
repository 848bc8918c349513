"""GetStatistics: how each named allocation fares, read from the kernel for this call (issue
39; cpuservice.shell.statistics); GetHostPressure: the same of the shared pool's holders, and
the admission guard (cpuservice.shell.host_pressure). Kept off the properties on purpose:
GetManagedObjects and GetAll answer from prepared replies and never read the kernel, so that
anyone's bulk reads stay cheap; this method reads at most MAX_NAMES cgroups per call, in its
caller's fair turn.
(No ``from __future__ import annotations`` here, as in the other modules of the bus.)
"""

from collections.abc import Sequence
from typing import Any

from dbus_fast import Variant

from cpuservice.model.errors import InvalidArgument
from cpuservice.model.figures import MAX_NAMES, SIGNATURES
from cpuservice.shell.host_pressure import HostPressure
from cpuservice.shell.statistics import Statistics


async def reply(statistics: Statistics, names: Sequence[str]) -> dict[str, Any]:
    """name -> its figures as variants (FIGURES' keys; unknown ones left out), for the names
    that are allocations; InvalidArgument for more than MAX_NAMES names."""
    if len(names) > MAX_NAMES:
        raise InvalidArgument(f"GetStatistics: {len(names)} names; at most {MAX_NAMES} per "
                              "call (ask in batches)")
    found = await statistics.read(names)
    return {name: {k: Variant(SIGNATURES[k], v) for k, v in figures.values().items()}
            for name, figures in found.items()}


GUARD = "admission-guard"  # GetHostPressure's entry of the guard (beside the cgroups' figures)


def host_reply(host: HostPressure) -> dict[str, Any]:
    """GetHostPressure: the figures of the shared pool's holders (starvation.HOST_CGROUPS,
    FIGURES' keys), read now, and the admission guard's state under GUARD."""
    out: dict[str, Any] = {name: {k: Variant(SIGNATURES[k], v) for k, v in f.values().items()}
                           for name, f in host.read().items()}
    now = host.clock()
    starving = host.starving()
    guard = host.guard
    out[GUARD] = {
        "enabled": Variant("b", guard.enabled),
        "available": Variant("b", host.available),
        "unavailable": Variant("s", host.unavailable),
        "starving": Variant("b", starving),
        "starving-usec": Variant("t", int(host.episode.lasted(now) * 1e6) if starving else 0),
        "cgroups": Variant("as", list(host.episode.where) if starving else []),
        "limit-percent": Variant("d", float(guard.percent)),
        "window-usec": Variant("t", guard.window * 1_000_000),
        "hold-usec": Variant("t", int(guard.hold * 1e6)),
        "events": Variant("t", host.events),
    }
    return out


def force(options: dict[str, Any]) -> bool:
    """Take Allocate's option ``force`` (a boolean: past the admission guard; it needs manage)
    out of ``options``: it is this call's, never part of the allocation's request."""
    value = options.pop("force", None)
    value = getattr(value, "value", value)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"option 'force': {value!r} is not a boolean")
    return bool(value)
