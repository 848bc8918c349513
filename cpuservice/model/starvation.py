"""The host's side of how CPUs fare (issue 39), pure: which cgroups hold the shared pool's
work, the kernel's PSI trigger that says they starve, and the admission guard's decision.

The shared pool has no cgroup of its own: its CPUs run the unbound allocations
(``cpuservice-shared.slice``) and the host's own services (``system.slice``; with
``confine_host`` only there). PSI counts per cgroup: the share of wall time in which some
runnable task of the cgroup waited for a CPU. The guard watches both (HOST_CGROUPS, the one
home of them) with a kernel trigger each (``some STALL WINDOW`` written to ``cpu.pressure``:
the kernel wakes the daemon when the tasks of the cgroup waited more than STALL microseconds
in a WINDOW, at most once per window), so a daemon whose host is not starving is never woken.

Hysteresis on the trigger's events (an injected clock: ``now`` is monotonic seconds): the first
event starts an episode of starvation; while it lasts the kernel sends one event per window;
the episode ends once no event came for ``hold_seconds``. While an episode lasts an Allocate
(or a Resize that grows bound CPUs) that would take CPUs out of the shared pool is refused with
SharedPoolStarving, unless its caller overrides (see cpuservice.bus.api)."""

from __future__ import annotations

from dataclasses import dataclass

from cpuservice.model.errors import SharedPoolStarving

# (name shown, cgroup below the hierarchy's root): the shared pool's holders that are watched
HOST_CGROUPS: tuple[tuple[str, str], ...] = (
    ("cpuservice-shared.slice", "/cpuservice.slice/cpuservice-shared.slice"),
    ("system.slice", "/system.slice"),
)
WINDOWS = (2, 4, 6, 8, 10)  # seconds: the kernel takes 0.5-10 s, and from Linux 6.5 a process
# without CAP_SYS_RESOURCE (the daemon's sandbox has none) only whole multiples of 2 s


@dataclass(frozen=True)
class Guard:
    """The configuration (admission_guard_*): ``percent`` of a ``window`` in which some task
    waited that starts an episode (0: the guard is off); ``hold`` seconds without an event that
    end it."""

    percent: float = 0.0
    window: int = 2
    hold: float = 10.0

    @property
    def enabled(self) -> bool:
        return self.percent > 0

    def trigger(self) -> str:
        """What is written to a cgroup's ``cpu.pressure``: ``some STALL_US WINDOW_US``."""
        window_us = self.window * 1_000_000
        stall_us = max(1, min(window_us, round(window_us * self.percent / 100)))
        return f"some {stall_us} {window_us}"


@dataclass(frozen=True)
class Episode:
    """Starvation as the events told it: ``since`` the first event of the episode, ``last``
    the latest, ``where`` the cgroups whose triggers fired in it (None: no episode yet)."""

    since: float | None = None
    last: float | None = None
    where: tuple[str, ...] = ()

    def starving(self, guard: Guard, now: float) -> bool:
        """Whether the episode lasts at ``now`` (an event less than ``hold`` ago)."""
        return self.last is not None and now - self.last < guard.hold

    def lasted(self, now: float) -> float:
        """Seconds since the episode began (0 without one)."""
        return 0.0 if self.since is None else max(0.0, now - self.since)

    def ends_at(self, guard: Guard) -> float | None:
        """When the episode ends unless another event comes."""
        return None if self.last is None else self.last + guard.hold


def event(episode: Episode, guard: Guard, now: float, where: str) -> Episode:
    """The episode after a trigger of ``where`` fired at ``now``: the same one, or a new one
    when the last ended."""
    if not episode.starving(guard, now):
        return Episode(now, now, (where,))
    where_all = episode.where if where in episode.where else (*episode.where, where)
    return Episode(episode.since, now, where_all)


FORCE = "or override with option 'force' (root or org.cpuservice1.manage)"


def check(episode: Episode, guard: Guard, now: float, taken: int, what: str,
          avg10: dict[str, float] | None = None, override: str = FORCE) -> None:
    """Refuse (SharedPoolStarving) a request that takes ``taken`` CPUs out of the shared pool
    while an episode lasts; ``what``: the request, for the message; ``avg10``: the pressure
    the kernel shows now, by cgroup; ``override``: how the caller may override (both for
    the message)."""
    if not guard.enabled or taken <= 0 or not episode.starving(guard, now):
        return
    shown = ", ".join(f"{name} {avg10[name]:.1f} %" for name in episode.where
                      if avg10 and name in avg10)
    raise SharedPoolStarving(
        f"{what} would take {taken} CPU{'s' if taken != 1 else ''} out of the shared pool, "
        f"which is starving: the CPU pressure of {' and '.join(episode.where)} has been above "
        f"{guard.percent:g} % (admission_guard_percent, some tasks waiting, per "
        f"{guard.window} s) for {episode.lasted(now):.0f} s"
        f"{f' (avg10 now: {shown})' if shown else ''}; try again once it has stayed below "
        f"for {guard.hold:g} s{', ' + override if override else ''}")
