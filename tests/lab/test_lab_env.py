"""The VM lab itself: enforcement, real hotplug uevents, polkit with a real user, shapes."""

from __future__ import annotations

import json

import pytest

from tests.envs import lab
from tests.lab import plan


@pytest.fixture(scope="module")
def boot(main_boot: lab.Run) -> lab.Run:
    return main_boot


def test_every_scenario_ran(boot: lab.Run) -> None:
    assert list(boot.results) == list(plan.MAIN)


def test_pure_cgroup_v2_with_cpuset(boot: lab.Run) -> None:
    out = boot.results["cgroup"].output
    assert out.startswith("cgroup2fs") and "cpuset" in out and " cpu " in f" {out} "


def test_allowed_cpus_is_enforced(boot: lab.Run) -> None:
    result = boot.results["enforce"]
    assert result.status == 0 and "Cpus_allowed_list:\t3" in result.output


def test_topology_discovery_on_the_real_kernel(boot: lab.Run) -> None:
    facts = json.loads(boot.results["topology"].output.strip().splitlines()[-1])
    assert facts == {"cpus": 8, "sockets": 2, "nodes": 2, "cores": 4, "tpc": 2,
                     "isolated": "", "sibling0": "0-1"}


def test_offlining_a_cpu_sends_udev_events(boot: lab.Run) -> None:
    out = boot.results["udev"].output
    assert "online after offline: 0-2,4-7" in out and "online after online: 0-7" in out
    assert any(line.startswith("KERNEL") and "offline" in line and "cpu3" in line
               for line in out.splitlines())
    assert any(line.startswith("UDEV") and "offline" in line and "cpu3" in line
               for line in out.splitlines())
    assert any(line.startswith("UDEV") and "online" in line and "cpu3" in line
               for line in out.splitlines())
    assert "offline cpu3" in out and "online cpu3" in out  # pyudev, kernel source


def test_unprivileged_user_is_refused_by_polkit(boot: lab.Run) -> None:
    out = boot.results["polkit"].output
    assert "uid=1000(alice)" in out
    assert "Interactive authentication required" in out
    assert "systemd-run status 0" not in out and "busctl status 0" not in out


def test_other_shapes_and_kernel_arguments(small_boot: lab.Run) -> None:
    facts = json.loads(small_boot.results["topology"].output.strip().splitlines()[-1])
    assert facts == {"cpus": 4, "sockets": 1, "nodes": 1, "cores": 2, "tpc": 2,
                     "isolated": "3", "sibling0": "0-1"}


def sysfs_facts(boot: lab.Run) -> dict[str, dict]:
    out = boot.results["sysfs"]
    assert out.status == 0, out.output
    return out.checks()


def test_what_the_kernel_shows_of_an_offline_cpu(boot: lab.Run) -> None:
    """The facts discovery relies on (and tests.unit.helpers.write_hotplug_state reproduces):
    an offline CPU has no topology or cache directory and is in no node's cpulist, but keeps its
    cpuN/nodeM link."""
    offline = sysfs_facts(boot)["offline"]
    assert "topology" not in offline["dir"] and "cache" not in offline["dir"]
    assert offline["node_links"] == ["node0"]
    assert all("3" not in text.replace("0-2", "") for text in offline["node_cpulists"].values())


def test_hotplug_goes_through_half_way_states(boot: lab.Run) -> None:
    """While cpu3 goes off- and online, (online mask, topology files, L3 cache files, node
    cpulist) change one after the other, in an order that differs from run to run (seen:
    (F,T,F,F), (F,T,F,T), (F,T,T,T), (T,T,T,F)): the unit tests try every combination
    (tests/unit/test_topology_hotplug.py). Here: the ends are whole, and the facts are kept in
    the test's output."""
    facts = sysfs_facts(boot)["transitions"]
    on, off = [True] * 4, [False] * 4
    assert facts["going_off"][0] == on and facts["going_off"][-1] == off, facts
    assert facts["coming_on"][0] == off and facts["coming_on"][-1] == on, facts
