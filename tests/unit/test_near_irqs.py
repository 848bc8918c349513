"""Option near-irqs (issue 38): the interrupts of the devices an allocation names stay on the
shared pool's CPUs of each device's node, never on an allocation's CPUs, on a remote node only
while the device's node has no shared CPU (then the whole pool, saying why); through the kernel
holder, so that they leave CPUs before an allocation gets them and come back after, on every
path; the oneshot's shell on a fake sysfs and procfs; the report on the bus."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.apply import reconcile, views
from cpuservice.apply.targets import Targets, with_appearing
from cpuservice.host.irqbalance import Irqbalance
from cpuservice.host.irqs import IRQS, SET_KERNEL, Kernel
from cpuservice.model import config as config_mod
from cpuservice.model import device_irqs, near
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs, InvalidArgument, SystemdFailure
from cpuservice.model.near import Device
from cpuservice.model.request import Request
from cpuservice.model.state import Record, State
from tests.props import examples
from tests.unit.fake_systemd import Unit
from tests.unit.test_irqs import Oneshots, fake_proc
from tests.unit.test_near_service import NODE1, host
from tests.unit.test_service_fake import agree, check_window, run

from .test_capacity import build

ETH1 = "kernel:irqs:0000:3b:00.0"  # machine b, gpu-box: eth1 on node 1
NODE0 = CPUSet.parse("0-3,8-11")
KEEP = {"bind": True, "near": "eth1", "near-irqs": True}


def seeded(h: Any, svc: Any, unit: str = ETH1) -> None:
    """The device's interrupts before anything set them: on every online CPU (so that the
    timeline sees them where an allocation's CPUs will be)."""
    h.fake.units[unit] = Unit(unit, props={"AllowedCPUs": svc.ledger.online.to_mask()})


# ---- the plan (pure) ----

def test_the_plan_is_the_devices_node_shared_cpus_else_the_pool_saying_why(machine) -> None:
    topology = machine("b")
    shared = topology.online - CPUSet.parse("4-5")
    assert device_irqs.place(topology, shared, 1) == (CPUSet.parse("6-7,12-15"), True, "")
    cpus, local, why = device_irqs.place(topology, NODE0, 1)
    assert cpus == NODE0 and not local and "no shared CPU left on node 1" in why
    cpus, local, why = device_irqs.place(topology, shared, -1)
    assert cpus == shared and not local and "no NUMA locality" in why
    assert "does not have" in device_irqs.place(topology, shared, 7)[2]


def test_the_option_needs_near_and_a_configured_default_applies_only_with_it() -> None:
    with pytest.raises(InvalidArgument, match="option 'near-irqs': needs 'near'"):
        Request.parse("2", {"bind": True, "near-irqs": True})
    defaults = {"near-irqs": True}
    assert not Request.parse("2", {"bind": True}, defaults).options.near_irqs
    assert Request.parse("2", {"bind": True, "near": "eth1@1@net@0000:3b:00.0"},
                         defaults).options.near_irqs
    config = config_mod.validate({"defaults": {"near-irqs": True}})
    assert config.default_options.near_irqs


# ---- through the service: the ordering, on every path ----

def test_device_interrupts_leave_before_the_allocation_arrives_and_follow_the_pool(
        tmp_path: Path) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        seeded(h, svc)
        mark = h.fake.mark()
        await svc.allocate("g", "2", KEEP, 0)
        held = svc.ledger.allocations["g"].whole
        assert held <= NODE1
        check_window(h.fake, mark, svc.ledger.exclusive)
        assert h.fake.cpus(ETH1) == svc.ledger.shared & NODE1
        # another allocation on node 1, without the option: the device's CPUs shrink first
        for name, cpus in (("n1", "4"), ("resize", "")):
            mark, before = h.fake.mark(), svc.ledger.exclusive
            if name == "resize":
                await svc.resize("g", "3")
            else:
                await svc.allocate(name, cpus, {"bind": True, "near": "mlx5_0"}, 0)
            check_window(h.fake, mark, before | svc.ledger.exclusive)
            assert h.fake.cpus(ETH1) == svc.ledger.shared & NODE1
            assert not h.fake.cpus(ETH1) & svc.ledger.held
        # node 1 full: the whole shared pool, and the bus says why
        await svc.allocate("full", "1", {"bind": True, "near": "mlx5_0"}, 0)
        assert not svc.ledger.shared & NODE1
        assert h.fake.cpus(ETH1) == svc.ledger.shared
        (device,) = views.device_irqs(svc.topology, svc.state, None)
        assert device["local"] == ("b", False) and "node 1" in device["why"][1]
        assert device["allocations"] == ("as", ["g"])
        await svc.release("full")
        assert h.fake.cpus(ETH1) == svc.ledger.shared & NODE1
        # a restart keeps it; the last allocation naming it released: it follows the pool
        svc = await h.service()
        assert h.fake.cpus(ETH1) == svc.ledger.shared & NODE1
        await svc.release("g")
        assert ETH1 not in h.fake.units and h.kernel.released == [ETH1]
        agree(svc, h.fake)
    run(body)


def test_a_failed_allocate_leaves_no_device_interrupts_on_its_cpus(tmp_path: Path) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        seeded(h, svc)
        mark, state = h.fake.mark(), svc.state
        def refuse(n: int, member: str, unit: str) -> None:
            if member == "StartTransientUnit":
                raise SystemdFailure("injected")

        h.fake.fail = refuse  # type: ignore[assignment]
        with pytest.raises(SystemdFailure):
            await svc.allocate("g", "2", KEEP, 0)
        h.fake.fail = lambda n, member, unit: None
        assert svc.state is state
        check_window(h.fake, mark, CPUSet.parse("4-5"))
        agree(svc, h.fake)
    run(body)


def test_hotplug_repair_keeps_them_off(tmp_path: Path) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        seeded(h, svc)
        await svc.allocate("g", "2", KEEP, 0)
        lost = min(svc.ledger.allocations["g"].whole)
        mark, before = h.fake.mark(), svc.ledger.exclusive
        h.offline({lost})
        await svc.revalidate(full=False)
        check_window(h.fake, mark, before | svc.ledger.exclusive)
        assert h.fake.cpus(ETH1) == svc.ledger.shared & NODE1
        assert not h.fake.cpus(ETH1) & svc.ledger.held
    run(body)


def test_a_device_kept_by_a_daemon_that_stopped_is_released_at_startup(tmp_path: Path) -> None:
    async def body() -> None:
        h = host(tmp_path)
        svc = await h.service()
        await svc.allocate("g", "2", KEEP, 0)
        # the checkpoint forgets the allocation (released while the daemon was down)
        svc = await h.service()
        await svc.release("g")
        h.fake.units[ETH1] = Unit(ETH1, props={"AllowedCPUs": NODE1.to_mask()})
        h.kernel.released.clear()
        await h.service()
        assert h.kernel.released == [ETH1]
    run(body)


# ---- the kernel adapter and its shell ----

def fake_pci(tmp: Path, irqs: list[int]) -> tuple[Path, Path]:
    """/proc/irq with ``irqs`` and two PCI functions: 0000:3b:00.0 with MSI-X vectors 40, 41
    and legacy IRQ 11; 0000:86:00.0 with vector 50 (its legacy irq the same, as with MSI)."""
    proc, sys = fake_proc(tmp, irqs)
    for address, vectors, legacy in (("0000:3b:00.0", (40, 41), 11), ("0000:86:00.0", (50,), 50)):
        d = sys / "bus/pci/devices" / address
        (d / "msi_irqs").mkdir(parents=True)
        for v in vectors:
            (d / "msi_irqs" / str(v)).write_text("msix\n")
        (d / "irq").write_text(f"{legacy}\n")
    (sys / "devices/system/cpu").mkdir(parents=True)
    (sys / "devices/system/cpu/online").write_text("0-15\n")
    return proc, sys


def shell(proc: Path, sys: Path) -> str:
    return (SET_KERNEL.replace("/proc/irq", str(proc / "irq"))
            .replace("/sys/bus", str(sys / "bus")).replace("/sys/devices", str(sys / "devices")))


def test_the_oneshot_writes_a_devices_msi_and_legacy_irqs(tmp_path: Path) -> None:
    proc, sys = fake_pci(tmp_path, [1, 4, 11, 40, 41, 50])
    (proc / "irq/41/smp_affinity_list").unlink()
    (proc / "irq/41/smp_affinity_list").mkdir()  # managed: the kernel refuses
    report = tmp_path / "devices.json"
    subprocess.run(["/bin/sh", "-c", shell(proc, sys), "sh", "-", "-", "-", "-", "-", "-",
                    str(report), "-", "0000:3b:00.0", "6-7", "0000:86:00.0", "release"],
                   check=True)
    done = json.loads(report.read_text())
    assert done["0000:3b:00.0"]["confined"] == [40, 11]
    assert done["0000:3b:00.0"]["unmovable"] == [41]
    assert done["0000:86:00.0"] == {"cpus": "0-15", "confined": [50], "unmovable": [],
                                    "effective": {"50": ""}}
    assert (proc / "irq/40/smp_affinity_list").read_text() == "6-7\n"
    assert (proc / "irq/11/smp_affinity_list").read_text() == "6-7\n"
    assert (proc / "irq/4/smp_affinity_list").read_text() == "0-15\n"  # not the device's


def test_the_pool_and_the_devices_are_one_write_the_devices_after(tmp_path: Path) -> None:
    async def body() -> None:
        proc, sys = fake_pci(tmp_path, [1, 4, 11, 40, 41, 50])
        systemd = Oneshots(proc, sys)
        systemd_run = systemd.start_transient

        async def start(unit: str, props: dict) -> None:  # type: ignore[type-arg]
            argv = props["ExecStart"][1][0][1]
            argv[2] = argv[2].replace("/sys/bus", str(sys / "bus"))
            await systemd_run(unit, props)

        systemd.start_transient = start  # type: ignore[method-assign]
        kernel = Kernel(systemd, tmp_path, Irqbalance(str(tmp_path / "none")))  # type: ignore[arg-type]
        kernel.GIVE_BACK_DELAY = 0.01
        pool, local = CPUSet.parse("0-3,6-15"), CPUSet.parse("6-7,12-15")
        await kernel.set_many({IRQS: pool, ETH1: local})
        assert kernel.writes == 1
        irq = lambda n: (proc / f"irq/{n}/smp_affinity_list").read_text().strip()  # noqa: E731
        assert irq(4) == pool.format() and irq(40) == irq(11) == local.format()
        assert kernel.report.devices["0000:3b:00.0"].confined == [11, 40, 41]
        assert kernel.devices() == [ETH1] and await kernel.get_cpus(ETH1) == local
        # the pool shrinks: every IRQ is written again, the device's within it after
        await kernel.set_many({IRQS: CPUSet.parse("0-3,8-15")})
        assert irq(4) == "0-3,8-15" and irq(40) == "12-15"  # what it had, within the pool
        await kernel.release(ETH1)
        await kernel.settle()
        assert irq(40) == "0-3,8-15" and kernel.devices() == []
        assert kernel.report.devices == {}
    asyncio.run(body())


# ---- the property: no device interrupt on an allocation's CPUs, local when it can be ----

DEVICE_NODES = st.lists(st.sampled_from([0, 1, -1]), min_size=1, max_size=3)


def _keep(topology: Any, ledger: Any, seed: int, nodes: list[int]) -> Any:
    rng = random.Random(seed)
    for i, node in enumerate(nodes):
        device = Device(f"dev{i}", node, "pci", f"0000:{i + 1:02x}:00.0")
        request = Request.parse(str(rng.randint(1, 3)), {
            "bind": True, "near": near.encode((device,)), "near-irqs": True,
            "near-policy": rng.choice(["required", "preferred"])})
        with contextlib.suppress(InsufficientCPUs):
            ledger, _ = placement.allocate(topology, ledger, f"keep{i}", request)
    return ledger


@pytest.mark.parametrize("name", ["b", "snc"])
@settings(max_examples=examples(60))
@given(steps=st.integers(0, 30), seed=st.integers(0, 2**32 - 1), nodes=DEVICE_NODES)
def test_no_device_irq_is_planned_on_an_allocations_cpus_and_local_when_it_can(
        machine, name: str, steps: int, seed: int, nodes: list[int]) -> None:
    full = machine(name)
    topology, ledger = build(full, (100, 1, []), steps, seed)
    old = State(ledger, {n: Record(unit=f"cpuservice-bound-{n}.slice")
                         for n in ledger.allocations})
    ledger = _keep(topology, ledger, seed, nodes)
    new = State(ledger, {n: Record(unit=f"cpuservice-bound-{n}.slice")
                         for n in ledger.allocations})
    plans = device_irqs.plan(topology, ledger.bound, ledger.shared)
    for p in plans.values():
        assert not p.cpus & ledger.held and p.cpus <= ledger.shared
        local = ledger.shared & (near.near_cpus(topology, (Device("d", p.node),)) or CPUSet())
        if local:
            assert p.local and p.cpus == local
        else:
            assert not p.local and p.cpus == ledger.shared and p.why
    # and in the transaction: each device's CPUs are set before any allocation gets CPUs it
    # has now, and never to CPUs an allocation holds
    targets = Targets(False, (IRQS,))
    names = set(ledger.allocations)
    after = targets.specs(topology, new, names)
    before = with_appearing(targets.specs(topology, old, set(old.ledger.allocations)), after,
                            topology.online)
    try:
        tx = reconcile.plan(before, after, old.ledger.exclusive | ledger.exclusive,
                            shared=ledger.shared)
    except reconcile.NoSafeOrder:
        return
    had = {u: s.cpus or CPUSet() for u, s in before.items()}
    holding = dict(had)
    for op in tx.ops:
        if reconcile.CPUS in op.props:
            holding[op.unit] = CPUSet.from_mask(bytes(op.props[reconcile.CPUS][1]))
        got = CPUSet.union_all(c - had.get(u, CPUSet()) for u, c in holding.items()
                               if u.startswith("cpuservice-bound"))
        for unit in plans:  # (before: its interrupts may be anywhere, on old allocations too)
            assert not holding.get(unit, CPUSet()) & got & ledger.exclusive, (unit, op)
    for unit, p in plans.items():
        assert holding[unit] == p.cpus
