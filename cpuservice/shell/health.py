"""Health from how allocations fare (issue 39), the shell's part: after each reading of every
allocation's figures (cpuservice.shell.statistics.Sampler), step the pure hysteresis of
cpuservice.model.health on the monitor's clock, and when an allocation's reasons change,
replace the engine's ``strain`` (which Health and HealthReason are computed with), announce it
(AllocationChanged with reason ``health`` and its PropertiesChanged) and write a journal entry
(kind ``health``, CPUSERVICE_HEALTH: the reasons raised now)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from cpuservice.apply import views
from cpuservice.host import journal
from cpuservice.model import health
from cpuservice.model.figures import Figures
from cpuservice.shell.engine import Engine

log = logging.getLogger(__name__)
REASON = "health"  # of AllocationChanged
FIGURE = {health.PRESSURED: "CPU pressure (some avg10)", health.THROTTLED: "throttled periods",
          health.MEMORY_REMOTE: "memory on other nodes"}


class HealthMonitor:
    """Steps every allocation's health reasons after each reading (``observe``)."""

    def __init__(self, engine: Engine, limits: health.Limits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.limits = limits
        self.clock = clock
        self.tracks: dict[str, dict[str, health.Track]] = {}
        self._before: dict[str, dict[str, Any]] = {}

    def observe(self, latest: Mapping[str, Figures]) -> None:
        """A reading of every allocation's figures was taken now."""
        after = {name: f.values() for name, f in latest.items()}
        allocations = self.engine.state.ledger.allocations
        after = {n: v for n, v in after.items() if n in allocations}
        self.tracks = health.assess(self.tracks, self._before, after, self.clock(), self.limits)
        before, self._before = self._before, after
        old = self.engine.strain
        new = {}
        for name, tracks in self.tracks.items():
            reasons = health.raised(tracks)
            if reasons:
                new[name] = old[name] if old.get(name) == reasons else reasons
        if new == dict(old):
            return
        self.engine.strain = MappingProxyType(new)
        for name in sorted(set(old) | set(new)):
            if old.get(name, ()) != new.get(name, ()) and name in allocations:
                self._announce(name, old.get(name, ()), new.get(name, ()), before.get(name),
                               after.get(name, {}))

    def _announce(self, name: str, was: tuple[str, ...], now: tuple[str, ...],
                  before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> None:
        engine = self.engine
        report = engine.partition_report(name)
        diff = views.changed(views.allocation(engine.topology, engine.state, name, report, was),
                             views.allocation(engine.topology, engine.state, name, report, now))
        engine.events.allocation_changed(name, REASON, diff)
        raised = [r for r in now if r not in was]
        cleared = [r for r in was if r not in now]
        figures = health.values(before, after)
        why = ", ".join([f"{r} ({_figure(r, figures[r])} >= {self.limits.of(r):g}%)"
                         for r in raised] + [f"{r} cleared" for r in cleared])
        event = journal.event(journal.Kind.HEALTH, engine.topology, engine.state, name, why,
                              report, health=",".join(now))
        engine.audit.send(dataclasses.replace(event, state="degraded") if now else event)
        log.info("allocation %s: health %s", name, why)


def _figure(reason: str, value: float | None) -> str:
    return f"{FIGURE[reason]} {'unknown' if value is None else f'{value:.1f}%'}"
