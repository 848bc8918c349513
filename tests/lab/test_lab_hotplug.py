"""cpuserviced in the VM lab: real CPU hotplug with a real process in a bound allocation."""

from __future__ import annotations

import pytest

from tests.envs import lab


def results(outcome: lab.Run, name: str) -> dict[str, dict]:
    out = outcome.results[name]
    assert out.status == 0, out.output
    return out.checks()


@pytest.fixture(scope="module")
def boot(main_boot: lab.Run) -> lab.Run:
    return main_boot


def test_service_runs_in_the_vm(boot: lab.Run) -> None:
    result = boot.results["install"]
    assert result.status == 0 and result.output.strip().endswith("active"), result.output


def test_offline_cpu_of_a_bound_allocation_is_replaced(boot: lab.Run) -> None:
    check_repair(results(boot, "repair"))


def check_repair(r: dict[str, dict]) -> None:
    """hotplug.py repair: the offline CPU of a bound allocation replaced, in its unit and for
    its process; back in the shared pool once online."""
    start, offline, online = r["start"], r["offline"], r["online"]
    assert start["process"] == start["held"] and len(start["held"]) == 2
    victim = offline["victim"]
    assert victim not in offline["held"] and len(offline["held"]) == 2
    assert offline["unit"] == offline["held"]
    assert offline["process"] == offline["held"]  # the kernel enforces the repaired set
    assert victim not in offline["shared"] and not set(offline["shared"]) & set(offline["held"])
    assert online["online"] == "0-7" and victim in online["shared"]
    assert online["held"] == offline["held"]


def test_storm_of_toggles_while_clients_allocate(boot: lab.Run) -> None:
    s = results(boot, "storm")["storm"]
    assert s["online"] == "0-7" and s["active"] == "active" and s["restarts"] == "0"
    assert s["degraded"] == [] and s["units_agree"] and not s["double_booked"]
    assert s["errors"] == []


def test_cpuservice_run_runs_on_exactly_its_cpus(boot: lab.Run) -> None:
    assert boot.results["cli"].status == 0, boot.results["cli"].output
    out = boot.results["cli"].output
    allowed = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                   if line.startswith("Cpus_allowed_list:"))
    cpuset = next(line.split('"')[1] for line in out.splitlines() if line.startswith("s \""))
    assert allowed == cpuset and len(allowed) > 0
    assert "exit 0" in out and "after exit: 0" in out


def test_cpuservice_run_released_after_kill9_of_the_wrapper(boot: lab.Run) -> None:
    assert boot.results["cli"].status == 0, boot.results["cli"].output
    out = boot.results["cli"].output
    assert "running: 1" in out and "after kill: 0" in out
