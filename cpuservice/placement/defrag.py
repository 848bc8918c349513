"""Defragment (issue 27): moves of movable allocations that gather free CPUs into wholly free
cores, packed into few NUMA nodes and L3 groups, ahead of requests that need them. Pure.

Greedy. An allocation that may move (moves.movable, and ``allowed`` by name: the caller's limit
of moves per allocation per hour) and holds threads of partly free cores (its *stray* threads)
is placed again (moves.place: take_whole, the one engine) keeping its other CPUs, with the free
threads of those cores hidden, so that its stray threads go to loose threads elsewhere. The move
is kept only when it strictly raises ``score`` and keeps the allocation's quality (moves.problems);
each allocation moves at most once. Passes repeat while one moved, within ``budget`` calls into
the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import Ledger
from cpuservice.model.topology import Topology
from cpuservice.placement.moves import Move, may_move, place

BUDGET = 256  # calls into the engine per defragment

Score = tuple[int, int, int]


def whole_free_cores(topology: Topology, ledger: Ledger) -> list[int]:
    """The cores every thread of which is free to be allocated (Ledger.allocatable)."""
    free = ledger.allocatable
    return [k for k, threads in topology.cores.items()
            if threads and len(threads) == topology.core_size[k] and threads <= free]


def score(topology: Topology, ledger: Ledger) -> Score:
    """What defragment raises, compared in this order: the wholly free cores; the sum over NUMA
    nodes of the square of each one's wholly free cores (the same number of free cores in fewer
    nodes scores higher, so that larger requests fit in one node); the same over L3 groups."""
    _, node_of, l3_of, _ = topology.levels
    nodes: dict[int, int] = {}
    l3s: dict[int, int] = {}
    cores = whole_free_cores(topology, ledger)
    for k in cores:
        first = topology.cores[k].first()
        nodes[node_of[first]] = nodes.get(node_of[first], 0) + 1
        l3s[l3_of[first]] = l3s.get(l3_of[first], 0) + 1
    return (len(cores), sum(v * v for v in nodes.values()), sum(v * v for v in l3s.values()))


def defragment(topology: Topology, ledger: Ledger,
               allowed: Callable[[str], bool] = lambda _: True, budget: int = BUDGET,
               safe: Callable[[Ledger], bool] = lambda _: True
               ) -> tuple[Ledger, tuple[Move, ...]]:
    """The ledger after the moves and the moves, in the order made (none when no move raises
    the score). A move after which the ledger is not ``safe`` (the caller's judgement of the
    whole change so far: see repack) is not made."""
    core_of = topology.levels[3]
    current = score(topology, ledger)
    moved: dict[str, Move] = {}
    progress = True
    while progress and budget > 0:
        progress = False
        free = ledger.allocatable
        for name, a in sorted(may_move(ledger, allowed).items()):
            if name in moved:
                continue
            stray = CPUSet(c for c in a.whole if topology.cores[core_of[c]] & free)
            if not stray or budget <= 0:
                continue
            hide = CPUSet(c for s in stray for c in topology.cores[core_of[s]] if c in free)
            budget -= 1
            new = place(topology, ledger, a, a.whole - stray, hide)
            if new is None:
                continue
            after = ledger.with_allocation(new)
            better = score(topology, after)
            if better > current and safe(after):
                ledger, current, progress = after, better, True
                moved[name] = Move(name, a, new)
                free = ledger.allocatable
    return ledger, tuple(moved.values())
