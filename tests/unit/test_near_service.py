"""Option near through the service (issue 38), against the in-memory systemd: Allocate resolves
the devices in the daemon's sysfs tree and systemd gets CPUs and memory next to them; unknown
and hostile names are refused naming them and change nothing; the checkpoint and the slices'
Descriptions keep what was resolved, so a restart needs no device; a device gone later is a
health reason; Plan, Capacity, Resize and the properties agree."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cpuservice.apply import views
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs, InvalidArgument
from cpuservice.model.fixture_devices import write_devices
from cpuservice.model.near import KINDS
from tests.unit.test_service_fake import Host, agree, run

NODE1 = CPUSet.parse("4-7,12-15")  # machine b


def host(tmp: Path) -> Host:
    h = Host(tmp, procfs_root=str(tmp / "proc"))
    write_devices(h.root, "gpu-box", "b", proc=tmp / "proc")
    return h


def props(h: Host, svc: Any, name: str) -> dict[str, Any]:
    unit = svc.record(name).unit
    return h.fake.units[unit].props


def test_allocate_near_a_device_applies_cpus_and_memory_next_to_it(tmp_path: Path) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        await svc.allocate("g", "4", {"bind": True, "near": "eth1"}, 0)
        a = svc.ledger.allocations["g"]
        assert a.whole <= NODE1 and a.request.options.near == "eth1@1@net@0000:3b:00.0"
        have = props(h, svc, "g")
        assert CPUSet.from_mask(bytes(have["AllowedCPUs"])) == a.whole
        assert CPUSet.from_mask(bytes(have["AllowedMemoryNodes"])) == CPUSet([1])
        agree(svc, h.fake)
        values = views.allocation(svc.topology, svc.state, "g")
        assert values["NearDevices"] == [["eth1", 1, "net", "0000:3b:00.0", "NUMA node 1"]]
        # what the bus sends it as, with every dbus-fast (1.x takes no tuple for a struct)
        from dbus_fast import Variant

        from cpuservice.bus.objects import ALLOCATION_SIGNATURES
        for key, value in values.items():
            Variant(ALLOCATION_SIGNATURES[key], value)
        assert values["NearPolicy"] == "required" and values["Aligned"]
        # a list (D-Bus as) of several kinds; NVIDIA through procfs
        await svc.allocate("h", "2", {"bind": True, "near": ["/dev/nvidia1", "mlx5_0"]}, 0)
        assert svc.ledger.allocations["h"].whole <= NODE1
        assert svc.engine.capabilities.near == KINDS
    run(body)


@pytest.mark.parametrize(("options", "error", "says"), [
    ({"near": "eth9"}, InvalidArgument, r"no device 'eth9' here \(no .*class"),
    ({"near": "/dev/../etc/shadow"}, InvalidArgument, "not . or .."),
    ({"near": "eth1@0@net@"}, InvalidArgument, "no '@'"),
    ({"near": ",".join(f"e{i}" for i in range(17))}, InvalidArgument, "at most 16"),
    ({"near": ["eth1", "a,b"]}, InvalidArgument, "none empty or with ','"),
    ({"near": 7}, InvalidArgument, "near"),
    ({"near": "eth1", "bind": False}, InvalidArgument, "needs 'bind'"),
    ({"near": "eth1", "cpus": "9"}, InsufficientCPUs, r"eth1 \(NUMA node 1\)"),
])
def test_bad_requests_are_named_and_change_nothing(tmp_path: Path, options: dict[str, Any],
                                                  error: type[Exception], says: str) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        state, mark = svc.state, h.fake.mark()
        cpus = options.pop("cpus", "2")
        with pytest.raises(error, match=says):
            await svc.allocate("g", cpus, {"bind": True, **options}, 0)
        assert svc.state is state and h.fake.mark() == mark
    run(body)


def test_plan_capacity_and_resize_keep_to_the_device(tmp_path: Path) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        opts = {"bind": True, "near": "nvme0n1"}
        assert svc.plan("3", opts).cpus <= NODE1
        assert svc.plan("3", opts).memory_nodes == CPUSet([1])
        assert svc.capacity("2", opts) == 4
        await svc.allocate("g", "2", opts, 0)
        await svc.resize("g", "8")
        assert svc.ledger.allocations["g"].whole == NODE1
        with pytest.raises(InsufficientCPUs, match="nvme0n1"):
            await svc.resize("g", "9")
        agree(svc, h.fake)
    run(body)


def test_a_restart_needs_no_device_and_a_gone_device_is_a_health_reason(tmp_path: Path
                                                                       ) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        await svc.allocate("g", "2", {"bind": True, "near": "eth1",
                                      "near-policy": "preferred"}, 0)
        before = svc.ledger.allocations
        os.unlink(h.root / "class/net/eth1")  # the NIC is gone (unplugged, driver unbound)
        mark = h.fake.mark()
        again = await h.service()
        assert again.ledger.allocations == before
        assert h.fake.writes[mark[1]:] == []  # nothing running was touched
        values = views.allocation(again.topology, again.state, "g")
        assert values["Health"] == "degraded" and "device eth1 not found" in values[
            "HealthReason"]
        assert values["NearDevices"][0][1] == 1  # the node recorded when it was made
        (h.root / "class/net/eth1").symlink_to("../../devices/pci0000:3b/0000:3b:00.0/0000:3b:"
                                               "00.0/net/eth1")
        await again.revalidate()
        assert views.allocation(again.topology, again.state, "g")["Health"] == "ok"
        # the checkpoint lost: the slice's Description still says where the device was
        Path(h.cfg.state_file).write_text("garbage\n")
        third = await h.service()
        assert third.ledger.allocations["g"].request == before["g"].request
        agree(third, h.fake)
    run(body)


def test_the_command_lines_take_near_repeated() -> None:
    from cpuservice.cli import run
    from cpuservice.cli.ctl import parse
    from cpuservice.cli.options import options_of
    args = parse(["allocate", "g", "2", "--near", "eth1", "--near", "/dev/nvidia0",
                  "--near-policy", "preferred"])
    assert options_of(args) == {"near": "eth1,/dev/nvidia0", "near-policy": "preferred",
                                "bind": True}
    line = run.scan(["--near", "eth1", "--cpus", "2", "serve", "--near", "x"])
    assert line.ours == ["--near", "eth1", "--cpus", "2"] and line.command == ["serve", "--near",
                                                                               "x"]
    assert options_of(run.parser().parse_args(line.ours))["near"] == "eth1"


def test_devices_are_drawn_under_their_node(tmp_path: Path) -> None:
    """cpuservicectl topology: the devices the daemon found at startup (Capabilities'
    NearDevices) at their NUMA node; those without one below the tree."""
    from cpuservice.cli.topoview import Pools, near_devices, render
    from cpuservice.host.devices import Resolver
    from cpuservice.model.fixtures import MACHINES, write_sysfs

    root = write_sysfs(tmp_path / "sys", "b")
    write_devices(root, "gpu-box", "b", proc=tmp_path / "proc")
    found = Resolver(root, tmp_path / "proc").inventory()
    assert {d.name for d in found} == {"eth0", "eth1", "eth2", "mlx5_0", "card0", "nvme0",
                                       "/dev/nvidia0", "/dev/nvidia1"}  # lo: virtual
    caps = {"Capabilities": {"NearDevices": [[d.name, d.node, d.kind, d.address]
                                             for d in found]}}
    t = MACHINES["b"].topology()
    pools = Pools(t.online, CPUSet(), CPUSet(), t.online)
    text = render(json.loads(t.to_json()), pools, [], devices=near_devices(caps))
    assert "NUMA node 0  devices: eth0 card0 /dev/nvidia0" in text, text
    assert "NUMA node 1  devices: eth1 mlx5_0 nvme0 /dev/nvidia1" in text, text
    assert "Devices without NUMA locality here: eth2 (net 0000:3b:00.1)" in text, text
    assert "devices" not in render(json.loads(t.to_json()), pools, [])
