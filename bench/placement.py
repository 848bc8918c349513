"""Placement benchmark: latency of one ``place`` call, a 10,000-operation churn, and the slowest
``capacity`` call among hostile request shapes.

Prints, last:
    placement_p50_us cpus=64 <float>
    placement_p50_us cpus=1024 <float>
    churn topology=2x32x2 ops=10000 success=<0..1> numa_avoidable_spans=<int> \
smt_split_full_pcpus=<int> fragmented_cores=<int>
    capacity_worst_us cpus=1024 <float>
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import tempfile
import time

from cpuservice import placement
from cpuservice.errors import InsufficientCPUs, InvalidArgument
from cpuservice.fixtures import MACHINES, Machine, write_sysfs
from cpuservice.pools import Ledger, check_invariants
from cpuservice.request import Request
from cpuservice.topology import Topology, discover

SEED = 20261122
POLICIES = ("packed", "full-pcpus", "spread-pcpus")


def _topology(machine: Machine) -> Topology:
    with tempfile.TemporaryDirectory(prefix="cpuservice-bench-") as tmp:
        return discover(write_sysfs(tmp, machine))


def _request(rng: random.Random, tpc: int) -> Request:
    policy = rng.choice(POLICIES)
    size = rng.randint(1, 16)
    if policy == "full-pcpus":
        size = max(tpc, size - size % tpc)
    return Request.parse(str(size), {"bind": True, "policy": policy})


def _half_full(topology: Topology, rng: random.Random) -> Ledger:
    ledger = Ledger(topology.online)
    serial = 0
    while len(ledger.held) < len(topology.online) // 2:
        try:
            ledger, _ = placement.allocate(topology, ledger, f"h{serial}",
                                           _request(rng, topology.threads_per_core))
        except InsufficientCPUs:
            break
        serial += 1
    return ledger


def placement_p50_us(topology: Topology, calls: int) -> float:
    """Median wall time of one place() with the ledger half full (same seed every run)."""
    rng = random.Random(SEED)
    ledger = _half_full(topology, rng)
    requests = [_request(rng, topology.threads_per_core) for _ in range(calls)]
    times = []
    for request in requests:
        start = time.perf_counter_ns()
        with contextlib.suppress(InsufficientCPUs):
            placement.place(topology, ledger, request)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def _spans_avoidably(topology: Topology, ledger: Ledger, request: Request, nodes: int) -> bool:
    """The placement spans NUMA nodes although one node had room for the whole request."""
    if nodes < 2:
        return False
    cands = placement.candidates(topology, ledger, request.options, request.options.exclusive)
    node_of = topology.levels[1]
    room: dict[int, int] = {}
    for c in cands:
        room[node_of[c]] = room.get(node_of[c], 0) + 1
    return max(room.values(), default=0) >= request.whole


def _split_full_pcpus(topology: Topology, ledger: Ledger) -> int:
    owner: dict[int, str] = {}
    split = set()
    for a in ledger.allocations.values():
        if a.request.options.policy != "full-pcpus":
            continue
        for c in a.whole:
            core = topology.cpus[c].core
            if owner.setdefault(core, a.name) != a.name:
                split.add(core)
    return len(split)


def _fragmented_cores(topology: Topology, ledger: Ledger) -> int:
    """Physical cores whose threads are held by two or more holders (free counts as one)."""
    holder = {c: a.name for a in ledger.allocations.values() for c in a.held}
    return sum(
        len({holder.get(c, "") for c in threads}) > 1 for threads in topology.cores.values()
    )


def churn(topology: Topology, ops: int) -> tuple[float, int, int, int]:
    rng = random.Random(SEED)
    ledger = Ledger(topology.online)
    attempts = successes = spans = splits = 0
    serial = 0
    for _ in range(ops):
        if ledger.allocations and rng.random() < 0.45:
            name = rng.choice(sorted(ledger.allocations))
            ledger = placement.release(ledger, name)
            continue
        request = _request(rng, topology.threads_per_core)
        attempts += 1
        try:
            new, a = placement.allocate(topology, ledger, f"c{serial}", request)
        except (InsufficientCPUs, InvalidArgument):
            continue
        successes += 1
        serial += 1
        spans += _spans_avoidably(topology, ledger, request, len(topology.node_set(a.whole)))
        ledger = new
        splits += _split_full_pcpus(topology, ledger)
    check_invariants(ledger)
    return successes / attempts, spans, splits, _fragmented_cores(topology, ledger)


# Shapes that make capacity count long (fractions: 100 or 1,000 per free CPU; one CPU, or one CPU
# and a fraction: one per free CPU) or walk the NUMA and exclusivity rules.
CAPACITY_SHAPES: tuple[tuple[str, dict[str, str], int], ...] = (
    ("0.01", {}, 100), ("0.001", {}, 1000), ("1", {}, 100), ("1.01", {}, 100),
    ("1.001", {}, 1000), ("2.01", {}, 100), ("1.5", {}, 100),
    ("2", {"policy": "full-pcpus"}, 100), ("2.01", {"policy": "full-pcpus"}, 100),
    ("1.01", {"policy": "spread-pcpus", "numa-alignment": "none"}, 100),
    ("1", {"exclusive": "numa"}, 100), ("1.01", {"exclusive": "numa"}, 100),
    ("1.01", {"exclusive": "pcpu"}, 100), ("3", {"exclusive": "pcpu"}, 100),
    ("4", {"numa-alignment": "single-numa-node"}, 100),
    ("1.01", {"numa-alignment": "single-numa-node", "numa-strategy": "least-allocated"}, 100),
    ("2.01", {"numa-strategy": "distribute-evenly"}, 100),
    ("200", {"numa-alignment": "restricted"}, 100),
)


def _busy(topology: Topology, granularity: int, allocations: int) -> Ledger:
    """About ``allocations`` allocations (a fifth unbound, small fractions, one or two CPUs)
    leaving most of the machine free, which is what makes capacity count long."""
    rng = random.Random(SEED)
    ledger = Ledger(topology.online, granularity=granularity)
    for i in range(allocations):
        amount = rng.choice(("0.05", "0.1", "0.25", "0.5", "1", "2"))
        request = Request.parse(amount, {"bind": rng.random() < 0.8})
        with contextlib.suppress(InsufficientCPUs):
            ledger, _ = placement.allocate(topology, ledger, f"b{i}", request)
    return ledger


def capacity_worst_us(topology: Topology, allocations: int, rounds: int = 3) -> float:
    """The slowest of CAPACITY_SHAPES (each the median of ``rounds`` calls) with about
    ``allocations`` allocations present."""
    ledgers = {g: _busy(topology, g, allocations) for g in (100, 1000)}
    worst = 0.0
    for cpus, options, granularity in CAPACITY_SHAPES:
        request = Request.parse(cpus, {"bind": True, **options})
        times = []
        for _ in range(rounds):
            start = time.perf_counter_ns()
            placement.capacity(topology, ledgers[granularity], request)
            times.append(time.perf_counter_ns() - start)
        worst = max(worst, statistics.median(times) / 1000)
    return worst


def main() -> int:
    t64 = _topology(Machine(2, 16, 2, nodes=2, l3_cores=8))
    t1024 = _topology(MACHINES["e"])
    epyc = _topology(MACHINES["c"])
    p64 = placement_p50_us(t64, 3000)
    p1024 = placement_p50_us(t1024, 600)
    success, spans, splits, fragmented = churn(epyc, 10_000)
    capacity_us = capacity_worst_us(t1024, 1000)
    print(f"placement_p50_us cpus=64 {p64:.1f}")
    print(f"placement_p50_us cpus=1024 {p1024:.1f}")
    print(f"churn topology=2x32x2 ops=10000 success={success:.3f} numa_avoidable_spans={spans} "
          f"smt_split_full_pcpus={splits} fragmented_cores={fragmented}")
    print(f"capacity_worst_us cpus=1024 {capacity_us:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
