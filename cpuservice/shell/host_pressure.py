"""The host's side of how CPUs fare (issue 39), the shell's part: the shared pool's holders'
figures read when asked (GetHostPressure, ``cpuservicectl status``, the metrics), and the
admission guard armed on the kernel's PSI triggers (cpuservice.host.psi; the decision is
cpuservice.model.starvation's).

An idle host costs the daemon nothing: the triggers wake it only when the kernel saw the
pressure, and the one timer (the episode's end) exists only while an episode lasts. Where the
triggers cannot be armed the guard is unavailable, said once in the log and in Capabilities
(PressureGuard, PressureGuardUnavailable), and admits everything. A trigger whose cgroup went
away (its slice stopped) is armed again at the next request that asks the guard."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from cpuservice.host import figures as reader
from cpuservice.host import psi
from cpuservice.model import starvation
from cpuservice.model.figures import Figures
from cpuservice.model.starvation import HOST_CGROUPS, Episode, Guard

log = logging.getLogger(__name__)


class HostPressure:
    """Figures of HOST_CGROUPS when asked, and the guard (``guard``: the configuration)."""

    def __init__(self, guard: Guard, root: Path = reader.CGROUP_ROOT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.guard = guard
        self.root = root
        self.clock = clock
        self.episode = Episode()
        self.triggers: dict[str, psi.Trigger] = {}
        self.unavailable = "" if guard.enabled else "admission_guard_percent is 0 (off)"
        self.events = 0  # the kernel's reports (tests, the benchmark)
        self.opener: Callable[[str], int] | None = None  # tests: a fake cpu.pressure
        self.on_change: Callable[[], None] = lambda: None  # an episode began or ended
        self._end: asyncio.TimerHandle | None = None

    # ---- figures ----

    def read(self) -> dict[str, Figures]:
        """Each watched cgroup's figures, from the kernel now (unknown ones left out)."""
        return {name: reader.read(group, None, self.root) for name, group in HOST_CGROUPS}

    # ---- the guard ----

    def start(self) -> bool:
        """Arm a trigger on every watched cgroup (the guard enabled); False, with the reason
        in ``unavailable`` and the log, when one cannot be armed."""
        if not self.guard.enabled:
            return False
        loop = asyncio.get_running_loop()
        spec = self.guard.trigger()
        armed = []
        for name, group in HOST_CGROUPS:
            if name in self.triggers and self.triggers[name].armed:
                continue
            path = psi.pressure_path(self.root, group)
            try:
                trigger = psi.Trigger(path, spec, functools.partial(self._fired, name),
                                      self.opener)
            except OSError as exc:
                why = f"no PSI trigger on {path}: {exc.strerror or exc} (cgroup v2 with PSI " \
                      "is needed; this host's hierarchy may be v1 or hybrid)"
                if why != self.unavailable:
                    log.warning("the admission guard is unavailable, requests are admitted "
                                "whatever the pressure: %s", why)
                self.unavailable = why
                return False
            trigger.watch(loop)
            self.triggers[name] = trigger
            armed.append(name)
        if armed:
            log.info("the admission guard is armed: PSI trigger %r on %s", spec,
                     ", ".join(armed))
        self.unavailable = ""
        return True

    @property
    def available(self) -> bool:
        return self.guard.enabled and not self.unavailable and bool(self.triggers)

    def _fired(self, name: str, kind: str) -> None:
        if kind == "gone":
            self.triggers.pop(name, None)
            log.info("the PSI trigger on %s is gone (its cgroup was removed); armed again at "
                     "the next request", name)
            return
        self.events += 1
        now = self.clock()
        began = not self.episode.starving(self.guard, now)
        self.episode = starvation.event(self.episode, self.guard, now, name)
        if began:
            log.warning("the shared pool is starving: the CPU pressure of %s is above %g %% "
                        "(admission guard: requests that take CPUs from it are refused)",
                        name, self.guard.percent)
            self.on_change()
        if self._end is not None:
            self._end.cancel()
        self._end = asyncio.get_running_loop().call_later(self.guard.hold, self._ended)

    def _ended(self) -> None:
        self._end = None
        now = self.clock()
        if self.episode.starving(self.guard, now):  # (an injected clock that lags)
            ends = self.episode.ends_at(self.guard) or now
            self._end = asyncio.get_running_loop().call_later(max(0.01, ends - now),
                                                              self._ended)
            return
        log.info("the shared pool is no longer starving (no pressure above %g %% for %g s; "
                 "it lasted %.0f s)", self.guard.percent, self.guard.hold,
                 self.episode.lasted(self.episode.last or now))
        self.on_change()

    def starving(self) -> bool:
        return self.available and self.episode.starving(self.guard, self.clock())

    def check(self, taken: int, what: str, override: str = starvation.FORCE) -> None:
        """SharedPoolStarving when the guard refuses a request that takes ``taken`` CPUs out
        of the shared pool now (see starvation.check)."""
        if not self.guard.enabled or taken <= 0:
            return
        if len(self.triggers) < len(HOST_CGROUPS):
            self.start()  # a cgroup that went away may be back
        if not self.starving():
            return
        avg10 = {n: f.some.avg10 for n, f in self.read().items() if f.some is not None}
        starvation.check(self.episode, self.guard, self.clock(), taken, what, avg10, override)

    def disarm(self) -> None:
        if self._end is not None:
            self._end.cancel()
            self._end = None
        for trigger in self.triggers.values():
            trigger.close()
        self.triggers.clear()
