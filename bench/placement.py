"""Placement benchmark: latency of one ``place`` call, a churn of 10,000 operations per seed, and
the slowest ``capacity`` call among hostile request shapes.

Prints:
    placement_p50_us cpus=64 <float>
    placement_p50_us cpus=1024 <float>
    churn seed=<n> policy=<p> allocs=<n> success=<f> numa_avoidable_spans=<n> \
smt_split_full_pcpus=<n> mean_fragmented_cores=<f> half_cores_while_whole_free=<n> median_us=<f>
    churn seed=<n> policy=all ... median_us=<f> repack=off|on movable=0.3 repack_moves=<n> \
fragmentation_refusals=<n> repack_median_us=<f> repack_worst_us=<f>
    repack_worst_us cpus=1024 allocs=<n> requests=<n> repacked=<n> <float>
    repack_ordered_worst_us cpus=1024 allocs=<n> requests=<n> repacked=<n> <float>
    repack_found_us cpus=128|1024 count=<n> p50=<f> p99=<f> max=<f>
    repack_refused_us cpus=128|1024 too_few=<n> fragmented=<n> count=<n> p50=<f> p99=<f> max=<f>
    repack_found_us cpus=128 band=over ..., repack_refused_us cpus=128 band=over ...
    defragment cpus=1024 allocs=<n> moves=<n> whole_free_cores_before=<n> after=<n> us=<float>
    capacity_worst_us cpus=1024 <float>
    capacity_worst_us cpus=1024 isolated=8 <float>
    capacity_worst_us cpus=1024 isolated=64 <float>
    capacity_worst_us cpus=2048 isolated=64 <float>
    capacity_worst_cpu_us cpus=2048 isolated=64 <float>

The churn line comes per seed for each policy and for all of them (policy=all). The workload:
fixture c (2 x 32 cores x 2 threads, 4 NUMA nodes, L3 per 8 cores), core 0 reserved, packed,
full-pcpus and spread-pcpus requests mixed, requested occupancy kept between 60 % and 95 %
(churn_trace). Per policy, over the allocation attempts of the 10,000 operations:

- allocs, success: attempts, and the share that was placed;
- numa_avoidable_spans: allocations whose CPUs touch two or more NUMA nodes although just
  before the request one single node had at least as many CPUs the policy could take (free
  non-reserved CPUs; for full-pcpus, CPUs on wholly free cores);
- smt_split_full_pcpus: physical cores of which a full-pcpus allocation got only some threads;
- mean_fragmented_cores: after each allocation attempt (failed ones included), the number of
  cores with at least one free and at least one taken thread, averaged over attempts;
- half_cores_while_whole_free: packed allocations that took a lone thread of a core beyond an
  odd remainder while whole free cores were available in the NUMA choice (a wholly free core
  in the nodes it landed in that it did not take);
- median_us: the median time of one allocate (with re-packing: of the attempts that did not
  re-pack, so that it compares with the line without).

The re-packing lines (issue 27) replay the same trace with a share (0.3) of the requests movable
(chosen by their own seeded draw, movable=node or anywhere at even odds), once without and once
with re-packing (cpuservice/placement/repack.py: when allocate refuses a request for
fragmentation, the moves after which it fits), policy=all only, and add:

- repack_moves: moves made (one allocation placed again);
- fragmentation_refusals: refusals (after re-packing, when on) although the free CPUs would have
  held the request by their number: repack.fragmented (free non-reserved CPUs within the shared
  pool's budget, free isolated ones too, at least the whole CPUs requested);
- repack_median_us, repack_worst_us: the time of the attempts that re-packed (allocate's refusal
  and the re-pack; 0 without re-packing).

numa_avoidable_spans and smt_split_full_pcpus count the requests' own CPUs as before; a moved
allocation is checked to keep its quality (moves.problems) and the run stops if one does not.
bench/repack.py adds the 1,024-CPU lines: the slowest repack of refused full-pcpus requests on a
fragmented ledger of about 1,000 allocations, the same with each result checked for a safe order
of its transaction as the daemon checks it (repack_ordered_worst_us, issue 37), and one
defragment of it. bench/repack_refused.py adds the time of re-packing's refusals (searches that
found nothing) apart from its successes, at 128 and 1,024 CPUs (issue 40).

``bench/placement.py --seeds 1,2,3,4,5`` runs other seeds (default 1,2,3), ``--movable 0.3,1``
other shares of movable requests (default 0.3).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.repack import fragmented_ledger
from bench.repack import lines as repack_lines
from bench.repack_refused import OVER, churn_refusals, probe_refusals
from cpuservice import placement
from cpuservice.host.sysfs import discover
from cpuservice.model import compat
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.fixtures import MACHINES, Machine, write_sysfs
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.request import Options, Request
from cpuservice.model.topology import Topology
from cpuservice.placement.moves import Move, problems
from cpuservice.placement.repack import fragmented
from cpuservice.placement.repack import repack as repacking

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


@dataclass(frozen=True)
class Op:
    """One step of a churn trace: allocate ``request`` as ``name``, or release ``name`` (a
    no-op when that allocation failed)."""

    name: str
    request: Request | None = None


CHURN_MACHINE = Machine(2, 32, 2, nodes=4, l3_cores=8)  # fixture c: 2 x 32 cores x 2 threads
CHURN_OPS = 10_000
CHURN_BAND = (0.60, 0.95)  # requested occupancy kept in this band
CHURN_SEEDS = (1, 2, 3)
MOVABLE_SHARE = 0.3
CHURN_SIZES = {  # request sizes drawn per policy (full-pcpus: whole SMT-2 cores)
    "packed": (1, 1, 2, 2, 3, 4, 4, 5, 6, 8, 8, 12, 16),
    "full-pcpus": (2, 2, 4, 4, 6, 8, 8, 12, 16),
    "spread-pcpus": (1, 2, 2, 3, 4, 4, 6, 8),
}


def churn_trace(seed: int, allocatable: int, ops: int = CHURN_OPS,
                band: tuple[float, float] = CHURN_BAND) -> tuple[list[Op], list[Op]]:
    """A warm-up that fills the machine to the band's floor, then ``ops`` operations that keep
    the requested occupancy (the sizes of the allocations asked for and not yet released, placed
    or not, over the allocatable CPUs) inside CHURN_BAND: below the floor allocate, above the
    ceiling release, in between either with even odds, and a request that would leave the band
    becomes a release. Releases pick uniformly among the live names. Nothing depends on what an
    engine did with the requests, so any engine can replay the same trace."""
    rng = random.Random(seed)
    low, high = band
    live: dict[str, int] = {}
    warmup: list[Op] = []
    trace: list[Op] = []
    serial = 0

    def request() -> tuple[Request, int]:
        policy = rng.choice(POLICIES)
        size = rng.choice(CHURN_SIZES[policy])
        return Request.parse(str(size), {"bind": True, "policy": policy}), size

    while sum(live.values()) < low * allocatable:
        r, size = request()
        warmup.append(Op(f"c{serial}", r))
        live[f"c{serial}"] = size
        serial += 1
    while len(trace) < ops:
        used = sum(live.values())
        grow = used < low * allocatable or (used <= high * allocatable and rng.random() < 0.5)
        if grow:
            r, size = request()
            if used + size <= high * allocatable or not live:
                trace.append(Op(f"c{serial}", r))
                live[f"c{serial}"] = size
                serial += 1
                continue
        name = rng.choice(sorted(live))
        del live[name]
        trace.append(Op(name))
    return warmup, trace


@dataclass
class Tally:
    """The churn figures of one policy (or all)."""

    allocs: int = 0
    successes: int = 0
    spans: int = 0
    splits: int = 0
    half_cores: int = 0
    fragmented: list[int] = field(default_factory=list)
    times_us: list[float] = field(default_factory=list)
    moves: int = 0
    fragmentation_refusals: int = 0
    repack_us: list[float] = field(default_factory=list)

    def line(self, seed: int, policy: str, repack: Repack | None = None) -> str:
        success = self.successes / self.allocs if self.allocs else 1.0
        frag = statistics.fmean(self.fragmented) if self.fragmented else 0.0
        median = statistics.median(self.times_us) if self.times_us else 0.0
        out = (f"churn seed={seed} policy={policy} allocs={self.allocs} success={success:.3f} "
               f"numa_avoidable_spans={self.spans} smt_split_full_pcpus={self.splits} "
               f"mean_fragmented_cores={frag:.2f} half_cores_while_whole_free={self.half_cores} "
               f"median_us={median:.1f}")
        if repack is None:
            return out
        times = self.repack_us or [0.0]
        return (f"{out} repack={'on' if repack.on else 'off'} movable={repack.share} "
                f"repack_moves={self.moves} "
                f"fragmentation_refusals={self.fragmentation_refusals} "
                f"repack_median_us={statistics.median(times):.1f} "
                f"repack_worst_us={max(times):.1f}")


@dataclass(frozen=True)
class Repack:
    """A churn with a ``share`` of the requests movable, re-packing ``on`` or off."""

    share: float
    on: bool


def with_movable(ops: list[Op], share: float, seed: int) -> list[Op]:
    """The same operations with ``share`` of the requests movable (node or anywhere), drawn
    from their own generator so that the trace stays the one without."""
    rng = random.Random(f"movable-{seed}")
    out = []
    for op in ops:
        if op.request is not None and rng.random() < share:
            where = rng.choice(("node", "anywhere"))
            opts = op.request.options
            op = Op(op.name, Request.build(op.request.cpus, compat.load(
                Options, {**compat.dump(opts), "movable": where})))
        out.append(op)
    return out


def _whole_free_cores(topology: Topology, free: CPUSet) -> dict[int, list[int]]:
    """NUMA node -> the cores all of whose threads are free."""
    out: dict[int, list[int]] = {}
    for core, threads in topology.cores.items():
        if threads <= free:
            out.setdefault(topology.cpus[threads.first()].node, []).append(core)
    return out


def _lone_cores(topology: Topology, cpus: CPUSet) -> set[int]:
    """Cores of which ``cpus`` holds some threads but not all."""
    touched = {topology.cpus[c].core for c in cpus}
    return {k for k in touched if not topology.cores[k] <= cpus}


def numa_avoidable_span(topology: Topology, ledger: Ledger, request: Request, cpus: CPUSet
                        ) -> bool:
    """The CPUs touch two or more NUMA nodes although, just before the request, one node had at
    least as many CPUs the policy could take (free non-reserved CPUs; for full-pcpus, CPUs on
    wholly free cores)."""
    if len(topology.node_set(cpus)) < 2:
        return False
    free = ledger.allocatable
    room: dict[int, int] = {}
    if request.options.policy == "full-pcpus":
        for x, cores in _whole_free_cores(topology, free).items():
            room[x] = sum(len(topology.cores[k]) for k in cores)
    else:
        for c in free:
            room[topology.cpus[c].node] = room.get(topology.cpus[c].node, 0) + 1
    return max(room.values(), default=0) >= request.whole


def half_cores_while_whole_free(topology: Topology, ledger: Ledger, request: Request,
                                cpus: CPUSet) -> bool:
    """A packed allocation took a lone thread of a core beyond an odd remainder (more cores of
    which it got only some threads than n mod threads-per-core needs) while whole free cores
    were available in its NUMA choice (the nodes it landed in held, just before, a wholly free
    core it did not take)."""
    if request.options.policy != "packed":
        return False
    lone = _lone_cores(topology, cpus)
    if len(lone) <= (1 if request.whole % topology.threads_per_core else 0):
        return False
    whole = _whole_free_cores(topology, ledger.allocatable)
    return any(not topology.cores[k] <= cpus
               for x in topology.node_set(cpus) for k in whole.get(x, ()))


def fragmented_cores(topology: Topology, ledger: Ledger) -> int:
    """Cores with at least one free and at least one taken thread."""
    free, held = ledger.allocatable, ledger.held
    return sum(bool(t & free) and bool(t & held) for t in topology.cores.values())


def churn(topology: Topology, seed: int, reserved: CPUSet, repack: Repack | None = None
          ) -> dict[str, Tally]:
    """Replay one seed's trace through the engine; the figures per policy and for all."""
    ledger = Ledger(topology.online, reserved=reserved)
    warmup, trace = churn_trace(seed, len(ledger.allocatable))
    if repack is not None:
        warmup = with_movable(warmup, repack.share, seed)
        trace = with_movable(trace, repack.share, seed)
    for op in warmup:
        assert op.request is not None
        with contextlib.suppress(InsufficientCPUs):
            ledger, _ = placement.allocate(topology, ledger, op.name, op.request)
    tallies = {p: Tally() for p in (*POLICIES, "all")}
    for op in trace:
        if op.request is None:
            if op.name in ledger.allocations:
                ledger = placement.release(ledger, op.name)
            continue
        request = op.request
        mine = tallies[request.options.policy]
        start = time.perf_counter_ns()
        moves: tuple[Move, ...] | None = None
        try:
            new, a = placement.allocate(topology, ledger, op.name, request)
        except InsufficientCPUs:
            new = None
            if repack is not None and repack.on and fragmented(ledger, request):
                found = repacking(topology, ledger, op.name, request)
                if found is not None:
                    new, a, moves = found
        elapsed = (time.perf_counter_ns() - start) / 1000
        refused = new is None and repack is not None and fragmented(ledger, request)
        for m in moves or ():
            assert not problems(topology, m.old, m.new), (m, problems(topology, m.old, m.new))
        if new is not None:
            cpus = a.whole
            span = numa_avoidable_span(topology, ledger, request, cpus)
            half = half_cores_while_whole_free(topology, ledger, request, cpus)
            split = (len(_lone_cores(topology, cpus))
                     if request.options.policy == "full-pcpus" else 0)
            ledger = new
        frag_cores = fragmented_cores(topology, ledger)
        for t in (mine, tallies["all"]):
            t.allocs += 1
            (t.times_us if moves is None else t.repack_us).append(elapsed)
            t.fragmented.append(frag_cores)
            t.moves += len(moves or ())
            t.fragmentation_refusals += refused
            if new is not None:
                t.successes += 1
                t.spans += span
                t.half_cores += half
                t.splits += split
    check_invariants(ledger)
    return tallies


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
    ledger = Ledger(topology.online, isolated=topology.isolated & topology.online,
                    granularity=granularity)
    for i in range(allocations):
        amount = rng.choice(("0.05", "0.1", "0.25", "0.5", "1", "2"))
        request = Request.parse(amount, {"bind": rng.random() < 0.8})
        with contextlib.suppress(InsufficientCPUs):
            ledger, _ = placement.allocate(topology, ledger, f"b{i}", request)
    return ledger


def _with_isolated(ledger: Ledger, count: int) -> Ledger:
    """``ledger`` with the last ``count`` free shared CPUs made kernel-isolated."""
    if not count:
        return ledger
    isolated = CPUSet(ledger.shared.sorted()[-count:])
    return Ledger(ledger.online, ledger.reserved, isolated, ledger.granularity,
                  ledger.min_shared_cpus, ledger.allocations)


def capacity_worst_us(topology: Topology, allocations: int, rounds: int = 3,
                      isolated: int = 0, clock: Callable[[], int] = time.perf_counter_ns
                      ) -> float:
    """The slowest of CAPACITY_SHAPES (each the median of ``rounds`` calls) with about
    ``allocations`` allocations present; ``isolated``: that many of the free CPUs are
    kernel-isolated (isolcpus=) and still free, which bound allocations take first;
    ``clock``: wall time, or time.thread_time_ns for this thread's CPU time (the garbage
    collector paused during the call, as timeit times)."""
    ledgers = {g: _with_isolated(_busy(topology, g, allocations), isolated) for g in (100, 1000)}
    worst = 0.0
    for cpus, options, granularity in CAPACITY_SHAPES:
        request = Request.parse(cpus, {"bind": True, **options})
        times = []
        for _ in range(rounds):
            if clock is not time.perf_counter_ns:
                gc.disable()
            start = clock()
            placement.capacity(topology, ledgers[granularity], request)
            times.append(clock() - start)
            gc.enable()
        worst = max(worst, statistics.median(times) / 1000)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=",".join(map(str, CHURN_SEEDS)),
                        help="churn seeds, comma-separated (default: %(default)s)")
    parser.add_argument("--churn-only", action="store_true", help="only the churn lines")
    parser.add_argument("--movable", default=str(MOVABLE_SHARE),
                        help="shares of movable requests for the re-packing lines, "
                             "comma-separated (default: %(default)s)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    shares = [float(s) for s in args.movable.split(",") if s]
    epyc = _topology(CHURN_MACHINE)
    if not args.churn_only:
        t64 = _topology(Machine(2, 16, 2, nodes=2, l3_cores=8))
        t1024 = _topology(MACHINES["e"])
        print(f"placement_p50_us cpus=64 {placement_p50_us(t64, 3000):.1f}", flush=True)
        print(f"placement_p50_us cpus=1024 {placement_p50_us(t1024, 600):.1f}", flush=True)
    for seed in seeds:
        tallies = churn(epyc, seed, epyc.cores[0])
        for policy, tally in tallies.items():
            print(tally.line(seed, policy), flush=True)
    for share in shares:
        for seed in seeds:
            for on in (False, True):
                mode = Repack(share, on)
                print(churn(epyc, seed, epyc.cores[0], mode)["all"].line(seed, "all", mode),
                      flush=True)
    if not args.churn_only:
        for line in repack_lines(t1024):
            print(line, flush=True)
        for line in [*churn_refusals(epyc, seeds).lines(len(epyc.online)),
                     *churn_refusals(epyc, seeds, band=OVER).lines(len(epyc.online),
                                                                   " band=over"),
                     *probe_refusals(t1024, fragmented_ledger(t1024)).lines(1024)]:
            print(line, flush=True)
    if not args.churn_only:
        print(f"capacity_worst_us cpus=1024 {capacity_worst_us(t1024, 1000):.1f}", flush=True)
        print(f"capacity_worst_us cpus=1024 isolated=8 "
              f"{capacity_worst_us(t1024, 1000, isolated=8):.1f}", flush=True)
        print(f"capacity_worst_us cpus=1024 isolated=64 "
              f"{capacity_worst_us(t1024, 1000, isolated=64):.1f}", flush=True)
        t2048 = _topology(Machine(8, 128, 2, nodes=16, l3_cores=8))
        print(f"capacity_worst_us cpus=2048 isolated=64 "
              f"{capacity_worst_us(t2048, 2000, isolated=64):.1f}", flush=True)
        print(f"capacity_worst_cpu_us cpus=2048 isolated=64 "
              f"{capacity_worst_us(t2048, 2000, isolated=64, clock=time.thread_time_ns):.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
