"""Service benchmark: cpuserviced in the container host, driven over the same system bus.

Prints, last:
    allocate_bound_p50_us <float> floor_p50_us <float> ratio <float>
    shared_update_ratio n=1000 <float>
    checkpoint_scale allocations=3000 ratio <float>
    systemd_shared_slice_set_us children=0 <float> children=3000 <float>
    idle_cpu_percent allocations=3000 <float> rss_mb <float>

floor = StartTransientUnit of an equivalent slice (until its job is done) + one
SetUnitProperties, measured by the same client on the same bus, interleaved with the Allocate
calls. shared_update_ratio = bound Allocate latency with 1,000 unbound allocations present /
with none; checkpoint_scale the same with 3,000. systemd_shared_slice_set_us: what systemd alone
takes to set cpuservice-shared.slice's AllowedCPUs (to the value it has) with no unbound
allocation and with 3,000 of them below it (systemd walks the slice's subtree).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from dbus_fast import Variant
from dbus_fast.aio import MessageBus

from cpuservice.systemd import Systemd
from tests.envs.container import ContainerHost
from tests.integration import client
from tests.integration.service_env import ServiceHost

ROUNDS = int(os.environ.get("CPUSERVICE_BENCH_ROUNDS", "200"))


async def _allocate_once(bus: MessageBus, name: str) -> float:
    start = time.perf_counter()
    await client.call(bus, "Allocate", "ssa{sv}", [name, "1", {"bind": Variant("b", True)}])
    elapsed = time.perf_counter() - start
    await client.call(bus, "Release", "s", [name])
    return elapsed


async def _floor_once(systemd: Systemd, i: int) -> float:
    unit = f"floor-{i}.slice"
    start = time.perf_counter()
    await systemd.start_transient(unit, {"AllowedCPUs": ("ay", b"\x01"),
                                         "CPUWeight": ("t", 100),
                                         "Description": ("s", "floor")})
    await systemd.set_properties("floor-shared.slice", {"AllowedCPUs": ("ay", b"\xfe")})
    elapsed = time.perf_counter() - start
    await systemd.stop(unit)
    return elapsed


async def measure(address: str, rounds: int, floor: bool) -> tuple[float, float]:
    bus = await client.connect(address)
    systemd = Systemd(bus)
    await systemd.setup()
    allocs, floors = [], []
    try:
        for i in range(rounds):
            allocs.append(await _allocate_once(bus, f"bench{i}"))
            if floor:
                floors.append(await _floor_once(systemd, i))
    finally:
        bus.disconnect()
    return statistics.median(allocs) * 1e6, statistics.median(floors or [0]) * 1e6


async def shared_slice_set(address: str, rounds: int = 40) -> float:
    bus = await client.connect(address)
    systemd = Systemd(bus)
    unit = "cpuservice-shared.slice"
    try:
        have = await systemd.get(unit, "org.freedesktop.systemd1.Slice", ["AllowedCPUs"])
        if not have:
            raise RuntimeError(f"{unit} is not loaded")
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            await systemd.set_properties(unit, {"AllowedCPUs": ("ay", bytes(have["AllowedCPUs"]))})
            times.append(time.perf_counter() - start)
    finally:
        bus.disconnect()
    return statistics.median(times) * 1e6


async def populate(address: str, start: int, n: int) -> None:
    bus = await client.connect(address)
    try:
        for i in range(start, n):
            await client.call(bus, "Allocate", "ssa{sv}", [f"u{i}", "0.5", {}])
    finally:
        bus.disconnect()


def _cpu_seconds(pid: int, root: Path) -> float:
    fields = (root / f"proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    with ContainerHost("cpuservice-bench") as container:
        daemon = ServiceHost(container)
        daemon.configure("c")
        address = container.bus_address
        asyncio.run(measure(address, 20, True))  # warm-up
        alloc_us, floor_us = asyncio.run(measure(address, ROUNDS, True))
        empty_set_us = asyncio.run(shared_slice_set(address))
        asyncio.run(populate(address, 0, 1000))
        crowded_us, _ = asyncio.run(measure(address, ROUNDS // 2, False))
        asyncio.run(populate(address, 1000, 3000))
        scale_us, _ = asyncio.run(measure(address, ROUNDS // 2, False))
        crowded_set_us = asyncio.run(shared_slice_set(address))
        pid = int(daemon.show("cpuservice.service", "MainPID")["MainPID"])
        proc = Path(f"/proc/{container.pid1}/root")
        time.sleep(2)
        before, t0 = _cpu_seconds(pid, proc), time.monotonic()
        time.sleep(10)
        idle = (_cpu_seconds(pid, proc) - before) / (time.monotonic() - t0) * 100
        rss_kb = next(int(line.split()[1]) for line in
                      (proc / f"proc/{pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
        daemon.stop(wipe=True)
    print(f"allocate_bound_p50_us {alloc_us:.1f} floor_p50_us {floor_us:.1f} "
          f"ratio {alloc_us / floor_us:.2f}")
    print(f"shared_update_ratio n=1000 {crowded_us / alloc_us:.2f}")
    print(f"checkpoint_scale allocations=3000 ratio {scale_us / alloc_us:.2f}")
    print(f"systemd_shared_slice_set_us children=0 {empty_set_us:.1f} "
          f"children=3000 {crowded_set_us:.1f}")
    print(f"idle_cpu_percent allocations=3000 {idle:.2f} rss_mb {rss_kb / 1024:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
