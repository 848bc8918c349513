"""Reading how every allocation fares (issue 39): `make bench-figures`.

Fixture e (1,024 CPUs, 8 NUMA nodes) with 3,000 allocations (600 bound ones of one CPU with
option memory-nodes, 2,400 unbound ones of 0.1 CPU), each with a cgroup in a fake tree on tmpfs
(/dev/shm) holding the files Linux 6.1 writes (cpu.pressure, cpu.stat, memory.numa_stat of 8
nodes). One reading of all of them as GetStatistics and the metrics' sampler do it
(cpuservice.shell.statistics: the cgroup of each allocation, its files read and parsed, the loop
yielded every 2 ms), ROUNDS times. Prints:

    figures allocations=3000 memory_nodes=600 read_all_ms p50=<f> min=<f> max=<f> \
loop_late_ms max=<f>

loop_late_ms: how late a 1 ms timer ran meanwhile (what a change or a lending sample waits).
Goal: read_all_ms p50 <= 100. A real cgroupfs computes these files as they are read (its
memory.numa_stat walks the nodes): the VM lab, not this tree, tells that cost.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import cast

from cpuservice import placement
from cpuservice.apply import units
from cpuservice.model.figures import slice_cgroup
from cpuservice.model.fixtures import MACHINES
from cpuservice.model.pools import Ledger
from cpuservice.model.request import Request
from cpuservice.model.state import Record, State
from cpuservice.model.topology import Topology
from cpuservice.shell.engine import Engine
from cpuservice.shell.statistics import Statistics

BOUND, UNBOUND, ROUNDS = 600, 2400, 7
NUMA_KEYS = ("anon", "file", "kernel_stack", "pagetables", "sec_pagetables", "shmem",
             "file_mapped", "file_dirty", "file_writeback", "swapcached", "anon_thp",
             "file_thp", "shmem_thp", "inactive_anon", "active_anon", "inactive_file",
             "active_file", "unevictable", "slab_reclaimable", "slab_unreclaimable",
             "workingset_refault_anon", "workingset_refault_file", "workingset_activate_anon",
             "workingset_activate_file", "workingset_restore_anon", "workingset_restore_file",
             "workingset_nodereclaim")


class _Engine:
    """What Statistics asks of the engine: the state, the topology, systemd (never asked for
    cpuservice's own slices)."""

    def __init__(self, state: State, topology: Topology) -> None:
        self.state, self.topology, self.systemd = state, topology, None


def build(root: Path) -> tuple[_Engine, list[str]]:
    topology = MACHINES["e"].topology()
    ledger = Ledger(topology.online)
    records = {}
    for i in range(BOUND + UNBOUND):
        name = f"a{i}"
        request = Request.parse("1", {"bind": True, "memory-nodes": True}) if i < BOUND \
            else Request.parse("0.1")
        ledger, a = placement.allocate(topology, ledger, name, request)
        unit = units.slice_name(name, a.bound)
        records[name] = Record(unit=unit)
        group = root / (slice_cgroup(unit) or "").lstrip("/")
        group.mkdir(parents=True)
        (group / "cpu.pressure").write_text(
            f"some avg10=1.{i % 100:02d} avg60=0.50 avg300=0.10 total={i * 1000}\n"
            f"full avg10=0.{i % 100:02d} avg60=0.25 avg300=0.05 total={i * 100}\n")
        (group / "cpu.stat").write_text(
            f"usage_usec {i * 12345}\nuser_usec {i * 10000}\nsystem_usec {i * 2345}\n"
            "core_sched.force_idle_usec 0\nnr_periods 1000\nnr_throttled 10\n"
            "throttled_usec 5000\nnr_bursts 0\nburst_usec 0\n")
        (group / "memory.numa_stat").write_text("".join(
            f"{key} " + " ".join(f"N{n}={(i * 4096 + n) * 7}" for n in range(8)) + "\n"
            for key in NUMA_KEYS))
    return _Engine(State(ledger, records), topology), sorted(records)


async def rounds(stats: Statistics, names: list[str]) -> tuple[list[float], float]:
    times, late = [], 0.0
    for _ in range(ROUNDS):
        stop = asyncio.Event()

        async def ticker(stop: asyncio.Event) -> None:
            nonlocal late
            while not stop.is_set():
                due = time.monotonic() + 0.001
                await asyncio.sleep(0.001)
                late = max(late, time.monotonic() - due)

        tick = asyncio.ensure_future(ticker(stop))
        await asyncio.sleep(0.01)
        start = time.perf_counter()
        got = await stats.read(names)
        times.append((time.perf_counter() - start) * 1000)
        stop.set()
        await tick
        assert len(got) == len(names) and all(not f.unreadable for f in got.values())
    return times, late * 1000


def main() -> int:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    root = Path(tempfile.mkdtemp(prefix="cpuservice-figures-", dir=base))
    try:
        engine, names = build(root)
        stats = Statistics(cast(Engine, engine), root)
        times, late = asyncio.run(rounds(stats, names))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"figures allocations={len(names)} memory_nodes={BOUND} read_all_ms "
          f"p50={statistics.median(times):.1f} min={min(times):.1f} max={max(times):.1f} "
          f"loop_late_ms max={late:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
