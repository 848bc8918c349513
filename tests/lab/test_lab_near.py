"""Option near and near-irqs on a real kernel (issue 38): QEMU's PCI expander bridge on NUMA
node 1 with a virtio-net interface and an NVMe controller behind it (tests/lab/plan.py NEAR,
tests/lab/scenarios/near.py)."""

from __future__ import annotations

from tests.envs import lab


def test_devices_behind_the_node1_bridge_get_node1_cpus_and_keep_their_irqs_off(
        near_boot: lab.Run) -> None:
    install = near_boot.results["install"]
    assert install.status == 0, install.output
    result = near_boot.results["near"]
    print(result.output)  # shown when it fails (-rA: always)
    assert result.status == 0, result.output
    found = result.checks()
    sysfs = found["sysfs"]
    assert sysfs["near_if_node"] == 1 and sysfs["nvme_node"] == 1, sysfs
    assert sysfs["root_if_node"] == -1, sysfs
    node1 = set(sysfs["node1"])
    for name in ("nearnet", "neardisk"):
        row = found[name]
        held = set(row["cpus"])
        assert held and held <= node1 and row["memory_nodes"] == "1" and row["aligned"], row
        assert row["local"] and row["why"] == "", row
        assert set(lab_cpus(row["planned"])) == node1 - held, row
        # every interrupt of the device that the kernel lets move is on node 1's shared CPU
        assert row["confined"] and all(set(cpus) == node1 - held
                                       for cpus in row["affinity"].values()), row
        # and none arrived on the allocation's CPU while traffic or I/O ran; before, in a
        # moment of load, at most the one arrival of each interrupt whose move the kernel
        # deferred (reported pending: x86 without interrupt remapping)
        assert row["on_allocation"] == 0, row
        assert row["warmup_on_allocation"] <= len(row["pending"]), row
    assert found["nearnet"]["on_node1_shared"] > 0, found["nearnet"]
    # the NVMe's I/O queues are managed interrupts: the kernel keeps them (reported unmovable)
    assert found["neardisk"]["unmovable"], found["neardisk"]
    required = found["required"]["refused"]
    assert "InsufficientCPUs" in required and "node 1" in required, required
    preferred = found["preferred"]
    assert not preferred["aligned"] and "device-remote" in preferred["reason"], preferred
    assert not preferred["local"] and "no shared CPU left on node 1" in preferred["why"]
    assert set(lab_cpus(preferred["planned"])) == set(preferred["shared"]), preferred
    assert not set(preferred["shared"]) & set(preferred["cpus"]), preferred
    run = found["run"]
    assert run["status"] == 0 and run["allowed"], run
    assert set(lab_cpus(run["allowed"][0])) <= node1, run


def lab_cpus(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out
