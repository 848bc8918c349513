"""How each allocation fares (issue 39), step 4: health reasons pressured, throttled and
memory-remote from its figures, with thresholds and hysteresis on an injected clock
(cpuservice.model.health), in Health/HealthReason, AllocationChanged, the journal and the
metrics (cpuservice.shell.health)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.apply import views
from cpuservice.bus.api import Manager
from cpuservice.host import figure_metrics, journal
from cpuservice.model import config as config_mod
from cpuservice.model import health
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.figures import figures
from cpuservice.model.fixtures import MACHINES
from cpuservice.model.health import MEMORY_REMOTE, PRESSURED, THROTTLED, Limits, Track, step
from cpuservice.model.pools import Ledger
from cpuservice.model.request import Request
from cpuservice.model.state import Record, State
from cpuservice.shell.health import HealthMonitor
from tests.props import examples
from tests.unit.test_service_fake import Host

HOLD = 30.0


def test_a_reason_is_raised_after_the_hold_and_cleared_below_half() -> None:
    t = Track()
    t = step(t, 25.0, 0.0, 20.0, HOLD)
    assert t == Track(False, 0.0)  # above: pending since 0
    t = step(t, 50.0, 29.0, 20.0, HOLD)
    assert not t.raised
    t = step(t, 21.0, 30.0, 20.0, HOLD)
    assert t == Track(True, None)  # 30 s at or above 20 %
    t = step(t, 15.0, 40.0, 20.0, HOLD)  # below the threshold, not below half: stays
    assert t == Track(True, None)
    t = step(t, 9.0, 50.0, 20.0, HOLD)
    assert t == Track(True, 50.0)
    t = step(t, 12.0, 60.0, 20.0, HOLD)  # back above half: the clearing starts over
    assert t == Track(True, None)
    t = step(t, None, 70.0, 20.0, HOLD)  # unknown counts as below
    t = step(t, 0.0, 100.0, 20.0, HOLD)
    assert t == Track(False, None)


def test_a_dip_restarts_the_hold() -> None:
    t = step(Track(), 30.0, 0.0, 20.0, HOLD)
    t = step(t, 10.0, 20.0, 20.0, HOLD)
    t = step(t, 30.0, 25.0, 20.0, HOLD)
    t = step(t, 30.0, 50.0, 20.0, HOLD)
    assert not t.raised
    assert step(t, 30.0, 55.0, 20.0, HOLD).raised


def test_a_threshold_of_zero_turns_the_reason_off() -> None:
    assert step(Track(True), 100.0, 0.0, 0.0, 0.0) == Track()


@settings(max_examples=examples(200))
@given(readings=st.lists(st.tuples(st.floats(0.5, 20.0),
                                   st.one_of(st.none(), st.floats(0.0, 100.0))),
                         min_size=1, max_size=40),
       threshold=st.sampled_from([5.0, 20.0, 50.0]), hold=st.sampled_from([0.0, 10.0, 30.0]))
def test_the_hysteresis_is_a_recomputation_from_the_history(
        readings: list[tuple[float, float | None]], threshold: float, hold: float) -> None:
    """After every reading, the reason is raised exactly when, going through the history from
    the start, the last switch happened once the figure had been on the other side (at or
    above the threshold to raise, below half of it to clear) for ``hold`` seconds in a row."""
    t, now, history = Track(), 0.0, []
    for dt, value in readings:
        now += dt
        t = step(t, value, now, threshold, hold)
        history.append((now, value))
        raised, since = False, None
        for when, v in history:  # the reference: the same rule, spelled out over the history
            beyond = (v is None or v < threshold / 2) if raised else \
                (v is not None and v >= threshold)
            if not beyond:
                since = None
                continue
            since = when if since is None else since
            if when - since >= hold:
                raised, since = not raised, None
        assert t.raised == raised


def reading(at: float, pressure: float | None = None, periods: int = 0, throttled: int = 0,
            remote: tuple[int, int] | None = None) -> Any:
    texts: dict[str, str | None] = {
        "cpu.pressure": None if pressure is None else
        f"some avg10={pressure:.2f} avg60=0.00 avg300=0.00 total=1\n",
        "cpu.stat": f"usage_usec 1\nnr_periods {periods}\nnr_throttled {throttled}\n"
                    "throttled_usec 0\n"}
    if remote is not None:
        texts["memory.numa_stat"] = f"anon N0={remote[0]} N1={remote[1]}\nfile N0=0 N1=0\n"
    return figures(int(at * 1e6), texts, CPUSet([0]) if remote is not None else None)


def test_every_reason_has_its_figure() -> None:
    limits, tracks = Limits(hold=0.0), {}
    before = {"a": reading(0, periods=100, throttled=0).values()}
    after = {"a": reading(10, pressure=25.0, periods=200, throttled=30,
                          remote=(70, 30)).values()}
    tracks = health.assess(tracks, before, after, 10.0, limits)
    assert health.raised(tracks["a"]) == (PRESSURED, THROTTLED, MEMORY_REMOTE)
    quiet = {"a": reading(20, pressure=1.0, periods=300, throttled=31, remote=(99, 1)).values()}
    assert health.raised(health.assess(tracks, after, quiet, 20.0, limits)["a"]) == ()
    assert health.describe((PRESSURED,)).startswith("pressured: ")


def test_the_config_keys_and_their_documentation(tmp_path: Path) -> None:
    cfg = config_mod.validate({"state_file": str(tmp_path / "s.json")})
    assert cfg.health_limits == Limits(20.0, 20.0, 20.0, 30.0)
    assert cfg.statistics_seconds == 10
    with pytest.raises(config_mod.ConfigError, match="health_pressure_percent"):
        config_mod.validate({"health_pressure_percent": 101})
    with pytest.raises(config_mod.ConfigError, match="health_seconds: True is not a number"):
        config_mod.validate({"health_seconds": True})
    root = Path(__file__).parents[2]
    shipped = (root / "systemd/cpuservice.toml").read_text()
    page = (root / "docs/man/cpuservice.toml.5.scd").read_text()
    for key in ("statistics_seconds", "health_pressure_percent", "health_throttled_percent",
                "health_memory_remote_percent", "health_seconds"):
        assert f"\n#{key} = {getattr(cfg, key):g}\n" in shipped, key
        assert f"*{key}* = {getattr(cfg, key):g}" in page, key


# ---- the service: Health, AllocationChanged, the journal, the metrics ----

def test_the_monitor_raises_and_clears_through_the_service(tmp_path: Path) -> None:
    host = Host(tmp_path)
    clock = [0.0]

    async def body() -> None:
        svc = await host.service()
        rec = journal.Recorder()
        svc.engine.audit = rec
        await svc.allocate("web", "2", {"bind": True}, 0)
        await svc.allocate("job", "0.5", {}, 0)
        manager = Manager(svc, None, None)  # type: ignore[arg-type]
        svc.engine.events.sinks.remove(manager)  # (no bus to export on: its values only)
        monitor = HealthMonitor(svc.engine, Limits(hold=20.0), lambda: clock[0])
        seen = len(host.events.seen)

        def observe(at: float, web: float | None, job: float | None) -> None:
            clock[0] = at
            monitor.observe({"web": reading(at, web), "job": reading(at, job)})

        observe(0, 50.0, 1.0)
        observe(10, 50.0, 1.0)
        assert svc.engine.strain == {} and len(host.events.seen) == seen
        observe(20, 50.0, 1.0)  # 20 s at or above 20 %: raised
        assert svc.engine.strain == {"web": (PRESSURED,)}
        assert host.events.seen[seen:] == [("changed", ("web", {
            "Health": "degraded", "HealthReason": health.describe((PRESSURED,))}))]
        values = manager.allocation_values("web")
        assert values["Health"] == "degraded" and values["State"] == "active"
        assert values["HealthReason"] == health.describe((PRESSURED,))
        entry = rec.events[-1]
        assert entry.kind == journal.Kind.HEALTH and entry.priority == journal.WARNING
        assert dict(entry.extra)["HEALTH"] == "pressured"
        assert "pressured (CPU pressure (some avg10) 50.0% >= 20%)" in entry.message
        strain = svc.engine.strain
        observe(30, 40.0, 1.0)  # nothing changes: the same mapping, nothing announced
        assert svc.engine.strain is strain and len(rec.events) == 3
        # a change of the allocation keeps its health reason (the same on both sides)
        await svc.resize("web", "3")
        assert "HealthReason" not in host.events.seen[-1][1][1]
        assert manager.allocation_values("web")["HealthReason"] == health.describe(
            (PRESSURED,))
        text = figure_metrics.render({}, ["web", "job"], None, svc.engine.strain)
        assert 'cpuservice_allocation_health{allocation="web",reason="pressured"} 1' in text
        observe(40, 5.0, 1.0)
        observe(60, 5.0, 1.0)  # 20 s below half of 20 %: cleared
        assert svc.engine.strain == {}
        assert host.events.seen[-1] == ("changed", ("web", {"Health": "ok",
                                                            "HealthReason": ""}))
        assert rec.events[-1].priority > journal.WARNING  # notice
        assert rec.events[-1].reason == "pressured cleared"
        assert manager.allocation_values("web")["Health"] == "ok"

    asyncio.run(body())


def test_a_released_allocation_leaves_the_monitor(tmp_path: Path) -> None:
    host = Host(tmp_path)

    async def body() -> None:
        svc = await host.service()
        await svc.allocate("web", "1", {"bind": True}, 0)
        monitor = HealthMonitor(svc.engine, Limits(hold=0.0), lambda: 0.0)
        monitor.observe({"web": reading(0, 90.0)})
        assert svc.engine.strain == {"web": (PRESSURED,)}
        await svc.release("web")
        seen = len(host.events.seen)
        monitor.observe({"web": reading(1, 90.0)})  # read before the release was committed
        assert svc.engine.strain == {} and monitor.tracks == {}
        assert len(host.events.seen) == seen  # nothing said of an allocation that is gone

    asyncio.run(body())


def test_views_keep_state_apart_from_health() -> None:
    t = MACHINES["b"].topology()
    ledger, _ = placement.allocate(t, Ledger(t.online), "a", Request.parse("1", {"bind": True}))
    state = State(ledger, {"a": Record(unit="cpuservice-bound-a.slice")})
    v = views.allocation(t, state, "a", None, (THROTTLED, MEMORY_REMOTE))
    assert (v["State"], v["Health"]) == ("active", "degraded")
    assert v["HealthReason"] == health.describe((THROTTLED, MEMORY_REMOTE))
    assert views.allocation(t, state, "a")["Health"] == "ok"
