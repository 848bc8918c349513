"""Kernel cpuset partitions through systemd's CPUSetPartition=, on the real thing: Debian sid's
systemd (>= 261) and kernel (7.x) in the second VM lab (lab.SID); and on Debian 12, where an
explicit partition is a named error. `make test-lab-modern` runs this module alone."""

from __future__ import annotations

import pytest

from tests.envs import lab
from tests.lab.test_lab_hotplug import results


@pytest.fixture(scope="module")
def boot(modern_boot: lab.Run) -> lab.Run:
    return modern_boot


def test_the_modern_lab_is_sid(boot: lab.Run) -> None:
    out = boot.results["versions"]
    assert out.status == 0, out.output
    kernel, systemd = out.output.splitlines()[:2]
    assert int(kernel.split(".")[0]) >= 7, kernel
    assert int(systemd.split()[1]) >= 261, systemd
    assert "cpuset" in out.output


def test_capabilities_report_partitions(boot: lab.Run) -> None:
    caps = results(boot, "capabilities")["capabilities"]
    assert caps["Partitions"] == ["none", "root", "isolated"], caps
    assert caps["SystemdCPUSetPartition"] and caps["KernelPartitions"]
    assert caps["PartitionsUnavailable"] == ""


def test_an_isolated_partition_is_enforced_by_the_kernel(boot: lab.Run) -> None:
    r = results(boot, "partition-isolated")
    iso = r["isolated"]
    cpus = set(iso["cpus"])
    assert iso["unit"] == "cpuservice_partition_iso.slice"
    assert iso["kernel"] == "isolated" and iso["partition_state"] == "isolated"
    assert iso["partition"] == "isolated" and iso["state"] == "active"
    # the kernel's own report: out of load balancing, and out of every other cgroup
    assert cpus <= set(iso["root_isolated"]), iso
    assert not cpus & set(iso["system_effective"]), iso
    assert not cpus & set(iso["shared"]), iso
    # a system.slice process cannot be pinned there, and lost those CPUs; one inside runs there
    assert iso["taskset_status"] != 0 and "Invalid argument" in iso["taskset_error"], iso
    assert not cpus & set(iso["outsider"]), iso
    assert set(iso["insider"]) == cpus
    again = r["restarted"]
    assert again["status"] == 0 and again["kernel"] == "isolated", again
    assert again["partition_state"] == "isolated" and set(again["cpus"]) == cpus
    gone = r["released"]
    assert gone["unit_active"] != "active" and gone["root_isolated"] == "", gone
    assert gone["system_effective"] == list(range(8)), gone
    # the kernel's isolated list may name a partition's CPUs; released, they are shared again
    assert gone["shared"] == list(range(8)) and gone["isolated_cpus"] == "", gone


def test_a_partition_whose_cpu_goes_offline_is_degraded_then_repaired(boot: lab.Run) -> None:
    r = results(boot, "partition-offline")
    bad = r["degraded"]
    # no CPU to replace it: a plain member on the shared pool, its process not stranded
    assert bad["state"] == "degraded" and bad["kernel"] == "member", bad
    assert bad["partition_state"] == "member", bad
    assert bad["worker"] and set(bad["worker"]) <= set(bad["shared"]), bad
    assert bad["victim"] not in bad["worker"], bad
    fixed = r["repaired"]
    # announced: degraded, then active again on another CPU
    states = [s["State"] for s in fixed["seen"] if "State" in s]
    assert "degraded" in states and states[-1] == "active", fixed["seen"]
    assert fixed["victim"] not in fixed["cpus"] and fixed["kernel"] == "isolated", fixed
    assert fixed["partition_state"] == "isolated" and fixed["state"] == "active", fixed
    assert set(fixed["cpus"]) <= set(fixed["root_isolated"]), fixed
    assert fixed["worker"] == fixed["cpus"], fixed
    assert r["offline-released"]["root_isolated"] == "", r["offline-released"]


@pytest.mark.parametrize("scenario", ["repair", "repair-partitioned"])
def test_hotplug_repair_on_sid(boot: lab.Run, scenario: str) -> None:
    r = results(boot, scenario)
    offline = r["offline"]
    assert offline["victim"] not in offline["held"] and len(offline["held"]) == 2
    assert offline["unit"] == offline["held"] and offline["process"] == offline["held"]
    assert r["online"]["online"] == "0-7"


def test_hotplug_storm_on_sid(boot: lab.Run) -> None:
    storm = results(boot, "storm")["storm"]
    assert storm["online"] == "0-7" and storm["active"] == "active", storm
    assert storm["restarts"] == "0", storm
    assert storm["units_agree"] and not storm["double_booked"] and not storm["errors"], storm
    assert storm["degraded"] == [] and storm["invalid_partitions"] == {}, storm


def test_debian12_refuses_an_explicit_partition(main_boot: lab.Run) -> None:
    r = results(main_boot, "partition-refused")["refused"]
    assert r["error"].startswith("org.cpuservice1.Error.NotSupported"), r
    assert "systemd 252" in r["error"] and r["unchanged"], r
    assert r["partitions"] == ["none"] and "261" in r["why"]
