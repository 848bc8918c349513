"""Option near benchmark (issue 38): how long the daemon takes to look a device up, and to place
and count a request next to one.

Prints:
    near_resolve_us devices=64 names=<n> p50=<float> p99=<float> max=<float> cpu_p50=<float> \
cpu_p99=<float>
    near_place_us cpus=1024 policy=required|preferred p50=<float> p99=<float>
    near_capacity_us cpus=1024 policy=required|preferred p50=<float> p99=<float>

near_resolve_us: one Resolver.resolve of a name, on a fixture sysfs tree (machine c) with 64
PCI devices of every kind (cpuservice.model.fixture_devices.many) plus NVIDIA's procfs files:
each device by its PCI address, its class name (interface, InfiniBand, DRM, NVMe controller and
block device) and its /dev path (NVIDIA GPUs through procfs, the others through
/sys/dev/{char,block}), shuffled, each resolved ``--rounds`` times. The page cache holds the
tree, as it holds sysfs on a host. Goal: p99 <= 1 ms. cpu_p50/cpu_p99: the same in this
thread's CPU time (what the wall time is on an idle machine: on a loaded one, waiting for a CPU
shows in p99).

near_place_us / near_capacity_us: placement.place and placement.capacity of 4 bound CPUs next to
one device on fixture e (1,024 CPUs, 8 nodes) half full, the device's node nearly full (so
preferred spills over).

``bench/near.py --rounds N`` (default 20).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from cpuservice import placement
from cpuservice.host.devices import Resolver
from cpuservice.model import near
from cpuservice.model.fixture_devices import FakeDevice, dev_of, many, write_devices
from cpuservice.model.fixtures import MACHINES, write_sysfs
from cpuservice.model.near import Device
from cpuservice.model.pools import Ledger
from cpuservice.model.request import Request


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def names_of(devices: tuple[FakeDevice, ...], numbers: dict[str, tuple[str, int, int]]
             ) -> list[str]:
    """Every name a caller could give for the devices: PCI addresses, class names (NVMe
    namespaces too), /dev paths."""
    return [*(d.address for d in devices), *(d.name for d in devices if d.name),
            *(f"{d.name}n1" for d in devices if d.kind == "nvme"), *numbers]


def resolve_lines(rounds: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        root = write_sysfs(Path(tmp) / "sys", "c")
        devices = many(64, 4)
        numbers = write_devices(root, devices, "c", proc=Path(tmp) / "proc")
        resolver = Resolver(root, Path(tmp) / "proc", "/dev", dev_of(numbers))
        names = names_of(devices, numbers)
        rng = random.Random(1)
        times: list[float] = []
        cpu: list[float] = []
        for _ in range(rounds):
            rng.shuffle(names)
            for name in names:
                began, began_cpu = time.perf_counter(), time.thread_time()
                resolver.resolve(name)
                cpu.append((time.thread_time() - began_cpu) * 1e6)
                times.append((time.perf_counter() - began) * 1e6)
    return (f"near_resolve_us devices=64 names={len(names)} p50={percentile(times, 50):.1f} "
            f"p99={percentile(times, 99):.1f} max={max(times):.1f} "
            f"cpu_p50={percentile(cpu, 50):.1f} cpu_p99={percentile(cpu, 99):.1f}")


def place_lines(rounds: int) -> list[str]:
    topology = MACHINES["e"].topology()
    ledger = Ledger(topology.online)
    node = topology.nodes[3].sorted()
    # half the machine held, node 3 all but 2 CPUs
    held = [c for x, cpus in topology.nodes.items() for c in cpus.sorted()[:len(cpus) // 2]
            if x != 3] + list(node[:-2])
    for i in range(0, len(held) - 8, 8):
        request = Request.parse("8", {"bind": True, "cpuset": ",".join(map(str, held[i:i + 8]))})
        ledger, _ = placement.allocate(topology, ledger, f"h{i}", request)
    device = near.encode((Device("0000:3b:00.0", 3, "pci", "0000:3b:00.0"),))
    out = []
    for policy in ("required", "preferred"):
        request = Request.parse("4" if policy == "preferred" else "2", {
            "bind": True, "near": device, "near-policy": policy})
        for what, call in (("place", placement.place), ("capacity", placement.capacity)):
            times = []
            for _ in range(rounds * 10):
                began = time.perf_counter()
                call(topology, ledger, request)
                times.append((time.perf_counter() - began) * 1e6)
            out.append(f"near_{what}_us cpus={len(topology.online)} policy={policy} "
                       f"p50={percentile(times, 50):.1f} p99={percentile(times, 99):.1f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    print(resolve_lines(args.rounds), flush=True)
    for line in place_lines(args.rounds):
        print(line, flush=True)


if __name__ == "__main__":
    main()
