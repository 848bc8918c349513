"""The NRT export carries the devices per Node zone (issue 38): each zone's devices (the ones
option near can name), their PCIe root complexes and its NUMA node under the names DRA drivers
use (resource.kubernetes.io/pcieRoot, numaNode), the cores kept next to them; devices without
a node at the top level. Read from a fixture sysfs tree with the daemon's own Resolver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cpuservice.host.devices import Resolver
from cpuservice.model import keep, nrt
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixture_devices import dev_of, write_devices
from cpuservice.model.fixtures import MACHINES, write_sysfs
from cpuservice.model.pools import Ledger
from tests.schema import nrt_errors


@pytest.fixture(scope="module")
def gpu_box(tmp_path_factory: pytest.TempPathFactory) -> Resolver:
    tmp = tmp_path_factory.mktemp("gpu-box")
    sys_root = write_sysfs(tmp / "sys", "b")
    numbers = write_devices(sys_root, "gpu-box", "b", proc=tmp / "proc")
    return Resolver(sys_root, tmp / "proc", "/dev", dev_of(numbers))


def attrs(items: list[dict[str, str]]) -> dict[str, str]:
    return {a["name"]: a["value"] for a in items}


def zone(obj: dict[str, Any], name: str) -> dict[str, str]:
    return attrs(next(z for z in obj["zones"] if z["name"] == name)["attributes"])


def test_the_roots_are_the_pcie_root_complexes(gpu_box: Resolver) -> None:
    roots = gpu_box.roots(gpu_box.inventory())
    assert roots["0000:3b:00.0"] == "pci0000:3b"
    assert roots["0000:af:00.0"] == "pci0000:af"  # on the root bus itself
    assert set(roots.values()) <= {f"pci0000:{a[5:7]}" for a in roots}


def test_node_zones_carry_their_devices_roots_and_node(gpu_box: Resolver) -> None:
    t = MACHINES["b"].topology()
    devices = gpu_box.inventory()
    obj = nrt.export(t, Ledger(t.online), "gpu-box", 0, None, devices, gpu_box.roots(devices))
    assert nrt_errors(obj) == []
    node0, node1 = zone(obj, "node-0"), zone(obj, "node-1")
    assert node0["resource.kubernetes.io/numaNode"] == "0"
    assert node1["resource.kubernetes.io/numaNode"] == "1"
    assert node0["cpuservice.io/devices"] == (
        "eth0=0000:17:00.0,card0=0000:18:00.0,/dev/nvidia0=0000:19:00.0")
    assert node0["resource.kubernetes.io/pcieRoot"] == "pci0000:17,pci0000:18,pci0000:19"
    assert node1["cpuservice.io/devices"] == (
        "eth1=0000:3b:00.0,mlx5_0=0000:5e:00.0,nvme0=0000:86:00.0,/dev/nvidia1=0000:af:00.0")
    assert node1["resource.kubernetes.io/pcieRoot"] == "pci0000:3b,pci0000:5e,pci0000:86,pci0000:af"
    top = attrs(obj["attributes"])
    assert top["cpuservice.io/devices-without-numa-node"] == "eth2=0000:3b:00.1"
    assert "cpuservice.io/kept-cpus" not in node0


def test_kept_cores_are_shown_on_their_node(gpu_box: Resolver) -> None:
    t = MACHINES["b"].topology()
    devices = gpu_box.inventory()
    plan = keep.plan(t, CPUSet(), (keep.Rule("nvidia", "*", 1),), devices)
    obj = nrt.export(t, Ledger(t.online, keep=plan), "gpu-box", 0, None, devices)
    assert zone(obj, "node-0")["cpuservice.io/kept-cpus"] == "3,11"
    assert zone(obj, "node-1")["cpuservice.io/kept-cpus"] == "7,15"
    assert "resource.kubernetes.io/pcieRoot" not in zone(obj, "node-0")  # no roots given


def test_no_devices_no_device_attributes(tmp_path: Path) -> None:
    t = MACHINES["b"].topology()
    obj = nrt.export(t, Ledger(t.online), "plain", 0)
    assert not any(k.startswith("cpuservice.io/devices") for k in attrs(obj["attributes"]))
    assert "cpuservice.io/devices" not in zone(obj, "node-0")
    assert zone(obj, "node-0")["resource.kubernetes.io/numaNode"] == "0"
