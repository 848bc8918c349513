"""Re-packing on 1,024 CPUs (issue 27), for bench/placement.py: the slowest ``repack`` of refused
full-pcpus requests on a fragmented ledger of about 1,000 allocations, the same with each result
checked for a safe order of its transaction as the daemon checks it (issue 37: the specs of the
units it changes and reconcile.plan), and one ``defragment`` of that ledger.

The ledger (fragmented_ledger): fixture e (4 x 128 cores x 2 threads, 8 NUMA nodes, L3 per 8
cores), 1,300 allocations requested in turn (30 % unbound, the others 1 or 2 CPUs, packed or
spread-pcpus, 30 % of them movable, node or anywhere; those that do not fit are refused), then
every fifth one released, so that the free CPUs are mostly loose threads.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable

from cpuservice import placement
from cpuservice.apply import reconcile
from cpuservice.apply.targets import Targets, slice_of
from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.request import Request
from cpuservice.model.state import Record, State
from cpuservice.model.topology import Topology
from cpuservice.placement.defrag import defragment, whole_free_cores
from cpuservice.placement.moves import problems
from cpuservice.placement.repack import fragmented, repack

SEED = 27


def fragmented_ledger(topology: Topology, allocations: int = 1300, seed: int = SEED) -> Ledger:
    rng = random.Random(seed)
    ledger = Ledger(topology.online)
    for i in range(allocations):
        if rng.random() < 0.3:
            request = Request.parse("0.5")
        else:
            options = {"bind": True, "policy": rng.choice(("packed", "packed", "spread-pcpus"))}
            if rng.random() < 0.3:
                options["movable"] = rng.choice(("node", "anywhere"))
            request = Request.parse(rng.choice(("1", "1", "1", "1", "2")), options)
        with contextlib.suppress(InsufficientCPUs):
            ledger, _ = placement.allocate(topology, ledger, f"f{i}", request)
    for name in sorted(ledger.allocations)[::5]:
        ledger = placement.release(ledger, name)
    return ledger


def ordered(topology: Topology, ledger: Ledger) -> Callable[[Ledger], bool]:
    """What Engine.orderable asks of a re-pack result, on ``ledger`` (each allocation in its
    own slice, the host confined): whether the transaction to it has a safe order."""
    records = {n: Record(0, slice_of(n, a.request)) for n, a in ledger.allocations.items()}
    state = State(ledger, records)
    targets = Targets(confine_host=True)

    def safe(after: Ledger) -> bool:
        new = State(after, {**records, **{n: Record(0, slice_of(n, a.request))
                                          for n, a in after.allocations.items()
                                          if n not in records}})
        memo = targets.memo()
        try:
            names = targets.changed(state, new, None)
            reconcile.plan(targets.specs(topology, state, names),
                           targets.specs(topology, new, names),
                           ledger.exclusive | after.exclusive, shared=after.shared)
        except reconcile.NoSafeOrder:
            return False
        finally:
            targets.restore(memo)
        return True
    return safe


def repack_worst_us(topology: Topology, ledger: Ledger,
                    safe: Callable[[Ledger], bool] | None = None) -> tuple[int, int, float]:
    """Full-pcpus requests of 2 to 96 CPUs (with and without single-numa-node) that allocate
    refuses for fragmentation: how many there were, how many re-packing placed, and the
    slowest refusal plus re-pack (``safe``: each result checked, as the daemon does)."""
    requests = 0
    placed = 0
    worst = 0.0
    for size in (2, 4, 8, 16, 24, 32, 48, 64, 96):
        for options in ({}, {"numa-alignment": "single-numa-node"}):
            request = Request.parse(str(size), {"bind": True, "policy": "full-pcpus", **options})
            start = time.perf_counter_ns()
            try:
                placement.allocate(topology, ledger, "probe", request)
                continue
            except InsufficientCPUs:
                if not fragmented(ledger, request):
                    continue
                found = repack(topology, ledger, "probe", request,
                               safe=safe or (lambda _: True))
            worst = max(worst, (time.perf_counter_ns() - start) / 1000)
            requests += 1
            if found is not None:
                placed += 1
                check_invariants(found[0])
                assert all(not problems(topology, m.old, m.new) for m in found[2])
    return requests, placed, worst


def defragment_line(topology: Topology, ledger: Ledger) -> str:
    before = len(whole_free_cores(topology, ledger))
    start = time.perf_counter_ns()
    after, moves = defragment(topology, ledger)
    elapsed = (time.perf_counter_ns() - start) / 1000
    check_invariants(after)
    return (f"defragment cpus={len(topology.online)} allocs={len(ledger.allocations)} "
            f"moves={len(moves)} whole_free_cores_before={before} "
            f"after={len(whole_free_cores(topology, after))} us={elapsed:.1f}")


def lines(topology: Topology) -> list[str]:
    ledger = fragmented_ledger(topology)
    out = []
    for name, safe in (("repack_worst_us", None),
                       ("repack_ordered_worst_us", ordered(topology, ledger))):
        requests, placed, worst = repack_worst_us(topology, ledger, safe)
        out.append(f"{name} cpus={len(topology.online)} allocs={len(ledger.allocations)} "
                   f"requests={requests} repacked={placed} {worst:.1f}")
    return [*out, defragment_line(topology, ledger)]
