"""VM lab scenario: option near and near-irqs on a real kernel (issue 38). The machine
(tests/lab/plan.py NEAR) has 4 CPUs on 2 nodes, a virtio-net interface and an NVMe controller
behind a PCI expander bridge on node 1, and a virtio-net interface on the root bus (no
locality), both interfaces on one QEMU hub and nothing else. Prints lines ``RESULT {json}``.

    python3 near.py check

- the guest's sysfs says node 1 for the two devices behind the bridge;
- ``near=<interface>`` and ``near=/dev/nvme0n1`` (with near-irqs) get node-1 CPUs and memory
  node 1, aligned; the device's interrupts are on node 1's other (shared) CPU, and while
  traffic (Ethernet frames sent from the root-bus interface to it) or direct reads of the NVMe
  run, none of them arrives on the allocation's CPU;
- ``required`` that cannot fit is refused naming the device and its node; ``preferred`` lands
  partly elsewhere and says why, and the device's interrupts go to the whole shared pool
  (saying why: no shared CPU left on node 1);
- ``cpuservice-run --near ... --near-irqs`` runs its command on node-1 CPUs.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from dbus_fast import BusType, Variant
from dbus_fast.aio import MessageBus

sys.path.insert(0, str(Path(__file__).parent))
from hotplug import Client, parse

PCI = Path("/sys/bus/pci/devices")
A_IFACE = "org.cpuservice1.Allocation"


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def fail(why: str) -> None:
    raise SystemExit(f"FAILED STEP: {why}")


def interrupts() -> dict[int, list[int]]:
    lines = Path("/proc/interrupts").read_text().splitlines()
    ncpu = len(lines[0].split())
    out = {}
    for line in lines[1:]:
        head, _, rest = line.partition(":")
        if head.strip().isdigit():
            counts = [int(x) for x in rest.split()[:ncpu] if x.isdigit()]
            out[int(head)] = counts + [0] * (ncpu - len(counts))
    return out


def device_irqs(address: str) -> list[int]:
    return sorted(int(p.name) for p in (PCI / address / "msi_irqs").iterdir())


def affinity(irq: int) -> set[int]:
    return parse(Path(f"/proc/irq/{irq}/smp_affinity_list").read_text().strip())


def pci_of(path: str) -> str:
    """The PCI address nearest up a sysfs device path."""
    real = Path(os.path.realpath(path))
    for p in (real, *real.parents):
        if p.name.count(":") == 2 and "." in p.name:
            return p.name
    fail(f"no PCI device above {real}")
    return ""


def by_node() -> tuple[str, str, str]:
    """The interface behind the bridge, the one on the root bus, and the NVMe's address."""
    near_if = root_if = ""
    for net in sorted(Path("/sys/class/net").iterdir()):
        if net.name == "lo":
            continue
        node = int((PCI / pci_of(str(net / "device")) / "numa_node").read_text())
        if node == 1:
            near_if = net.name
        else:
            root_if = net.name
    nvme = pci_of("/sys/class/nvme/nvme0")
    if not near_if or not root_if:
        fail(f"interfaces by node: near {near_if!r}, root {root_if!r}")
    return near_if, root_if, nvme


def up(interface: str) -> None:
    flags = int(Path(f"/sys/class/net/{interface}/flags").read_text(), 16)
    Path(f"/sys/class/net/{interface}/flags").write_text(hex(flags | 1))


def frames(sender: str, seconds: float) -> int:
    """Broadcast Ethernet frames of a local experimental type from ``sender`` for a while:
    they reach the other interface on the hub (its receive interrupts) and go nowhere else."""
    sent = 0
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((sender, 0))
        mac = bytes.fromhex(Path(f"/sys/class/net/{sender}/address").read_text().strip()
                            .replace(":", ""))
        frame = b"\xff" * 6 + mac + b"\x88\xb5" + b"cpuservice lab near-irqs".ljust(200, b".")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                s.send(frame)
                sent += 1
            except OSError:  # the queue is full for a moment
                time.sleep(0.001)
    return sent


def reads(device: str, cpu: int, seconds: float) -> None:
    """Direct reads of the NVMe namespace from ``cpu`` for a while (its completions come on
    that CPU's queue: the kernel keeps those interrupts, managed, where the I/O is issued)."""
    subprocess.run(["taskset", "-c", str(cpu), "timeout", str(seconds), "dd", f"if={device}",
                    "of=/dev/null", "bs=4k", "iflag=direct", "count=1000000"],
                   capture_output=True, check=False)


def landed(before: dict[int, list[int]], after: dict[int, list[int]], irqs: list[int]
           ) -> dict[int, int]:
    """The arrivals of ``irqs`` per CPU between two readings."""
    out: dict[int, int] = {}
    for n in irqs:
        for cpu, (a, b) in enumerate(zip(after.get(n, []), before.get(n, []), strict=False)):
            if a - b:
                out[cpu] = out.get(cpu, 0) + a - b
    return out


async def isolation(c: Client, address: str) -> dict:  # type: ignore[type-arg]
    iso = await c.prop("IRQIsolation")
    for device in iso["devices"].value:  # type: ignore[index]
        if device["address"].value == address:
            return {k: v.value for k, v in device.items()}
    fail(f"IRQIsolation names no device {address}: {iso}")
    return {}


async def allocation(c: Client, name: str) -> dict[str, object]:
    path = f"/org/cpuservice1/allocation/{name}"
    return {key: await c.prop(key, path, A_IFACE) for key in
            ("CPUSet", "MemoryNodes", "Aligned", "AlignmentReason", "NearDevices")}


async def settled(c: Client, address: str, cpus: set[int]) -> dict:  # type: ignore[type-arg]
    """The device's report once its interrupts were written to ``cpus``."""
    for _ in range(100):
        device = await isolation(c, address)
        if device["written"] and parse(device["written"]) == cpus:
            return device
        await asyncio.sleep(0.1)
    return await isolation(c, address)


async def keep(c: Client, name: str, device: str, address: str, node1: set[int],
               load) -> None:  # type: ignore[no-untyped-def]
    """Allocate 1 CPU near ``device`` with near-irqs; check placement and interrupts while
    ``load(shared_cpu)`` runs; release."""
    await c.call("Allocate", "ssa{sv}", [name, "1", {
        "bind": Variant("b", True), "near": Variant("s", device),
        "near-irqs": Variant("b", True)}])
    a = await allocation(c, name)
    held = parse(str(a["CPUSet"]))
    shared_local = node1 - held
    report = await settled(c, address, shared_local)
    irqs = device_irqs(address)
    # x86 without interrupt remapping may move an interrupt at its next arrival, which still
    # lands where it was (reported pending): a moment of load first, counted apart
    first = interrupts()
    load(min(shared_local), 0.5)
    before = interrupts()
    t0 = time.monotonic()
    load(min(shared_local), 3.0)
    after = interrupts()
    got = landed(before, after, irqs)
    warm = landed(first, before, irqs)
    movable = set(report["confined"])
    per_irq = {str(n): {str(k): v for k, v in sorted(landed(before, after, [n]).items())}
               for n in irqs}
    result(check=name, device=device, address=address, cpus=sorted(held),
           memory_nodes=str(a["MemoryNodes"]), aligned=a["Aligned"],
           near=[list(d) for d in a["NearDevices"]],  # type: ignore[attr-defined]
           planned=report["cpus"], local=report["local"], why=report["why"],
           confined=report["confined"], unmovable=report["unmovable"],
           affinity={n: sorted(affinity(n)) for n in sorted(movable)},
           landed={str(k): v for k, v in sorted(got.items())}, per_irq=per_irq,
           pending=report["pending"],
           warmup_on_allocation=sum(v for k, v in warm.items() if k in held),
           on_allocation=sum(v for k, v in got.items() if k in held),
           on_node1_shared=sum(v for k, v in got.items() if k in shared_local),
           seconds=round(time.monotonic() - t0, 1))
    status = subprocess.run(["cpuservicectl", "status"], capture_output=True, text=True,
                            check=False)
    print(status.stdout, flush=True)
    await c.call("Release", "s", [name])


async def check() -> None:
    near_if, root_if, nvme = by_node()
    nodes = {p.name: int((p / "numa_node").read_text()) for p in PCI.iterdir()}
    node1 = parse(Path("/sys/devices/system/node/node1/cpulist").read_text().strip())
    result(check="sysfs", near_if=near_if, root_if=root_if, nvme=nvme,
           near_if_node=nodes[pci_of(f"/sys/class/net/{near_if}/device")],
           root_if_node=nodes[pci_of(f"/sys/class/net/{root_if}/device")],
           nvme_node=nodes[nvme], node1=sorted(node1))
    for interface in (near_if, root_if):
        up(interface)
    time.sleep(1)
    c = Client(await MessageBus(bus_type=BusType.SYSTEM).connect())
    net = pci_of(f"/sys/class/net/{near_if}/device")
    await keep(c, "nearnet", near_if, net, node1, lambda cpu, s: frames(root_if, s))
    await keep(c, "neardisk", "/dev/nvme0n1", nvme, node1,
               lambda cpu, s: reads("/dev/nvme0n1", cpu, s))
    # required that cannot fit; preferred that lands elsewhere, its interrupts on the pool
    try:
        await c.call("Allocate", "ssa{sv}", ["toobig", "3", {
            "bind": Variant("b", True), "near": Variant("s", near_if)}])
        fail("a required allocation of 3 CPUs next to a 2-CPU node was granted")
    except RuntimeError as exc:
        result(check="required", refused=str(exc))
    await c.call("Allocate", "ssa{sv}", ["spill", "3", {
        "bind": Variant("b", True), "near": Variant("s", near_if),
        "near-policy": Variant("s", "preferred"), "near-irqs": Variant("b", True)}])
    a = await allocation(c, "spill")
    held = parse(str(a["CPUSet"]))
    shared = parse(str(await c.prop("SharedCPUs")))
    report = await settled(c, net, shared)
    result(check="preferred", cpus=sorted(held), aligned=a["Aligned"],
           reason=a["AlignmentReason"], shared=sorted(shared), planned=report["cpus"],
           local=report["local"], why=report["why"],
           affinity={n: sorted(affinity(n)) for n in report["confined"]})
    await c.call("Release", "s", ["spill"])
    out = subprocess.run(["cpuservice-run", "--cpus", "1", "--near", near_if, "--near-irqs",
                          "--name", "nearrun", "--", "sh", "-c",
                          "grep Cpus_allowed_list /proc/self/status"],
                         capture_output=True, text=True, timeout=120, check=False)
    allowed = [line.split(":")[1].strip() for line in out.stdout.splitlines()
               if line.startswith("Cpus_allowed_list")]
    result(check="run", status=out.returncode, allowed=allowed, stderr=out.stderr[-500:])


if __name__ == "__main__":
    if sys.argv[1:] != ["check"]:
        raise SystemExit(__doc__)
    asyncio.run(check())
