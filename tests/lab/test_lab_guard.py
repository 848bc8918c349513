"""The admission guard on a real kernel with cgroup v2 (issue 39, the host's side;
tests/lab/scenarios/guard.py): armed under the unit's sandbox (PSI triggers written to the
watched cpu.pressure files), busy loops in system.slice make a bound Allocate refused with
SharedPoolStarving until the load stops, and an idle daemon with the guard armed costs nothing
measurable over a minute. In a whole lab run the scenario is part of the main boot; run alone,
this module boots just the service's installation and the scenario."""

from __future__ import annotations

from typing import Any

import pytest

from tests.lab.conftest import main_scenario


@pytest.fixture(scope="module")
def guard(lab_ready: None) -> dict[str, dict[str, Any]]:
    result = main_scenario("guard")
    print(f"\n{result.output[-4000:]}")
    assert result.status == 0, result.output
    return result.checks()


def test_the_guard_is_armed_under_the_sandbox(guard: dict[str, dict[str, Any]]) -> None:
    armed = guard["armed"]
    assert armed["guard"] is True and armed["why"] == "" and armed["available"], armed


def test_a_starving_pool_refuses_what_would_take_from_it(
        guard: dict[str, dict[str, Any]]) -> None:
    starving, refused = guard["starving"], guard["refused"]
    assert "system.slice" in starving["cgroups"], starving
    assert refused["status"] != 0, refused
    assert "SharedPoolStarving" in refused["error"] or "starving" in refused["error"], refused
    assert "system.slice" in refused["error"] and "force" in refused["error"], refused
    assert refused["guard_line"] and "STARVING" in refused["guard_line"][0], refused
    assert refused["unbound"] == 0 and refused["forced"] == 0, refused


def test_admitted_once_the_load_stops(guard: dict[str, dict[str, Any]]) -> None:
    # the kernel's last report, then admission_guard_hold_seconds (6) without one
    assert guard["admitted"]["seconds"] <= 30, guard["admitted"]


def test_an_idle_daemon_with_the_guard_stays_idle(guard: dict[str, dict[str, Any]]) -> None:
    idle = guard["idle"]
    print(f"\nidle daemon, guard armed, {idle['seconds']} s: {idle['cpu_ms']} ms CPU "
          f"({idle['cpu_percent']} %), run {idle['runs']} times, {idle['events']} trigger events")
    assert idle["armed"] and idle["events"] == 0, idle
    assert idle["cpu_percent"] < 0.05, idle  # 0.0 % at one decimal
