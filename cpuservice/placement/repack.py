"""Online re-packing (issue 27): the moves of movable allocations after which a request refused
for fragmentation fits. Pure.

Called only after ``placement.allocate`` refused a request (InsufficientCPUs) although there are
enough free CPUs (``fragmented``): typically full-pcpus finds no whole free core because odd
packed allocations hold one thread of many cores. The search is bounded by ``budget``, a number
of calls into the engine, and makes no choice of its own about where CPUs go:

1. Where to make room. The cores holding threads of allocations that may move are ranked
   cheapest first (_Search.regions): those whose threads the loose threads near them can take
   in, then those whose other threads are all free (vacating them makes a whole free core),
   then fewest movable threads; cores an allocation must keep whole come last. For each region
   (every L3 group, NUMA node, socket, the machine; those within one node first) the engine
   places the request on a *relaxed* ledger on which the movable threads of the region's k
   cheapest cores are free, for the smallest k (binary search) with which it fits: what it
   takes there (T) is the room to make, its movable threads the CPUs to vacate.
2. The moves. Each allocation holding CPUs to vacate is placed again (moves.place: take_whole on
   the ledger without it, near what it keeps, none of T), keeping as much as its quality allows
   (the rest of its CPUs, else the rest of its cores, else nothing).
3. The request is then placed by ``allocate``'s own code on the ledger after the moves.

Of the results found, the best is the one where the request stays in one NUMA node, then moves
fewest CPUs, then touches fewest allocations. Fragments never move (moves.py). Regions are
tried in order of a lower bound of the CPUs they need moved, and the search stops when no region
left can beat the best result, or when the budget is spent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import AllocationExists, InsufficientCPUs
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import Movable, NumaAlignment, Policy, Request, validate_name
from cpuservice.model.topology import Topology
from cpuservice.placement.moves import Move, keeps, may_move, place
from cpuservice.placement.whole import _new_allocation

BUDGET = 64  # calls into the engine per repack

Result = tuple[Ledger, Allocation, tuple[Move, ...]]


def fragmented(ledger: Ledger, request: Request) -> bool:
    """Whether free CPUs would hold ``request`` by their number: as many free CPUs a bound
    allocation may take (not reserved; from the shared pool, no more than its budget above
    min_shared_cpus; free isolated ones) as its whole CPUs, and for a fraction one more or a
    fragment CPU with room. A bound request refused although this holds was refused for where
    the free CPUs are (or for its own options), not for how many there are."""
    locked = ledger.keep.locked(request.devices) if not ledger.keep.soft else None
    if locked:  # cores kept for others' devices never hold it
        isolated = len(ledger.free_isolated - locked)
        free = isolated + min(len(ledger.allocatable - locked) - isolated, ledger.shared_budget)
    else:
        isolated = len(ledger.free_isolated)
        free = isolated + min(len(ledger.allocatable) - isolated, ledger.shared_budget)
    pieces = int(request.fraction * ledger.granularity)
    room = not pieces or free > request.whole or any(
        ledger.granularity - used >= pieces for used in ledger.fragment_pieces.values())
    return request.options.bind and request.cpuset is None and free >= request.whole and room


def repack(topology: Topology, ledger: Ledger, name: str, request: Request,
           budget: int = BUDGET, allowed: Callable[[str], bool] = lambda _: True,
           safe: Callable[[Ledger], bool] = lambda _: True) -> Result | None:
    """Moves of movable allocations (``allowed`` by name, e.g. within their limit of moves per
    hour) after which ``request`` fits: the ledger after them with the new allocation in it (as
    ``allocate`` returns it), the new allocation, and the moves. None when it fits without
    moves (the caller allocates as usual), when it is not refused for fragmentation, or when no
    moves the search finds within ``budget`` make it fit. A result whose ledger is not ``safe``
    (the caller's judgement: systemd cannot be taken there in an order that keeps every
    exclusive CPU in one unit at a time) is passed over and the search goes on. Raises as
    ``allocate`` does for a bad name or request."""
    validate_name(name)
    if name in ledger.allocations:
        raise AllocationExists(f"allocation {name!r} already exists")
    try:
        _new_allocation(topology, ledger, name, request)
        return None
    except InsufficientCPUs:
        pass
    if not fragmented(ledger, request):
        return None
    movers = may_move(ledger, allowed)
    if not in_reach(topology, ledger, request, movers):
        return None
    return _Search(topology, ledger, name, request, budget, movers, safe).run()


def in_reach(topology: Topology, ledger: Ledger, request: Request,
             movers: Mapping[str, Allocation]) -> bool:
    """Whether moves of ``movers`` could give ``request`` room by count under the movement
    rules, where count alone can say no: for single-numa-node, a node whose allocatable CPUs
    plus the CPUs in it of movers that may leave it (movable=anywhere, or movable=node with
    another node) are as many as its whole CPUs. A movable=node allocation within one node
    moves inside it and frees nothing there; the request goes in one node or nowhere. (The
    free CPUs plus every movable CPU, the machine's count, never says no once ``fragmented``
    said yes: the refusals it could prune are those ``fragmented`` already turns away.)"""
    if request.options.numa_alignment != NumaAlignment.SINGLE_NUMA_NODE:
        return True
    node_of = topology.levels[1]
    room: dict[int, int] = {}
    for c in ledger.allocatable:
        room[node_of[c]] = room.get(node_of[c], 0) + 1
    for a in movers.values():
        nodes = {node_of[c] for c in a.held}
        if a.request.options.movable == Movable.NODE and len(nodes) == 1:
            continue
        for c in a.whole:
            room[node_of[c]] = room.get(node_of[c], 0) + 1
    return max(room.values(), default=0) >= request.whole


Key = tuple[int, int]  # a region: (level: 0 L3 group, 1 NUMA node, 2 socket, 3 machine; its id)


@dataclass(frozen=True)
class _Region:
    key: Key
    cpus: CPUSet
    within_node: bool
    cores: tuple[int, ...]  # cores holding threads that may move, in the order to free them
    start: int  # fewer of them cannot make room by count
    bound: int  # movable threads of the first ``start``: a lower bound of the CPUs to move


class _Search:
    def __init__(self, topology: Topology, ledger: Ledger, name: str, request: Request,
                 budget: int, movers: dict[str, Allocation],
                 safe: Callable[[Ledger], bool]) -> None:
        self.topology, self.ledger, self.name, self.request = topology, ledger, name, request
        self.budget, self.safe = budget, safe
        self.movers = movers
        self.owner = {c: n for n, a in self.movers.items() for c in a.whole}
        self.free = ledger.allocatable
        self.full = request.options.policy == Policy.FULL_PCPUS
        self.stuck: set[str] = set()  # could not leave the room made in this region
        self.best: tuple[tuple[int, int, int], Result] | None = None
        self._layout()

    def spend(self) -> bool:
        self.budget -= 1
        return self.budget >= 0

    def run(self) -> Result | None:
        tried: set[CPUSet] = set()
        for first in self.regions():
            region: _Region | None = first
            if self.best is not None and (
                    (not first.within_node, first.bound) > self.best[0][:2]):
                break
            self.stuck = set()
            while region is not None and self.budget > 0:
                found = self.room(region)
                if found is None or found[1] in tried:
                    break
                tried.add(found[1])
                blocked = self.evict(*found)
                if blocked is None:
                    break
                self.stuck.add(blocked)  # the room without its threads, in this region
                region = next(iter(self.regions(region.key)), None)
            if self.budget <= 0:
                break
        return None if self.best is None else self.best[1]

    # ---- where to make room ----

    def whole_core(self, name: str, threads: CPUSet) -> bool:
        """Whether allocation ``name`` holds a core of ``threads`` that it must keep whole."""
        a = self.movers[name]
        return a.request.options.policy == Policy.FULL_PCPUS or threads <= a.whole

    def owners(self) -> dict[int, str]:
        """CPU -> the allocation holding it that may still move."""
        if not self.stuck:
            return self.owner
        return {c: n for c, n in self.owner.items() if n not in self.stuck}

    def _layout(self) -> None:
        """What the search does not change: the regions (their CPUs, one key per distinct set),
        what the request could take in each without moves (free CPUs; for full-pcpus, CPUs of
        wholly free cores), the free threads of partly used cores per cell, and the cores with
        threads that may move: their online threads, regions, cell, whether they are whole
        and their free threads."""
        t, free = self.topology, self.free
        socket_of, node_of, l3_of, _ = t.levels
        levels = (l3_of, node_of, socket_of)
        cell_of = t.cells.of
        self.have: dict[Key, int] = {}
        self.slots: dict[tuple[int, int], int] = {}
        self.cores: list[tuple[int, CPUSet, list[Key], tuple[int, int], bool, int]] = []
        if not self.full:
            for c in free:
                for key in [(i, of[c]) for i, of in enumerate(levels)] + [(3, 0)]:
                    self.have[key] = self.have.get(key, 0) + 1
        for core, threads in t.cores.items():
            if not threads:
                continue
            keys = [(3, 0)]
            for i, of in enumerate(levels):
                ids = {of[c] for c in threads}
                if len(ids) == 1:
                    keys.append((i, ids.pop()))
            whole = len(threads) == t.core_size[core]
            if threads <= free:
                if self.full and whole:
                    for key in keys:
                        self.have[key] = self.have.get(key, 0) + len(threads)
                continue
            cell = cell_of[threads.first()]
            loose = len(threads & free)
            self.slots[cell] = self.slots.get(cell, 0) + loose
            if any(c in self.owner for c in threads):
                self.cores.append((core, threads, keys, cell, whole, loose))
        groups = (t.l3_groups, t.nodes, t.sockets)
        self.places: dict[Key, tuple[CPUSet, bool]] = {}
        seen: set[CPUSet] = set()
        for level, group in enumerate((*groups, {0: t.online})):
            for gid in sorted(group):
                cpus = group[gid] & t.online
                if cpus and cpus not in seen:
                    seen.add(cpus)
                    self.places[level, gid] = cpus, len({node_of[c] for c in cpus}) == 1

    def regions(self, only: Key | None = None) -> list[_Region]:
        """The regions (or the one ``only``) where moves could make room by count: those within
        one node first, then by the lower bound of CPUs to move. A region's cores are ranked
        by tier (see below), then those whose other threads are free (vacating them leaves
        them wholly free), then fewest movable threads. Tier 0: among the cores of one cell
        (NUMA node and L3 group), ranked so, those whose movable threads the free threads of
        the cell's other partly used cores can still take in; tier 1: the rest (vacating
        them too would leave their threads nowhere near); tier 2: cores an allocation holds
        whole (full-pcpus, or all its threads), which only another whole core can take in."""
        free, owner = self.free, self.owners()
        cells: dict[tuple[int, int], list[tuple[tuple[bool, int, int], int, int]]] = {}
        rows = []
        tier: dict[int, int] = {}
        for core, threads, keys, cell, whole, loose in self.cores:
            if only is not None and only not in keys:
                continue
            moving = sum(c in owner for c in threads)
            if not moving:
                continue
            clears = all(c in owner or c in free for c in threads)
            if any(self.whole_core(owner[c], threads) for c in threads if c in owner):
                tier[core] = 2
            else:
                cells.setdefault(cell, []).append(((not clears, moving, core), loose, moving))
            if not self.full or (clears and whole):
                rows.append((core, len(threads) if self.full else moving, keys, clears, moving))
        for cell, in_cell in cells.items():
            room, taken, leaving = self.slots.get(cell, 0), 0, 0
            for (_, moving, core), loose, _ in sorted(in_cell):
                fits = room - taken - loose >= leaving + moving
                tier[core] = 0 if fits else 1
                if fits:
                    taken, leaving = taken + loose, leaving + moving
        items: dict[Key, list[tuple[tuple[int, bool, int, int], int, int]]] = {}
        for core, gain, keys, clears, moving in rows:
            for key in keys:
                if key in self.places and (only is None or key == only):
                    items.setdefault(key, []).append(
                        ((tier[core], not clears, moving, core), gain, moving))
        out = []
        for key, unsorted in items.items():
            ranked = sorted(unsorted)
            need, start, bound = self.request.whole - self.have.get(key, 0), 0, 0
            while need > 0 and start < len(ranked):
                need -= ranked[start][1]
                bound += ranked[start][2]
                start += 1
            if need <= 0:
                cpus, within_node = self.places[key]
                out.append(_Region(key, cpus, within_node, tuple(r[0][3] for r in ranked),
                                   start, bound))
        return sorted(out, key=lambda r: (not r.within_node, r.bound, r.key))

    def relaxed(self, region: _Region, k: int) -> tuple[Ledger, CPUSet]:
        """The ledger with the movable threads of the region's first ``k`` cores free."""
        owner = self.owners()
        freed = CPUSet(c for core in region.cores[:k] for c in self.topology.cores[core]
                       if c in owner)
        allocations = self.ledger.allocations
        return self.ledger.with_allocations([
            replace(allocations[n], whole=allocations[n].whole - freed)
            for n in sorted({owner[c] for c in freed})]), freed

    def fits(self, region: _Region, k: int) -> tuple[CPUSet, CPUSet] | None:
        """Where the request goes when the first ``k`` cores are made free, and the movable
        threads it takes there (to vacate)."""
        if not self.spend():
            return None
        ledger, freed = self.relaxed(region, k)
        try:
            a = _new_allocation(self.topology, ledger, self.name, self.request)
        except InsufficientCPUs:
            return None
        return (a.held, a.held & freed) if a.held & freed else None

    def room(self, region: _Region) -> tuple[CPUSet, CPUSet] | None:
        """The fewest cheapest cores' threads to vacate in ``region`` (binary search on k)."""
        lo, hi = region.start, len(region.cores)
        found = self.fits(region, lo)
        if found is not None or lo == hi:
            return found
        found = self.fits(region, hi)
        if found is None:
            return None
        while hi - lo > 1 and self.budget > 0:
            mid = (lo + hi) // 2
            got = self.fits(region, mid)
            if got is None:
                lo = mid
            else:
                hi, found = mid, got
        return found

    # ---- the moves ----

    def evict(self, room: CPUSet, vacate: CPUSet) -> str | None:
        """Move the allocations holding ``vacate`` off it, and elsewhere than ``room`` (where
        the request went on the relaxed ledger), then place the request; records the result
        when it is the best so far. The name of an allocation that could not move, if one
        could not."""
        owner = self.owner
        out: dict[str, CPUSet] = {}
        for c in vacate:
            out.setdefault(owner[c], CPUSet())
            out[owner[c]] = out[owner[c]] | CPUSet((c,))
        allocations = self.ledger.allocations
        ledger = self.ledger.with_allocations([
            replace(allocations[n], whole=allocations[n].whole - cpus) for n, cpus in out.items()])
        hide = room | (self.free & self._room_cores(vacate))
        moves = []
        for n in sorted(out, key=lambda n: (-len(out[n]), n)):
            old = self.movers[n]
            new = None
            for keep in keeps(self.topology, old, out[n]):
                if not self.spend():
                    return None
                new = place(self.topology, ledger, old, keep, hide)
                if new is not None:
                    break
            if new is None:
                return n
            ledger = ledger.with_allocation(new)
            moves.append(Move(n, old, new))
        if not self.spend():
            return None
        try:
            a = _new_allocation(self.topology, ledger, self.name, self.request)
        except InsufficientCPUs:
            return None
        node_of = self.topology.levels[1]
        key = (int(len({node_of[c] for c in a.held}) > 1), sum(m.cpus for m in moves),
               len(moves))
        if (self.best is None or key < self.best[0]) and self.safe(ledger.with_allocation(a)):
            self.best = key, (ledger.with_allocation(a), a, tuple(moves))
        return None

    def _room_cores(self, vacate: CPUSet) -> CPUSet:
        """Every thread of the cores ``vacate`` touches."""
        t = self.topology
        return CPUSet(c for core in {t.levels[3][c] for c in vacate} for c in t.cores[core])
