"""Capacity in closed form, where every allocation of a request takes interchangeable units
(fragment pieces, CPUs, whole cores). Pure."""


from __future__ import annotations

from collections.abc import Collection, Mapping

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import Ledger
from cpuservice.model.request import (
    Exclusive,
    NumaAlignment,
    NumaStrategy,
    Policy,
    Request,
)
from cpuservice.model.topology import Topology
from cpuservice.placement.nodes import _min_nodes


def _fragment_capacity(ledger: Ledger, pieces: int, only: frozenset[int] | None = None,
                       avoid: frozenset[int] | None = None) -> int:
    """Allocations of ``pieces`` pieces and no whole CPU (exact).

    take_fragment without whole CPUs ignores every option: it takes the fullest fragment CPU
    that still has room, and only when none has, a fresh takeable CPU, which it then fills the
    same way. So each fragment CPU holds (free pieces // pieces) more, and each fresh CPU
    granularity // pieces. Fresh CPUs are the allocatable shared ones while the shared-pool
    budget lasts (taking one costs one CPU of budget, and one CPU always passes the budget
    check) plus the free isolated ones, whichever the placement takes first. ``only``: the
    same among these CPUs alone (near-policy required); ``avoid``: none of these (cores kept
    for others' devices).
    """
    g = ledger.granularity
    cpus = CPUSet(only) if only is not None else None
    if avoid:
        cpus = (cpus if cpus is not None else ledger.online) - CPUSet(avoid)
        only = cpus.ids
    existing = sum((g - used) // pieces for c, used in ledger.fragment_pieces.items()
                   if only is None or c in only)
    shared = len(ledger.shared - ledger.reserved if cpus is None
                 else (ledger.shared - ledger.reserved) & cpus)
    isolated = len(ledger.free_isolated if cpus is None else ledger.free_isolated & cpus)
    fresh = min(shared, ledger.shared_budget) + isolated
    return existing + fresh * (g // pieces)


def _unit_capacity(
    topology: Topology,
    ledger: Ledger,
    request: Request,
    avoid: str,
    cands: Mapping[int, Collection[int]],
    shared: int,
    isolated: int,
    budget: int,
) -> int | None:
    """Allocations of ``request.whole`` whole CPUs and no fraction, from the candidates that
    take_whole uses (``cands``: per NUMA node, as candidates() gives them for ``avoid``) and the
    pool sizes
    (allocatable shared CPUs, free isolated CPUs, shared-pool budget); None when the count
    depends on which CPUs each allocation takes.

    Exact when every allocation takes ``per`` interchangeable units and leaves the others as
    they were:
    - exclusive=none, packed or spread-pcpus: n CPUs (the candidates are the takeable CPUs);
    - full-pcpus, or exclusive=pcpu packed with n a multiple of the threads per core and only
      whole cores among the candidates, all cores of threads_per_core threads: n / threads per
      core whole cores (a walk over whole cores for a multiple of their size takes whole cores,
      and excluding them leaves the other cores whole), unless distribute-evenly may split n
      over nodes in shares that are not multiples of the core size;
    - exclusive=pcpu and one CPU: one core (its other threads stop being candidates).
    _take_in_nodes fails only when fewer than n candidates remain, except that single-numa-node
    (and restricted, when n fits in one node of this machine) needs them in one node: then each
    allocation uses one node's units. With no free isolated CPU every CPU taken comes from the
    shared pool, so the budget allows budget // n; with a budget above the allocatable shared
    CPUs it never binds; in between it depends on whether isolated or shared CPUs are taken first
    (except for one CPU with exclusive=none, where each allocation takes one of either).
    """
    opts = request.options
    n = request.whole
    tpc = topology.threads_per_core
    core_of = topology.levels[3]
    if isolated and budget < shared:
        if n == 1 and avoid == Exclusive.NONE and opts.policy != Policy.FULL_PCPUS:
            return budget + isolated
        return None
    per = n
    if avoid == Exclusive.NONE and opts.policy != Policy.FULL_PCPUS:
        units = {x: len(c) for x, c in cands.items()}
    elif avoid == Exclusive.PCPU and n == 1 and (opts.policy != Policy.FULL_PCPUS or tpc == 1):
        cores = {x: {core_of[c] for c in cs} for x, cs in cands.items()}
        units = {x: len(k) for x, k in cores.items()}
        if sum(units.values()) != len(set().union(*cores.values())):
            return None  # a core with candidates in two nodes
    elif (opts.policy == Policy.FULL_PCPUS
          or (avoid == Exclusive.PCPU and opts.policy == Policy.PACKED)) and n % tpc == 0:
        if (opts.numa_strategy == NumaStrategy.DISTRIBUTE_EVENLY and len(topology.nodes) > 1
                and opts.numa_alignment in (NumaAlignment.BEST_EFFORT, NumaAlignment.RESTRICTED)):
            return None  # split over nodes evenly, not by whole cores
        size = topology.core_size
        socket_of, _, l3_of, _ = topology.levels
        units = {}
        for x, cs in cands.items():
            threads: dict[int, int] = {}
            place: dict[int, set[tuple[int, int]]] = {}
            for c in cs:
                threads[core_of[c]] = threads.get(core_of[c], 0) + 1
                place.setdefault(core_of[c], set()).add((socket_of[c], l3_of[c]))
            if any(k != tpc or size[core] != tpc or len(place[core]) > 1
                   for core, k in threads.items()):
                return None  # a core not whole here, or across nodes, sockets or L3 groups
            units[x] = len(threads)
        per = n // tpc
    else:
        return None
    align = opts.numa_alignment
    if align in (NumaAlignment.NONE, NumaAlignment.BEST_EFFORT) or len(topology.nodes) <= 1:
        count = sum(units.values()) // per
    elif align == NumaAlignment.SINGLE_NUMA_NODE or _min_nodes(topology, ledger, n) == 1:
        count = sum(u // per for u in units.values())
    else:
        return None
    return count if isolated else min(count, budget // n)
