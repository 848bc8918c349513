"""Health from how an allocation fares (issue 39), pure: from the figures the daemon reads every
``statistics_seconds`` (cpuservice.model.figures), the reasons an allocation's Health is
degraded although it holds every CPU it asked for:

- ``pressured``: its CPU pressure (some avg10: the share of the last 10 s in which some of its
  runnable tasks waited for a CPU) is at or above ``health_pressure_percent``;
- ``throttled``: the share of its quota's periods that throttled it since the last reading is
  at or above ``health_throttled_percent``;
- ``memory-remote``: with option memory-nodes, the share of its memory on other NUMA nodes is
  at or above ``health_memory_remote_percent``.

With hysteresis, on the clock it is given: a reason is raised once its figure has stayed at or
above the threshold for ``health_seconds``, and cleared once it has stayed below half of it for
as long (a figure that cannot be read counts as below). A threshold of 0 turns its reason off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from cpuservice.model.figures import rates

PRESSURED, THROTTLED, MEMORY_REMOTE = "pressured", "throttled", "memory-remote"
REASONS = (PRESSURED, THROTTLED, MEMORY_REMOTE)  # in the order they are named
TEXT = {  # what HealthReason says (no figure in it: it would change at every reading)
    PRESSURED: "pressured: its tasks wait for CPUs (cpu.pressure)",
    THROTTLED: "throttled: its CPU quota throttles it (cpu.stat)",
    MEMORY_REMOTE: "memory-remote: much of its memory is on other NUMA nodes (memory.numa_stat)",
}


@dataclass(frozen=True)
class Limits:
    """The thresholds, in percent (0: that reason is off), and the hold time in seconds."""

    pressure: float = 20.0
    throttled: float = 20.0
    memory_remote: float = 20.0
    hold: float = 30.0

    def of(self, reason: str) -> float:
        return {PRESSURED: self.pressure, THROTTLED: self.throttled,
                MEMORY_REMOTE: self.memory_remote}[reason]


class Track(NamedTuple):
    """One reason of one allocation: whether it is raised, and since when its figure has been
    on the other side (None: it is not)."""

    raised: bool = False
    since: float | None = None


def step(track: Track, value: float | None, now: float, threshold: float,
         hold: float) -> Track:
    """The reason after a reading of ``value`` at ``now``."""
    if threshold <= 0:
        return Track()
    crossing = (value is None or value < threshold / 2) if track.raised else \
        (value is not None and value >= threshold)
    if not crossing:
        return Track(track.raised)
    since = now if track.since is None else track.since
    if now - since >= hold:
        return Track(not track.raised)
    return Track(track.raised, since)


def values(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> dict[str, float | None]:
    """Each reason's figure from two readings of an allocation (GetStatistics values)."""
    return {PRESSURED: after.get("cpu-pressure-some-avg10"),
            THROTTLED: rates(before, after).throttled_percent,
            MEMORY_REMOTE: after.get("memory-remote-percent")}


def assess(tracks: Mapping[str, Mapping[str, Track]], before: Mapping[str, Mapping[str, Any]],
           after: Mapping[str, Mapping[str, Any]], now: float, limits: Limits
           ) -> dict[str, dict[str, Track]]:
    """Every allocation's tracks after a reading (``after``: name -> its figures' values,
    ``before``: the previous reading); allocations not in ``after`` are dropped."""
    out = {}
    for name, figures in after.items():
        found = values(before.get(name), figures)
        mine = tracks.get(name, {})
        out[name] = {r: step(mine.get(r, Track()), found[r], now, limits.of(r), limits.hold)
                     for r in REASONS}
    return out


def raised(tracks: Mapping[str, Track]) -> tuple[str, ...]:
    """The reasons raised, in REASONS' order."""
    return tuple(r for r in REASONS if r in tracks and tracks[r].raised)


def describe(reasons: tuple[str, ...]) -> str:
    """What HealthReason says of them."""
    return "; ".join(TEXT[r] for r in reasons)
