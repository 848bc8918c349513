"""GetStatistics: how each named allocation fares, read from the kernel for this call (issue
39; cpuservice.shell.statistics). Kept off the properties on purpose: GetManagedObjects and
GetAll answer from prepared replies and never read the kernel, so that anyone's bulk reads stay
cheap; this method reads at most MAX_NAMES cgroups per call, in its caller's fair turn.
(No ``from __future__ import annotations`` here, as in the other modules of the bus.)
"""

from collections.abc import Sequence
from typing import Any

from dbus_fast import Variant

from cpuservice.model.errors import InvalidArgument
from cpuservice.model.figures import MAX_NAMES, SIGNATURES
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
