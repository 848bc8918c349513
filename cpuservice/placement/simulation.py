"""The capacity counter's simulation: allocations of one request placed one after another on a
model of the free CPUs per (NUMA node, L3 group) cell. Pure."""


from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Mapping

from cpuservice.model.cpuset import EMPTY as EMPTY_SET
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    InsufficientCPUs,
)
from cpuservice.model.pools import Ledger
from cpuservice.model.request import (
    Exclusive,
    NumaAlignment,
    NumaStrategy,
    Policy,
    Request,
)
from cpuservice.model.topology import Topology
from cpuservice.placement.closed import _unit_capacity
from cpuservice.placement.nodes import _nodes_for, _quotas
from cpuservice.placement.pack import _pick, _take, pack
from cpuservice.placement.whole import _STRICT_ALIGNMENT, _attempts, spread_cores

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
