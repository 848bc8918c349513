"""Placement: which CPUs a request gets, and what systemd is told. Pure; no I/O.

Bound whole CPUs are chosen in two steps. First the NUMA nodes (alignment and strategy), then,
inside them, the CPUs the policy takes (_pick):

- packed and full-pcpus (pack): whole cores for every part of the request that fills one, chosen
  by a walk down socket -> node -> L3 group -> core that at every level takes the best-fitting
  group that holds the rest of the request (closest to the CPUs the allocation already has, then
  fewest free: packing), or, when none does, whole free groups first and the remainder in the
  best-fitting group (_take, run on one thread per wholly free core), then cores whose other
  threads are offline (or hybrid single-thread cores) while the even part is not covered. A
  lone thread only for what is left (an odd remainder on SMT-2), and then the free sibling of a
  half-used core first, the allocation's own or an L3 neighbour's, before a single-thread core,
  before splitting a wholly free core; best fit between groups never overrides this.
  full-pcpus never splits a core: it takes whole cores of any size (on hybrid machines
  single-thread cores too) or fails.
- spread-pcpus: one thread per core, first on cores another spread-pcpus allocation half uses
  (packed leaves those threads to it), then on wholly free cores, then on other partly free
  cores; then further threads.

So a socket-sized request takes a socket, 2 CPUs on SMT-2 take one core, 3 take a core and the
free sibling of a half-used core next to it, and fragments go to loose threads first as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from itertools import combinations
from math import comb, gcd
from types import MappingProxyType

from cpuservice.model.cpuset import EMPTY as EMPTY_SET
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    AllocationExists,
    InsufficientCPUs,
    InvalidArgument,
    NoSuchAllocation,
)
from cpuservice.model.pools import Allocation, Fragment, Ledger
from cpuservice.model.request import (
    Exclusive,
    NumaAlignment,
    NumaStrategy,
    Options,
    Policy,
    Request,
    validate_name,
)
from cpuservice.model.topology import Topology

UNLIMITED = 2**32 - 1
WEIGHT_MAX = 10_000
WEIGHT_DEFAULT = 100
USEC_PER_SEC = 1_000_000
_MAX_COMBOS = 5_000
_STRICT_ALIGNMENT = (NumaAlignment.RESTRICTED, NumaAlignment.SINGLE_NUMA_NODE)


@dataclass(frozen=True)
class Placement:
    """What an allocation runs on and the values systemd enforces.

    ``cpus`` is the AllowedCPUs set (the shared pool for unbound allocations); ``shares`` maps
    each bound CPU to the pieces held on it (a whole CPU = granularity pieces).
    """

    cpus: CPUSet
    whole: CPUSet
    fragment: Fragment | None
    shares: Mapping[int, int]
    memory_nodes: CPUSet
    cpu_quota_usec: int | None
    cpu_weight: int


def cpu_weight(request: Request, fragment: Fragment | None, granularity: int) -> int:
    """CPUWeight: proportional to what the allocation may use where it competes.

    Fractional bound: pieces x 10000 / granularity (20 of 100 pieces -> 2000), so the holders of
    one fragment CPU, siblings under cpuservice-bound.slice, split it in proportion to their
    pieces, and the weights of one CPU's holders never add up to more than 10000. Whole bound: the
    default 100 (nobody else runs there). Unbound: 100 per CPU (0.5 -> 50, 2 -> 200), clamped to
    1..10000, so shared-pool allocations compete in proportion to their size.
    """
    if request.options.bind:
        if fragment is None:
            return WEIGHT_DEFAULT
        return max(1, fragment.pieces * WEIGHT_MAX // granularity)
    return min(WEIGHT_MAX, max(1, int(request.cpus * WEIGHT_DEFAULT)))


def cpu_quota_usec(request: Request) -> int | None:
    """CPUQuota in µs per second: cpus x 100 %; none for whole bound CPUs (they are exclusive)."""
    if request.options.bind and request.fraction == 0:
        return None
    return int(request.cpus * USEC_PER_SEC)


def describe(topology: Topology, ledger: Ledger, allocation: Allocation) -> Placement:
    """The Placement of a committed allocation, against the ledger's current pools."""
    g = ledger.granularity
    shares = {c: g for c in allocation.whole}
    if allocation.fragment:
        shares[allocation.fragment.cpu] = allocation.fragment.pieces
    cpus = allocation.held if allocation.bound and allocation.held else ledger.shared
    return Placement(
        cpus=cpus,
        whole=allocation.whole,
        fragment=allocation.fragment,
        shares=shares,
        memory_nodes=topology.node_set(cpus),
        cpu_quota_usec=cpu_quota_usec(allocation.request),
        cpu_weight=cpu_weight(allocation.request, allocation.fragment, g),
    )


def check_amount(ledger: Ledger, request: Request) -> None:
    """The amount fits the machine and the granularity."""
    online = len(ledger.online)
    if request.cpus > online:
        raise InsufficientCPUs(f"{request.cpus} CPUs is more than this machine's {online} online")
    pieces = request.cpus * ledger.granularity
    if pieces != int(pieces):
        step = Decimal(1) / ledger.granularity
        raise InvalidArgument(
            f"cpus {request.cpus} has more decimals than granularity {ledger.granularity} "
            f"allows (steps of {step})"
        )


def place(topology: Topology, ledger: Ledger, request: Request) -> Placement:
    """Where ``request`` would go now; raises InvalidArgument or InsufficientCPUs."""
    return describe(topology, ledger, _new_allocation(topology, ledger, "-", request))


def allocate(
    topology: Topology, ledger: Ledger, name: str, request: Request
) -> tuple[Ledger, Allocation]:
    """Place and commit ``request`` under ``name``."""
    validate_name(name)
    if name in ledger.allocations:
        raise AllocationExists(f"allocation {name!r} already exists")
    allocation = _new_allocation(topology, ledger, name, request)
    return ledger.with_allocation(allocation), allocation


def release(ledger: Ledger, name: str) -> Ledger:
    if name not in ledger.allocations:
        raise NoSuchAllocation(f"no allocation named {name!r}")
    return ledger.without(name)


def resize(
    topology: Topology, ledger: Ledger, name: str, cpus: Decimal
) -> tuple[Ledger, Allocation]:
    """Change an allocation's size, keeping the CPUs it holds where it can."""
    if name not in ledger.allocations:
        raise NoSuchAllocation(f"no allocation named {name!r}")
    old = ledger.allocations[name]
    if old.request.cpuset is not None and cpus != old.request.cpus:
        raise InvalidArgument(f"allocation {name!r} is pinned to CPUs {old.request.cpuset}")
    request = Request.build(cpus, old.request.options)
    base = ledger.without(name)
    check_amount(base, request)
    if old.bound:
        whole, fragment = bound_cpus(topology, base, request, old.whole, old.fragment)
        new = Allocation(name, request, whole, fragment)
    else:
        new = Allocation(name, request)
    return base.with_allocation(new), new


def capacity(topology: Topology, ledger: Ledger, request: Request) -> int:
    """How many more allocations of exactly this shape fit now (UNLIMITED for unbound): the
    number of times ``allocate`` of ``request`` succeeds in a row on ``ledger``, with the errors
    the first ``allocate`` would raise (InvalidArgument; InsufficientCPUs for more CPUs than are
    online). Always exactly that number (tests/unit/test_capacity.py compares it with allocating
    again and again), but computed from the free structure rather than by committing one
    allocation after another, which for 0.01 on 1,024 CPUs meant 102,300 allocations:

    - an explicit ``cpuset``: 1 or 0 (one placement; afterwards its CPUs are held);
    - no whole CPUs (0.Y): a closed form, _fragment_capacity;
    - whole CPUs only, when every allocation takes the same number of interchangeable units
      (CPUs, whole cores, or for exclusive=pcpu and one CPU, cores) and the shared-pool budget
      does not depend on which CPUs are taken: a closed form over the candidates per NUMA node,
      _unit_capacity (O(CPUs));
    - anything else (X.Y with X >= 1, exclusive=numa, exclusive=pcpu over partly free cores,
      restricted alignment across nodes, free isolated CPUs and a binding budget): here which
      CPUs each allocation takes decides what the next one can take, so _Simulation makes the
      same choices in turn on a model of the free CPUs kept per (NUMA node, L3 group) cell.
      That is one step per allocation, but there are at most free CPUs / X of them (X >= 1),
      and a step only looks at the cell it lands in (and the counts per node), not at the
      machine and the ledger as allocate does; after exclusive=numa's first phase, or once the
      isolated CPUs or the budget are used up, the rest is a closed form again. On 1,024 CPUs
      with a thousand allocations the slowest shapes take a few tens of milliseconds
      (bench/placement.py: capacity_worst_us). Topologies with a core split over two NUMA
      nodes (never seen on hardware) fall back to placing with bound_cpus, one allocation at a
      time.
    """
    check_amount(ledger, request)
    if not request.options.bind:
        return UNLIMITED
    if request.cpuset is not None:
        try:
            bound_cpus(topology, ledger, request, CPUSet(), None)
        except InsufficientCPUs:
            return 0
        return 1
    _check_policy(topology, request)
    pieces = int(request.fraction * ledger.granularity)
    if request.whole == 0:
        return _fragment_capacity(ledger, pieces)
    # free isolated CPUs are taken first (take_whole): which ones each allocation takes
    # decides what is left, so the closed form waits until _Simulation has used them up
    if not pieces and request.options.exclusive != Exclusive.NUMA and not ledger.free_isolated:
        opts = request.options
        cands = candidates(topology, ledger, opts, opts.exclusive)
        node_of = topology.levels[1]
        by_node: dict[int, list[int]] = {}
        for c in cands:
            by_node.setdefault(node_of[c], []).append(c)
        count = _unit_capacity(
            topology, ledger, request, opts.exclusive, by_node,
            len(ledger.shared - ledger.reserved), len(ledger.free_isolated), ledger.shared_budget,
        )
        if count is not None:
            return count
    simulation = _Simulation(topology, ledger, request)
    if not simulation.nested:
        return _replay(topology, ledger, request)
    return simulation.run()


def _fragment_capacity(ledger: Ledger, pieces: int) -> int:
    """Allocations of ``pieces`` pieces and no whole CPU (exact).

    take_fragment without whole CPUs ignores every option: it takes the fullest fragment CPU
    that still has room, and only when none has, a fresh takeable CPU, which it then fills the
    same way. So each fragment CPU holds (free pieces // pieces) more, and each fresh CPU
    granularity // pieces. Fresh CPUs are the allocatable shared ones while the shared-pool
    budget lasts (taking one costs one CPU of budget, and one CPU always passes the budget
    check) plus the free isolated ones, whichever the placement takes first.
    """
    g = ledger.granularity
    existing = sum((g - used) // pieces for used in ledger.fragment_pieces.values())
    shared = len(ledger.shared - ledger.reserved)
    fresh = min(shared, ledger.shared_budget) + len(ledger.free_isolated)
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


def _replay(topology: Topology, ledger: Ledger, request: Request) -> int:
    """capacity by allocating again and again (for topologies _Simulation does not model)."""
    ledger = Ledger(ledger.online, ledger.reserved, ledger.isolated, ledger.granularity,
                    ledger.min_shared_cpus, MappingProxyType(dict(ledger.bound)))
    count = 0
    while True:
        try:
            whole, fragment = bound_cpus(topology, ledger, request, CPUSet(), None)
        except InsufficientCPUs:
            return count
        # not a valid allocation name, so it never replaces one
        ledger = ledger.with_allocation(Allocation(f"#{count}", request, whole, fragment))
        count += 1


Cell = tuple[int, int]  # (NUMA node, L3 group)


class _Simulation:
    """Allocations of one request placed one after another, as allocate would place them, on a
    model of the free structure kept per cell (the CPUs of one L3 group in one NUMA node):
    allocatable shared and free isolated CPUs, fragment CPUs' free pieces, the cores and nodes
    exclusivity excludes, the size of the shared pool.

    Each step takes the same decisions as bound_cpus, through the same functions wherever a choice
    is made (_nodes_for, _quotas, _pick, pack, _take, _Rank); it only avoids looking at the whole
    machine when the answer lies in one cell. Candidates are kept per cell and recomputed for the
    cells a step touched; packed and full-pcpus run pack on the candidates of the chosen nodes
    (on machines without SMT, the walk of _take is followed through the socket, node and L3
    levels on counts and run on the one cell it reaches, or on everything, from where it would
    take several groups); spread-pcpus walks its first tier of one thread per core the same
    way; the fragment is looked for among the fragment CPUs and takeable CPUs that share a
    core, an L3 group or a node with the whole CPUs (ranks 0-2 of take_fragment), and only when
    there are none on the whole machine. Needs every core inside one node (``nested``); when
    a core has threads in two L3 groups, the cells are whole nodes.
    After exclusive=numa stops finding a free node (which never changes back: candidates only
    shrink), and when the isolated CPUs or the budget run out, the rest may be a closed form
    (_unit_capacity).
    """

    def __init__(self, topology: Topology, ledger: Ledger, request: Request) -> None:
        self.topology = topology
        self.ledger = ledger
        self.request = request
        self.opts = request.options
        self.n = request.whole
        self.g = ledger.granularity
        self.pieces = int(request.fraction * ledger.granularity)
        socket_of, node_of, l3_of, core_of = topology.levels
        self.node_of, self.l3_of, self.core_of = node_of, l3_of, core_of
        # cells are (node, L3 group) when every core lies in one, else whole nodes
        self.l3_cells = all(len({(node_of[c], l3_of[c]) for c in t}) == 1
                            for t in topology.cores.values())
        self.nested = self.l3_cells or all(len({node_of[c] for c in t}) == 1
                                           for t in topology.cores.values())
        self.online_threads = {k: len(t) for k, t in topology.cores.items()}
        sockets = {x: {socket_of[c] for c in cpus} for x, cpus in topology.nodes.items()}
        self.socket_of: dict[int, int] | None = (
            {x: min(s) for x, s in sockets.items()}
            if all(len(s) == 1 for s in sockets.values()) else None
        )
        self.isolated = ledger.isolated.ids
        self.shared = len(ledger.shared)
        self.min_shared = ledger.min_shared_cpus
        self.free: dict[Cell, set[int]] = {}
        self.free_isolated: dict[Cell, set[int]] = {}
        for c in ledger.online:
            self.free.setdefault(self._cell(c), set())
            self.free_isolated.setdefault(self._cell(c), set())
        for c in ledger.shared - ledger.reserved:
            self.free[self._cell(c)].add(c)
        for c in ledger.free_isolated:
            self.free_isolated[self._cell(c)].add(c)
        self.cells_in: dict[int, list[Cell]] = {}
        for cell in sorted(self.free):
            self.cells_in.setdefault(cell[0], []).append(cell)
        self.isolated_left = len(ledger.free_isolated)
        self.rooms = {c: self.g - used for c, used in ledger.fragment_pieces.items()}
        self.fragments_in: dict[tuple[int, int], set[int]] = {}
        for c in self.rooms:
            self._index_fragment(c)
        self.used_cores: set[int] = set()
        self.used_nodes: set[int] = set()
        if self.opts.exclusive != Exclusive.NONE:
            for a in ledger.bound.values():
                if a.request.options.exclusive == self.opts.exclusive:
                    self._use(a.held)
        self.numa_failed = False
        # spread-pcpus' cores; spread-pcpus steps add theirs
        self.shy = (set(spread_cores(topology, ledger))
                    if request.options.policy != Policy.FULL_PCPUS else set())
        self._takeable: dict[Cell, set[int]] = {}
        # per avoid: the candidates of every cell and their count per node (nodes with any),
        # brought up to date from the cells steps touched (_stale) when next looked at
        self._views: dict[str, tuple[dict[Cell, set[int]], dict[int, int]]] = {}
        self._stale: dict[str, set[Cell]] = {}
        self._primary: dict[tuple[Cell, str], tuple[list[int], ...]] = {}

    def run(self) -> int:
        free = sum(map(len, self.free.values())) + self.isolated_left
        for count in range(free + 1):  # every step takes at least one free CPU
            phase = self._phase()
            if not self.step():
                return count
            if self._phase() != phase:
                rest = self._rest()
                if rest is not None:
                    return count + 1 + rest
        raise AssertionError("capacity: more allocations than free CPUs")

    def step(self) -> bool:
        """Place one more allocation; False when allocate would raise InsufficientCPUs."""
        try:
            whole = self._whole()
            fragment, fresh = self._fragment(whole) if self.pieces else (None, False)
        except InsufficientCPUs:
            return False
        taken = [*whole, fragment] if fresh and fragment is not None else whole
        from_shared = sum(c not in self.isolated for c in taken)
        if from_shared > self._budget():
            return False
        had_budget = self._budget() > 0
        for c in taken:
            if c in self.isolated:
                self.free_isolated[self._cell(c)].discard(c)
                self.isolated_left -= 1
            else:
                self.free[self._cell(c)].discard(c)
        self.shared -= from_shared
        held = [*whole, fragment] if fragment is not None else whole
        touched = {self._cell(c) for c in held}
        if self.opts.policy == Policy.SPREAD_PCPUS:
            self.shy.update(self.core_of[c] for c in whole)
        if fragment is not None:
            if fresh:
                self.rooms[fragment] = self.g - self.pieces
                self._index_fragment(fragment)
            else:
                self.rooms[fragment] -= self.pieces
        if self.opts.exclusive != Exclusive.NONE:
            new_nodes = {self.node_of[c] for c in held} - self.used_nodes
            self._use(held)  # their cores lie in the cells touched
            touched.update(cell for x in new_nodes for cell in self.cells_in.get(x, ()))
        if had_budget and not self._budget():  # takeable: the free isolated CPUs only
            self._takeable.clear()
            self._views.clear()
            self._primary.clear()
            return True
        for cell in touched:
            self._takeable.pop(cell, None)
            for avoid in self._views:
                self._stale[avoid].add(cell)
                self._primary.pop((cell, avoid), None)
        return True

    def _shy(self) -> Collection[int]:
        return self.shy

    def _phase(self) -> tuple[bool, bool, bool]:
        return self.numa_failed, self._budget() > 0, self.isolated_left > 0

    def _rest(self) -> int | None:
        """What is left as a closed form, if it is one (whole CPUs only)."""
        if self.pieces or (self.opts.exclusive == Exclusive.NUMA and not self.numa_failed):
            return None
        avoid = Exclusive.PCPU if self.opts.exclusive == Exclusive.NUMA else self.opts.exclusive
        view, _ = self._view(avoid)
        cands = {x: [c for cell in cells for c in view[cell]] for x, cells in self.cells_in.items()}
        shared = sum(map(len, self.free.values()))
        return _unit_capacity(self.topology, self.ledger, self.request, avoid, cands, shared,
                              self.isolated_left, self._budget())

    def _budget(self) -> int:
        return max(0, self.shared - self.min_shared)

    def _cell(self, cpu: int) -> Cell:
        return self.node_of[cpu], self.l3_of[cpu] if self.l3_cells else -1

    def _index_fragment(self, cpu: int) -> None:
        self.fragments_in.setdefault((1, self.node_of[cpu]), set()).add(cpu)
        self.fragments_in.setdefault((2, self.l3_of[cpu]), set()).add(cpu)

    def _use(self, cpus: Iterable[int]) -> None:
        for c in cpus:
            self.used_cores.add(self.core_of[c])
            self.used_nodes.add(self.node_of[c])

    def _takeable_in(self, cell: Cell) -> set[int]:
        """ledger.takeable in a cell."""
        if cell not in self._takeable:  # a new set: views keep it, steps change free ones
            iso = self.free_isolated.get(cell, set())
            self._takeable[cell] = self.free.get(cell, set()) | iso if self._budget() else set(iso)
        return self._takeable[cell]

    def _candidates(self, cell: Cell, key: str) -> set[int]:
        """candidates() in a cell (whole cores lie in one cell); ``key`` is ``avoid``, or
        ``avoid/iso`` or ``avoid/shared`` for the isolated candidates or the others."""
        avoid, _, subset = key.partition("/")
        free = self._takeable_in(cell)
        if avoid == Exclusive.NUMA and cell[0] in self.used_nodes:
            free = set()
        elif avoid == Exclusive.PCPU and self.used_cores:
            free = {c for c in free if self.core_of[c] not in self.used_cores}
        if self.opts.policy == Policy.FULL_PCPUS:
            core_of, size = self.core_of, self.topology.core_size
            counts: dict[int, int] = {}
            for c in free:
                counts[core_of[c]] = counts.get(core_of[c], 0) + 1
            free = {c for c in free if counts[core_of[c]] == size[core_of[c]]}
        if subset:
            iso = self.isolated
            free = {c for c in free if (c in iso) == (subset == "iso")}
        return free

    def _view(self, avoid: str) -> tuple[dict[Cell, set[int]], dict[int, int]]:
        """The candidates for ``avoid`` per cell, and their count per node."""
        if avoid not in self._views:
            cells = {cell: self._candidates(cell, avoid) for cell in self.free}
            counts: dict[int, int] = {}
            for (x, _), cs in cells.items():
                if cs:
                    counts[x] = counts.get(x, 0) + len(cs)
            self._views[avoid] = cells, counts
            self._stale[avoid] = set()
        cells, counts = self._views[avoid]
        for cell in self._stale[avoid]:
            new = self._candidates(cell, avoid)
            x = cell[0]
            left = counts.get(x, 0) - len(cells[cell]) + len(new)
            cells[cell] = new
            if left:
                counts[x] = left
            else:
                counts.pop(x, None)
        self._stale[avoid].clear()
        return cells, counts

    def _primaries(self, cell: Cell, avoid: str, cands: Collection[int]
                   ) -> tuple[list[int], ...]:
        """The lowest candidate thread of each partly free core of a cell that spread-pcpus
        uses, of each core whose online threads are all candidates, and of each other core with
        candidates (as _pick for spread-pcpus)."""
        key = (cell, avoid)
        if key not in self._primary:
            cores: dict[int, list[int]] = {}
            for c in cands:
                cores.setdefault(self.core_of[c], []).append(c)
            paired: list[int] = []
            full: list[int] = []
            partial: list[int] = []
            for k, t in cores.items():
                if len(t) == self.online_threads[k]:
                    full.append(min(t))
                else:
                    (paired if k in self.shy else partial).append(min(t))
            self._primary[key] = paired, full, partial
        return self._primary[key]

    def _whole(self) -> list[int]:
        """take_whole."""
        attempts = _attempts(self.opts)
        error = InsufficientCPUs("no CPUs")
        for avoid in attempts:
            if avoid == Exclusive.NUMA and self.numa_failed:
                continue
            try:
                return self._isolated_first(avoid)
            except InsufficientCPUs as exc:
                error = exc
                self.numa_failed = self.numa_failed or avoid == Exclusive.NUMA
        raise error

    def _isolated_first(self, avoid: str) -> list[int]:
        """_isolated_first of take_whole, on the views of the isolated candidates
        (``avoid/iso``) and of the others (``avoid/shared``)."""
        n, opts = self.n, self.opts
        iso_view, iso_counts = self._view(f"{avoid}/iso")
        n_iso = sum(iso_counts.values())
        if n_iso and n_iso >= n:
            with contextlib.suppress(InsufficientCPUs):
                return self._take_in_nodes(f"{avoid}/iso", n)
        got = self._take_in_nodes(avoid, n)
        if (n_iso and n_iso < n and sum(c not in self.isolated for c in got) > self._budget()
                and opts.numa_alignment not in _STRICT_ALIGNMENT):
            iso = sorted(c for cs in iso_view.values() for c in cs)
            return iso + self._take_in_nodes(f"{avoid}/shared", n - n_iso, CPUSet(iso))
        return got

    def _take_in_nodes(self, key: str, n: int, anchor: CPUSet = EMPTY_SET) -> list[int]:
        """_take_in_nodes of n CPUs from the view ``key`` (see _view), near ``anchor``."""
        opts, topology = self.opts, self.topology
        cands, counts = self._view(key)
        near = anchor.ids
        if sum(counts.values()) < n:
            raise InsufficientCPUs(f"{n} CPUs requested but fewer are available")
        if opts.numa_alignment != NumaAlignment.NONE and len(topology.nodes) > 1:
            nodes = _nodes_for(topology, self.ledger, counts, n, opts, anchor)
            if opts.numa_strategy == NumaStrategy.DISTRIBUTE_EVENLY and len(nodes) > 1:
                out: list[int] = []
                quotas = _quotas(topology, [counts[x] for x in nodes], n, opts.policy)
                for x, quota in zip(nodes, quotas, strict=False):
                    inside = [c for cell in self.cells_in[x] for c in cands[cell]]
                    out += _pick(topology, inside, quota, near | frozenset(out), opts.policy,
                                 self._shy)
                return out
            counts = {x: counts[x] for x in nodes}
        if not near:  # the walks on counts assume nothing near
            if opts.policy == Policy.SPREAD_PCPUS:
                return self._spread(key, cands, counts, n)
            if topology.threads_per_core == 1:
                return self._walk(cands, counts, n)
        everything = [c for x in counts for cell in self.cells_in[x] for c in cands[cell]]
        return _pick(topology, everything, n, near, opts.policy, self._shy)

    def _spread(self, avoid: str, cands: Mapping[Cell, Collection[int]],
                counts: Mapping[int, int], n: int) -> list[int]:
        """_pick for spread-pcpus over the candidates of the nodes in ``counts``: its first
        _take (over one thread of each partly free core spread-pcpus uses, or when there is
        none, of each wholly free core, or else of each other partly free core) walked on counts
        when it takes all n; otherwise _pick itself."""
        primaries = {cell: self._primaries(cell, avoid, cands[cell])
                     for x in counts for cell in self.cells_in[x] if cands[cell]}
        for i in (0, 1, 2):
            there = {cell: p[i] for cell, p in primaries.items() if p[i]}
            per_node: dict[int, int] = {}
            for (x, _), ps in there.items():
                per_node[x] = per_node.get(x, 0) + len(ps)
            if n <= sum(per_node.values()):
                return self._walk(there, per_node, n)
            if there:
                break
        everything = [c for x in counts for cell in self.cells_in[x] for c in cands[cell]]
        return _pick(self.topology, everything, n, frozenset(), self.opts.policy, self._shy)

    def _walk(self, cells: Mapping[Cell, Collection[int]], counts: Mapping[int, int], n: int
              ) -> list[int]:
        """_take(the CPUs of ``cells`` in the nodes of ``counts`` (their number there), n,
        nothing near): its socket, node and L3 levels followed on counts while one group holds
        n, then _take inside that group."""
        topology = self.topology
        node = self._node(counts, n) if n < sum(counts.values()) else None
        if node is None:
            everything = [c for x in counts for cell in self.cells_in[x]
                          for c in cells.get(cell, ())]
            return _take(topology, everything, n, frozenset())
        inside = {cell[1]: cs for cell in self.cells_in[node] if (cs := cells.get(cell, ()))}
        if n >= counts[node]:
            return [c for cs in inside.values() for c in cs]
        if not self.l3_cells:
            return _take(topology, [c for cs in inside.values() for c in cs], n, frozenset(), 2)
        fitting = [l3 for l3, cs in inside.items() if len(cs) >= n]
        if not fitting:
            return _take(topology, [c for cs in inside.values() for c in cs], n, frozenset(), 2)
        best = min(fitting, key=lambda l3: (len(inside[l3]), l3))
        return _take(topology, inside[best], n, frozenset(), 3)

    def _node(self, counts: Mapping[int, int], n: int) -> int | None:
        """The node _take(candidates, n, nothing near) descends into, from the candidates' count
        per node; None when it takes CPUs of several nodes (or a node spans sockets)."""
        if self.socket_of is None:
            return None
        if len(counts) == 1:
            return next(iter(counts))
        per_socket: dict[int, int] = {}
        for x, k in counts.items():
            per_socket[self.socket_of[x]] = per_socket.get(self.socket_of[x], 0) + k
        fitting = [s for s in per_socket if per_socket[s] >= n]
        if not fitting:
            return None
        socket = min(fitting, key=lambda s: (per_socket[s], s))
        inside = {x: k for x, k in counts.items() if self.socket_of[x] == socket}
        if len(inside) == 1:
            return next(iter(inside))
        if n >= per_socket[socket]:
            return None
        fitting = [x for x in inside if inside[x] >= n]
        return min(fitting, key=lambda x: (inside[x], x)) if fitting else None

    def _fragment(self, whole: list[int]) -> tuple[int, bool]:
        """take_fragment next to ``whole`` (never empty here): the CPU and whether it is fresh."""
        topology, pieces, rooms = self.topology, self.pieces, self.rooms
        anchor = frozenset(whole)
        cores = {self.core_of[c] for c in whole}
        l3s = {self.l3_of[c] for c in whole}
        nodes = {self.node_of[c] for c in whole}
        # existing fragment CPUs by rank (sibling, same L3, same node: all within these nodes'
        # and L3 groups' indexes), fewest free pieces first
        for near in ([c for k in cores for c in topology.cores[k] if c in rooms],
                     [c for g in l3s for c in self.fragments_in.get((2, g), ())],
                     [c for x in nodes for c in self.fragments_in.get((1, x), ())]):
            existing = [c for c in near if rooms[c] >= pieces]
            if existing:
                return min(existing, key=lambda c: (rooms[c], c)), False
        for near in ([c for k in cores for c in topology.cores[k]],
                     [c for g in l3s for c in topology.l3_groups[g]]):
            fresh = [c for c in near if c not in anchor and c in self._takeable_in(self._cell(c))]
            if fresh:
                return pack(topology, fresh, 1, anchor)[0], True
        fresh = [c for x in nodes for cell in self.cells_in.get(x, ())
                 for c in self._takeable_in(cell) if c not in anchor]
        if fresh:
            return pack(topology, fresh, 1, anchor)[0], True
        if self.opts.numa_alignment in _STRICT_ALIGNMENT:
            raise InsufficientCPUs("no fragment CPU near the whole CPUs")
        fresh = [c for cell in self.free if cell[0] not in nodes for c in self._takeable_in(cell)]
        if fresh:
            return pack(topology, fresh, 1, anchor)[0], True
        existing = [c for c, room in rooms.items() if room >= pieces]
        if existing:
            return min(existing, key=lambda c: (rooms[c], c)), False
        raise InsufficientCPUs("no CPU has room for the fragment")


def _new_allocation(topology: Topology, ledger: Ledger, name: str, request: Request) -> Allocation:
    check_amount(ledger, request)
    if not request.options.bind:
        return Allocation(name, request)
    whole, fragment = bound_cpus(topology, ledger, request, CPUSet(), None)
    return Allocation(name, request, whole, fragment)


def bound_cpus(
    topology: Topology,
    ledger: Ledger,
    request: Request,
    keep: CPUSet,
    keep_fragment: Fragment | None,
) -> tuple[CPUSet, Fragment | None]:
    """Whole CPUs and fragment for a bound request; ``keep`` and ``keep_fragment`` are what the
    allocation holds already (the ledger no longer counts them as held)."""
    if request.cpuset is not None:
        return _explicit(topology, ledger, request.cpuset), None
    opts = request.options
    n = request.whole
    _check_policy(topology, request)
    if n <= len(keep):
        whole = CPUSet(_pick(topology, keep.ids, n, frozenset(), opts.policy))
    else:
        whole = keep | take_whole(topology, ledger, opts, n - len(keep), keep)
    fragment = None
    pieces = int(request.fraction * ledger.granularity)
    if pieces:
        if (
            keep_fragment is not None
            and keep_fragment.cpu in ledger.online
            and keep_fragment.cpu not in whole
            and ledger.free_pieces(keep_fragment.cpu) >= pieces
        ):
            fragment = Fragment(keep_fragment.cpu, pieces)
        else:
            fragment = take_fragment(topology, ledger, opts, pieces, whole)
    taken = whole | CPUSet((fragment.cpu,)) if fragment else whole
    from_shared = len(taken & ledger.shared)
    if from_shared > ledger.shared_budget:
        raise InsufficientCPUs(
            f"this would leave fewer than min_shared_cpus={ledger.min_shared_cpus} CPUs in the "
            f"shared pool ({len(ledger.shared)} now, {from_shared} needed from it)"
        )
    return whole, fragment


def _check_policy(topology: Topology, request: Request) -> None:
    """full-pcpus: the whole CPUs must be a sum of core sizes (any count on a machine with
    single-thread cores)."""
    n = request.whole
    step = whole_core_step(topology)
    if request.options.policy == Policy.FULL_PCPUS and n % step:
        raise InvalidArgument(
            f"policy full-pcpus takes whole physical cores: {n} whole CPUs is not a multiple "
            f"of {step} threads per core"
        )


def _explicit(topology: Topology, ledger: Ledger, cpuset: CPUSet) -> CPUSet:
    for cpu in cpuset:
        if cpu not in topology.cpus:
            raise InvalidArgument(f"cpuset: CPU {cpu} does not exist")
        if cpu not in ledger.online:
            raise InvalidArgument(f"cpuset: CPU {cpu} is offline")
        if cpu in ledger.reserved:
            raise InvalidArgument(f"cpuset: CPU {cpu} is reserved")
        if cpu in ledger.held:
            owners = ", ".join(ledger.owner_of(cpu))
            raise InsufficientCPUs(f"cpuset: CPU {cpu} is held by {owners}")
    return cpuset


def candidates(topology: Topology, ledger: Ledger, opts: Options, avoid: str) -> set[int]:
    """CPUs this request may take whole, after exclusivity (``avoid``: none|pcpu|numa) and
    policy filters."""
    free = set(ledger.takeable.ids)
    if avoid != Exclusive.NONE:
        key = topology.levels[3 if avoid == Exclusive.PCPU else 1]
        used = {
            key[c]
            for a in ledger.bound.values()
            if a.request.options.exclusive == opts.exclusive
            for c in a.held
        }
        free = {c for c in free if key[c] not in used}
    if opts.policy == Policy.FULL_PCPUS:
        core = topology.levels[3]
        counts: dict[int, int] = {}
        for c in free:
            counts[core[c]] = counts.get(core[c], 0) + 1
        size = topology.core_size
        free = {c for c in free if counts[core[c]] == size[core[c]]}
    return free


def _attempts(opts: Options) -> tuple[Exclusive, ...]:
    """The exclusivity take_whole tries in turn: numa falls back to pcpu."""
    if opts.exclusive == Exclusive.NUMA:
        return Exclusive.NUMA, Exclusive.PCPU
    return (opts.exclusive,)


def take_whole(
    topology: Topology, ledger: Ledger, opts: Options, n: int, anchor: CPUSet
) -> CPUSet:
    """``n`` more whole CPUs for a bound allocation that already holds ``anchor``."""
    if n <= 0:
        return CPUSet()
    attempts = _attempts(opts)
    error = InsufficientCPUs("no CPUs")
    for avoid in attempts:
        cands = candidates(topology, ledger, opts, avoid) - anchor.ids
        try:
            return CPUSet(_isolated_first(topology, ledger, cands, n, opts, anchor))
        except InsufficientCPUs as exc:
            error = exc
    raise error


def _isolated_first(
    topology: Topology, ledger: Ledger, cands: set[int], n: int, opts: Options, anchor: CPUSet
) -> list[int]:
    """Free isolated CPUs (kernel isolcpus: never shared, meant for bound work) come first: a
    request they can hold takes them, and one the shared pool's budget cannot cover takes all
    of them and the rest from the shared pool (not where NUMA alignment is strict)."""
    iso = cands & ledger.free_isolated.ids
    if iso and len(iso) >= n:
        with contextlib.suppress(InsufficientCPUs):
            return _take_in_nodes(topology, ledger, set(iso), n, opts, anchor)
    got = _take_in_nodes(topology, ledger, cands, n, opts, anchor)
    if (iso and len(iso) < n and len(set(got) - iso) > ledger.shared_budget
            and opts.numa_alignment not in _STRICT_ALIGNMENT):
        rest = _take_in_nodes(topology, ledger, cands - iso, n - len(iso), opts,
                              anchor | CPUSet(iso))
        return sorted(iso) + rest
    return got


def _take_in_nodes(
    topology: Topology,
    ledger: Ledger,
    cands: set[int],
    n: int,
    opts: Options,
    anchor: CPUSet,
) -> list[int]:
    if len(cands) < n:
        raise _shortage(ledger, _too_few(n, len(cands), opts.policy))
    nodes = _choose_nodes(topology, ledger, cands, n, opts, anchor)
    near = anchor.ids

    def shy() -> frozenset[int]:
        return spread_cores(topology, ledger)
    if nodes is None:
        return _pick(topology, cands, n, near, opts.policy, shy)
    node_of = topology.levels[1]
    if opts.numa_strategy == NumaStrategy.DISTRIBUTE_EVENLY and len(nodes) > 1:
        per_node = {x: [c for c in cands if node_of[c] == x] for x in nodes}
        out: list[int] = []
        quotas = _quotas(topology, [len(per_node[x]) for x in nodes], n, opts.policy)
        for x, quota in zip(nodes, quotas, strict=False):
            out += _pick(topology, per_node[x], quota, near | frozenset(out), opts.policy, shy)
        return out
    chosen = set(nodes)
    return _pick(topology, [c for c in cands if node_of[c] in chosen], n, near, opts.policy, shy)


def _too_few(n: int, available: int, policy: str) -> str:
    """The shortage message; counts CPUs, never cores."""
    where = "on whole free cores " if policy == Policy.FULL_PCPUS else ""
    return f"{n} CPUs requested but only {available} CPUs {where}are available"


def spread_cores(topology: Topology, ledger: Ledger) -> frozenset[int]:
    """Cores on which a spread-pcpus allocation holds a thread: packed leaves their other
    threads to later spread-pcpus requests while other threads will do."""
    core_of = topology.levels[3]
    return frozenset(core_of[c] for a in ledger.bound.values()
                     if a.request.options.policy == Policy.SPREAD_PCPUS for c in a.whole)


def _quotas(topology: Topology, free: list[int], n: int, policy: str) -> list[int]:
    """distribute-evenly's share of each node: _even_split, in whole cores for full-pcpus
    (where the nodes hold whole cores)."""
    step = whole_core_step(topology) if policy == Policy.FULL_PCPUS else 1
    if step > 1 and sum(f // step for f in free) >= n // step:
        return [q * step for q in _even_split([f // step for f in free], n // step)]
    return _even_split(free, n)  # cores split over nodes (never seen on hardware)


def _even_split(free: list[int], n: int) -> list[int]:
    """Split n over groups as evenly as their free counts allow."""
    quotas = [0] * len(free)
    left = n
    while left:
        open_ = [i for i in range(len(free)) if quotas[i] < free[i]]
        share = max(1, left // len(open_))
        for i in sorted(open_, key=lambda i: quotas[i] - free[i]):
            add = min(share, free[i] - quotas[i], left)
            quotas[i] += add
            left -= add
            if not left:
                break
    return quotas


def _choose_nodes(
    topology: Topology,
    ledger: Ledger,
    cands: Collection[int],
    n: int,
    opts: Options,
    anchor: CPUSet,
) -> list[int] | None:
    """The NUMA nodes to place in, in order of preference; None when NUMA doesn't matter."""
    if opts.numa_alignment == NumaAlignment.NONE or len(topology.nodes) <= 1:
        return None
    node_of = topology.levels[1]
    free: dict[int, int] = {}
    for c in cands:
        free[node_of[c]] = free.get(node_of[c], 0) + 1
    return _nodes_for(topology, ledger, free, n, opts, anchor)


def _nodes_for(
    topology: Topology,
    ledger: Ledger,
    free: Mapping[int, int],
    n: int,
    opts: Options,
    anchor: CPUSet,
) -> list[int]:
    """_choose_nodes from the candidates' count per node (nodes with none left out)."""
    align = opts.numa_alignment
    node_of = topology.levels[1]
    anchored = {node_of[c] for c in anchor}
    sign = 1 if opts.numa_strategy == NumaStrategy.MOST_ALLOCATED else -1

    def order(x: int) -> tuple[bool, int, int]:
        return (x not in anchored, sign * free[x], x)

    singles = [x for x in free
               if free[x] >= n and (align == NumaAlignment.BEST_EFFORT or anchored <= {x})]
    if singles:
        return [min(singles, key=order)]
    if align == NumaAlignment.SINGLE_NUMA_NODE:
        best = max(free.values(), default=0)
        raise InsufficientCPUs(
            f"numa-alignment single-numa-node: no NUMA node has {n} free CPUs (at most {best})"
        )
    socket_of = topology.levels[0]
    node_socket = {x: socket_of[next(iter(topology.nodes[x]))] for x in free}
    ranked = sorted(free, key=order)
    for k in range(2, len(ranked) + 1):
        if sum(sorted(free.values(), reverse=True)[:k]) < n:
            continue
        combo = _best_combo(ranked, k, n, free, anchored, node_socket, sign)
        if align == NumaAlignment.RESTRICTED:
            needed = _min_nodes(topology, ledger, n + len(anchor))
            if k + len(anchored - set(combo)) > needed:
                raise InsufficientCPUs(
                    f"numa-alignment restricted: {n + len(anchor)} CPUs fit in {needed} NUMA "
                    f"node(s) on this machine, but the free CPUs would span {k}"
                )
        return sorted(combo, key=order)
    raise InsufficientCPUs(f"{n} CPUs requested but not that many are free")


def _best_combo(
    ranked: list[int],
    k: int,
    n: int,
    free: Mapping[int, int],
    anchored: set[int],
    node_socket: Mapping[int, int],
    sign: int,
) -> tuple[int, ...]:
    """The k nodes with room for n CPUs that touch fewest foreign nodes and sockets."""
    def key(combo: tuple[int, ...]) -> tuple[int, int, int, tuple[int, ...]]:
        return (
            sum(x not in anchored for x in combo),
            len({node_socket[x] for x in combo}),
            sign * sum(free[x] for x in combo),
            combo,
        )

    if comb(len(ranked), k) <= _MAX_COMBOS:
        fits = (c for c in combinations(ranked, k) if sum(free[x] for x in c) >= n)
        return min(fits, key=key)
    greedy: list[int] = []
    for x in ranked:  # too many nodes to enumerate: preferred order, then the roomiest
        greedy.append(x)
        if len(greedy) == k:
            break
    if sum(free[x] for x in greedy) < n:
        greedy = sorted(ranked, key=lambda x: -free[x])[:k]
    return tuple(greedy)


def _min_nodes(topology: Topology, ledger: Ledger, n: int) -> int:
    """Fewest NUMA nodes whose allocatable capacity could hold n CPUs on an empty machine."""
    sizes = sorted((len(cpus - ledger.reserved) for cpus in topology.nodes.values()), reverse=True)
    total = 0
    for k, size in enumerate(sizes, 1):
        total += size
        if total >= n:
            return k
    return len(sizes)


def _pick(
    topology: Topology,
    cands: Collection[int],
    n: int,
    near: frozenset[int],
    policy: str,
    shy: Callable[[], Collection[int]] = frozenset,
) -> list[int]:
    """``n`` of ``cands`` as ``policy`` takes them (``shy()``: the cores spread-pcpus
    allocations use, asked for only when they matter)."""
    if policy != Policy.SPREAD_PCPUS:
        return pack(topology, cands, n, near, strict=policy == Policy.FULL_PCPUS, shy=shy)
    core_of = topology.levels[3]
    cores: dict[int, list[int]] = {}
    for c in cands:
        cores.setdefault(core_of[c], []).append(c)
    spread = shy()
    paired = [min(t) for k, t in cores.items()
              if len(t) != len(topology.cores[k]) and k in spread]
    full = [min(t) for k, t in cores.items() if len(t) == len(topology.cores[k])]
    partial = [min(t) for k, t in cores.items()
               if len(t) != len(topology.cores[k]) and k not in spread]
    out: list[int] = []
    for primaries in (paired, full, partial):
        out += _take(topology, primaries, min(n - len(out), len(primaries)), near)
    if len(out) < n:
        rest = set(cands) - set(out)
        out += _take(topology, rest, n - len(out), near | frozenset(out))
    return out


def whole_core_step(topology: Topology) -> int:
    """The step in which whole cores add up: the greatest common divisor of the core sizes (2
    on SMT-2, 1 on a machine with any single-thread core)."""
    return gcd(*topology.core_size.values()) if topology.core_size else 1


def pack(
    topology: Topology,
    cands: Collection[int],
    n: int,
    near: Collection[int] = frozenset(),
    *,
    strict: bool = False,
    shy: Callable[[], Collection[int]] = frozenset,
) -> list[int]:
    """``n`` of ``cands``, packed without splitting a core that need not be split.

    First whole cores: as many wholly free cores of threads_per_core threads as fit in ``n``,
    chosen by the best-fit walk of _take on one thread per core (so by whole-core counts, near
    ``near`` first). When those run out before the even part of ``n`` is covered, wholly free
    cores of fewer online threads (hybrid machines, or cores with offline threads) make it up,
    nearest first: they hold no lone thread. Then the rest (the odd remainder, or what no whole
    core is left for), one thread at a time where it does the least harm: a loose thread (the
    free sibling of a half-used core), nearest first (a sibling of ``near`` or of the cores just
    taken, then the same L3 group, then the same node), loose threads on ``shy()`` cores last
    within a rank; then single-thread cores; only then a thread of a wholly free core.
    ``strict`` (full-pcpus): never a thread of a core without the others: InsufficientCPUs when
    whole cores cannot make ``n``.
    """
    if n <= 0:
        return []
    tpc = topology.threads_per_core
    if not strict and (tpc == 1 or n >= len(cands)):
        return _take(topology, cands, n, frozenset(near)) if n < len(cands) else list(cands)
    core_of = topology.levels[3]
    by_core: dict[int, list[int]] = {}
    for c in cands:
        by_core.setdefault(core_of[c], []).append(c)
    wide: list[int] = []  # one thread of each wholly free core of tpc threads
    single: list[int] = []  # wholly free cores of fewer online threads
    loose: list[int] = []
    for k, threads in by_core.items():
        if len(threads) < len(topology.cores[k]):
            loose += threads
        elif len(threads) == tpc:
            wide.append(min(threads))
        else:
            single += threads
    out: list[int] = []
    k = min(n // tpc, len(wide))
    if k:
        for primary in _take(topology, wide, k, frozenset(near)):
            out += topology.cores[core_of[primary]].ids
    left = n - len(out)
    if not left:
        return out
    rank = _Rank(topology, [*near, *out])
    if not strict and left >= tpc and single:
        # wide cores ran out before the even part was covered: whole cores of fewer online
        # threads make it up (no lone thread), nearest first; loose threads only for the rest
        out += _whole_cores_of(topology, single, left - left % tpc, rank, exact=False)
        left = n - len(out)
        if not left:
            return out
        single = [c for c in single if c not in set(out)]
    spread: Collection[int] = shy() if loose and not strict else ()
    for tier in range(1 if strict else 3):
        if strict:
            cpus = _whole_cores_of(topology, single, left)
        elif tier == 2:  # split the best-fitting wholly free core not taken whole (left < tpc)
            taken_cores = {core_of[c] for c in out}
            rest = [p for p in wide if core_of[p] not in taken_cores]
            if rest:
                core = core_of[_take(topology, rest, 1, frozenset([*near, *out]))[0]]
                return out + sorted(by_core[core])[:left]
            break
        else:
            cpus = (loose, single)[tier]
        buckets: dict[tuple[int, bool], list[int]] = {}
        for c in cpus:
            buckets.setdefault((rank(c), core_of[c] in spread), []).append(c)
        for key in sorted(buckets):
            bucket = buckets[key]
            got = _take(topology, bucket, min(left, len(bucket)), frozenset([*near, *out]))
            out += got
            left -= len(got)
            if not left:
                return out
    sizes: dict[int, int] = {}
    for k, threads in by_core.items():
        if len(threads) == len(topology.cores[k]):
            sizes[len(threads)] = sizes.get(len(threads), 0) + 1
    free = ", ".join(f"{count} of {size} thread{'s' * (size > 1)}"
                     for size, count in sorted(sizes.items(), reverse=True)) or "none"
    raise InsufficientCPUs(
        f"{n} CPUs requested but whole free cores cannot make exactly {n} CPUs here "
        f"(whole free cores: {free})"
    )


def _whole_cores_of(
    topology: Topology,
    single: Collection[int],
    n: int,
    rank: Callable[[int], int] = lambda c: 0,
    *,
    exact: bool = True,
) -> list[int]:
    """Threads of whole small cores (from ``single``) adding up to at most ``n``, nearest
    (``rank``) and smallest cores first (full-pcpus on a hybrid machine: one-thread cores make
    an odd remainder); ``exact``: nothing unless they add up to exactly ``n``."""
    core_of = topology.levels[3]
    cores: dict[int, list[int]] = {}
    for c in single:
        cores.setdefault(core_of[c], []).append(c)
    out: list[int] = []
    for k in sorted(cores, key=lambda k: (rank(min(cores[k])), len(cores[k]), k)):
        if len(out) + len(cores[k]) <= n:
            out += sorted(cores[k])
    return out if len(out) == n or not exact else []


def _take(
    topology: Topology, cands: Collection[int], n: int, near: frozenset[int], level: int = 0
) -> list[int]:
    """Best-fit walk down socket -> node -> L3 -> core (see the module docstring)."""
    if n <= 0:
        return []
    if n >= len(cands):
        return list(cands)
    if level == len(topology.levels):
        return sorted(cands)[:n]
    key_of = topology.levels[level]
    parts: dict[int, list[int]] = {}
    for c in cands:
        parts.setdefault(key_of[c], []).append(c)
    if len(parts) == 1:
        return _take(topology, cands, n, near, level + 1)
    near_groups = {key_of[c] for c in near}

    def fit(g: int) -> tuple[bool, int, int]:
        return (g not in near_groups, len(parts[g]), g)

    fitting = [g for g in parts if len(parts[g]) >= n]
    if fitting:
        return _take(topology, parts[min(fitting, key=fit)], n, near, level + 1)
    whole_groups = _groups_of(topology, level)
    out: list[int] = []
    rest = []
    for g in sorted(parts, key=fit):
        if len(parts[g]) == len(whole_groups[g]) and len(parts[g]) <= n - len(out):
            out += parts[g]
        else:
            rest.append(g)
    while len(out) < n:
        left = n - len(out)
        fitting = [g for g in rest if len(parts[g]) >= left]
        if fitting:
            out += _take(topology, parts[min(fitting, key=fit)], left, near, level + 1)
            break
        biggest = max(rest, key=lambda g: (g in near_groups, len(parts[g]), -g))
        out += parts[biggest]
        rest.remove(biggest)
    return out


def _groups_of(topology: Topology, level: int) -> Mapping[int, CPUSet]:
    return (topology.sockets, topology.nodes, topology.l3_groups, topology.cores)[level]


def take_fragment(
    topology: Topology, ledger: Ledger, opts: Options, pieces: int, anchor: CPUSet
) -> Fragment:
    """A CPU with ``pieces`` free pieces, near ``anchor`` (the allocation's whole CPUs).

    An existing fragment CPU that is an SMT sibling of, shares an L3 with or sits on the NUMA node
    of the whole CPUs comes first (fewest free pieces first); then a fresh CPU from the shared
    pool, nearest first; then any fragment CPU with room (unless NUMA alignment forbids it).
    """
    g = ledger.granularity
    rank = _Rank(topology, anchor)
    aligned_only = bool(anchor) and opts.numa_alignment in _STRICT_ALIGNMENT
    existing = [
        c for c, used in ledger.fragment_pieces.items()
        if g - used >= pieces and c not in anchor and (not aligned_only or rank(c) <= 2)
    ]
    best = min(existing, key=lambda c: (rank(c), g - ledger.fragment_pieces[c], c), default=None)
    if best is not None and (rank(best) <= 2 or not anchor):
        return Fragment(best, pieces)
    fresh = [c for c in ledger.takeable - anchor if not aligned_only or rank(c) <= 2]
    if fresh:
        nearest = min(map(rank, fresh))
        chosen = pack(topology, [c for c in fresh if rank(c) == nearest], 1, anchor.ids)
        return Fragment(chosen[0], pieces)
    if best is not None:
        return Fragment(best, pieces)
    raise _shortage(ledger, f"no CPU has {pieces} free pieces (of {g}) for this fragment")


def _shortage(ledger: Ledger, message: str) -> InsufficientCPUs:
    if not ledger.shared_budget:
        message += (
            f"; the shared pool is at its minimum (min_shared_cpus={ledger.min_shared_cpus})"
        )
    return InsufficientCPUs(message)


class _Rank:
    """0 = SMT sibling of an anchor CPU, 1 = same L3, 2 = same NUMA node, 3 = elsewhere."""

    def __init__(self, topology: Topology, anchor: Iterable[int]) -> None:
        _, node, l3, core = topology.levels
        anchor = list(anchor)
        self._levels = ((core, {core[c] for c in anchor}), (l3, {l3[c] for c in anchor}),
                        (node, {node[c] for c in anchor}))

    def __call__(self, cpu: int) -> int:
        for i, (key, groups) in enumerate(self._levels):
            if key[cpu] in groups:
                return i
        return 3
