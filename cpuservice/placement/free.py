"""The free CPUs as placement sees them for one request's options. Pure.

The allocatable shared and the free isolated CPUs, the fragment CPUs' free pieces, the cores and
nodes exclusivity rules out, the shared pool's budget; and views of the candidates per cell (the
CPUs of one NUMA node and L3 group, see Topology.cells) with their count per node. The choice
code (choose.py) reads only this. allocate builds one and makes one choice on it; capacity makes
choice after choice on one, and ``take`` marks only the cells a choice touched to be looked at
again, so that a step looks at the cell it lands in and the counts per node rather than at the
whole machine and the ledger.
"""


from __future__ import annotations

from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from typing import cast

from cpuservice.model import near
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.freeview import Classes, classify
from cpuservice.model.pools import Ledger
from cpuservice.model.request import Exclusive, NearPolicy, Options, Policy
from cpuservice.model.topology import Topology
from cpuservice.model.vocab import FULL_PCPUS, NO_EXCLUSIVE, SPREAD_PCPUS

Cell = tuple[int, int]  # (NUMA node, L3 group or -1)
# a key's marks (see Free.candidates): only the CPUs next to the devices of option near, or
# only the others; of the cores kept next to devices (cpuservice.model.keep): only those kept
# for this request's devices, or none of them; only those kept for others, or any CPU (without
# one of these two marks, the cores kept for others are no candidates)
NEAR, FAR = "+near", "+far"
MINE, NOT_MINE, LOCKED, ANY = "+mine", "+notmine", "+locked", "+any"
View = tuple[dict[Cell, AbstractSet[int]], dict[int, int]]


class Free:
    """What a bound request of options ``opts`` may take on ``ledger``; ``hide``: CPUs that are
    free but never candidates (what a resized allocation keeps); ``steps``: choices follow one
    another on this view (capacity), so the choice code may walk counts per cell instead of
    looking at every candidate (choose._walk)."""

    # slots: past 30 attributes CPython no longer shares an instance dict's keys
    __slots__ = ("_carried", "_everything", "_fragments_in", "_free", "_free_isolated",
                 "_packed", "_primary", "_rooms", "_shy", "_stale", "_takeable", "_views",
                 "carried", "cell_of", "cells", "core_of", "devices", "g", "groups", "hide",
                 "in_node", "isolated", "l3_of", "ledger", "locked", "min_shared", "mine",
                 "near", "near_required", "node_of", "numa_failed", "numa_failed_near", "opts",
                 "shared", "soft", "steps", "topology", "used_cores", "used_nodes")

    def __init__(self, topology: Topology, ledger: Ledger, opts: Options,
                 hide: CPUSet = EMPTY, *, steps: bool = False) -> None:
        self.topology = topology
        self.steps = steps
        self.ledger = ledger
        self.opts = opts
        self.g = ledger.granularity
        self.cells = topology.cells
        self.cell_of = self.cells.of
        _, self.node_of, self.l3_of, self.core_of = topology.levels
        self.hide = hide.ids
        self.isolated = ledger.isolated.ids
        # the free CPUs per node, carried with the ledger (Ledger.free_view)
        self.carried = ledger.free_view(topology)
        self.shared = self.carried.shared
        self.min_shared = ledger.min_shared_cpus
        # the allocatable shared CPUs and the free isolated ones (take replaces them), derived
        # from the ledger when first asked for
        self._free: frozenset[int] | None = None
        self._free_isolated: frozenset[int] | None = None if self.carried.isolated else EMPTY.ids
        # the cells views are kept in: a single choice needs only nodes
        self.groups = self.cells.cpus if steps else self.cells.nodes
        self.in_node = self.cells.in_node if steps else self.cells.node_in
        self._rooms: dict[int, int] | None = None
        self._fragments_in: dict[tuple[int, int], set[int]] | None = None
        self.used_cores: set[int] = set()
        self.used_nodes: set[int] = set()
        if opts.exclusive != NO_EXCLUSIVE:
            for a in ledger.bound.values():
                if a.request.options.exclusive == opts.exclusive:
                    self._use(a.held)
        self.numa_failed = False  # exclusive=numa found no free node (candidates only shrink)
        # option near: the CPUs next to its devices (None: no device, or none with locality),
        # the candidates of the keys marked NEAR; required: every choice keeps to them
        devices = near.parse(opts.near) if opts.near is not None else ()
        cpus = near.near_cpus(topology, devices) if devices else None
        self.devices = devices
        self.near: frozenset[int] | None = cpus.ids if cpus is not None else None
        self.near_required = opts.near_policy == NearPolicy.REQUIRED
        self.numa_failed_near = False  # as numa_failed, among the CPUs next to the devices
        # cores kept next to devices: those this request's devices have first (mine), those
        # kept for others (locked: never, or when-full only when nothing else fits)
        keep = ledger.keep
        self.mine: frozenset[int] = keep.mine(devices).ids if keep.nodes else EMPTY.ids
        self.locked: frozenset[int] = (keep.cpus.ids - self.mine) if keep.nodes else EMPTY.ids
        self.soft = keep.soft
        self._shy: set[int] | None = None
        self._takeable: frozenset[int] | None = None
        # per key (see candidates): the candidates of every cell and their count per node (nodes
        # with any), brought up to date from the cells steps touched (_stale) when next looked at
        self._views: dict[str, View] = {}
        self._everything: dict[str, AbstractSet[int]] = {}  # of fresh views: all their candidates
        self._stale: dict[str, set[Cell]] = {}
        self._primary: dict[tuple[Cell, str], tuple[list[int], ...]] = {}
        self._packed: dict[tuple[Cell, str], tuple[list[int], ...]] = {}
        self._carried: bool | None = None  # _carries but for the key

    @property
    def rooms(self) -> dict[int, int]:
        """Fragment CPU -> its free pieces (take updates them)."""
        if self._rooms is None:
            self._rooms = {c: self.g - used for c, used in self.ledger.fragment_pieces.items()}
        return self._rooms

    @property
    def free(self) -> frozenset[int]:
        """The allocatable shared CPUs (free, not reserved)."""
        if self._free is None:
            self._free = (self.ledger.shared - self.ledger.reserved).ids
        return self._free

    @free.setter
    def free(self, cpus: frozenset[int]) -> None:
        self._free = cpus

    @property
    def free_isolated(self) -> frozenset[int]:
        """The free isolated CPUs."""
        if self._free_isolated is None:
            self._free_isolated = self.ledger.free_isolated.ids
        return self._free_isolated

    @free_isolated.setter
    def free_isolated(self, cpus: frozenset[int]) -> None:
        self._free_isolated = cpus

    def budget(self) -> int:
        """How many CPUs may still leave the shared pool (Ledger.shared_budget)."""
        return max(0, self.shared - self.min_shared)

    def shy(self) -> Collection[int]:
        """The cores on which spread-pcpus allocations hold a thread (packed leaves their other
        threads to later spread-pcpus requests while other threads will do), asked for only
        when they matter."""
        if self._shy is None:
            view = self.carried
            if view.spread is None:  # carried on to the next ledgers from here
                core_of, counts = self.core_of, dict[int, int]()
                for a in self.ledger.bound.values():
                    if a.request.options.policy == Policy.SPREAD_PCPUS:
                        for c in a.whole:
                            counts[core_of[c]] = counts.get(core_of[c], 0) + 1
                view.spread = counts
            if not self.steps:  # nothing changes it
                return view.spread.keys()
            self._shy = set(view.spread)
        return self._shy

    def takeable(self) -> frozenset[int]:
        """Ledger.takeable: the allocatable CPUs, only the free isolated ones when the shared
        pool is at its minimum."""
        if self._takeable is None:
            if self._free is None:  # nothing taken yet: as the ledger has it
                self._takeable = self.ledger.takeable.ids
            else:
                self._takeable = (self.free | self.free_isolated if self.budget()
                                  else self.free_isolated)
        return self._takeable

    def candidates(self, key: str, within: frozenset[int] | None = None) -> AbstractSet[int]:
        """The CPUs this request may take whole (of ``within``, a cell's CPUs): takeable, after
        exclusivity and the policy's filter (full-pcpus: threads of wholly takeable cores).
        ``key`` is ``avoid`` (none|pcpu|numa), or ``avoid/iso`` or ``avoid/shared`` for the
        isolated candidates or the others; ``avoid`` marked NEAR (``pcpu+near/iso``): only
        those next to the devices of option near, FAR: only the others; marked MINE, NOT_MINE,
        LOCKED or ANY: as those marks say (kept cores)."""
        free: AbstractSet[int] = self.takeable() if within is None else self.takeable() & within
        avoid, _, subset = key.partition("/")
        if "+" in avoid:
            avoid, *marks = avoid.split("+")
            free = self._marked(free, marks)
        elif self.locked:
            free = free - self.locked
        if avoid == Exclusive.NUMA and self.used_nodes:
            node_of = self.node_of
            free = {c for c in free if node_of[c] not in self.used_nodes}
        elif avoid == Exclusive.PCPU and self.used_cores:
            core_of = self.core_of
            free = {c for c in free if core_of[c] not in self.used_cores}
        if self.opts.policy == Policy.FULL_PCPUS:  # in a cell, its cores lie whole (nested)
            core_of, size = self.core_of, self.topology.core_size
            counts: dict[int, int] = {}
            for c in free:
                counts[core_of[c]] = counts.get(core_of[c], 0) + 1
            free = {c for c in free if counts[core_of[c]] == size[core_of[c]]}
        if subset:
            free = free & self.isolated if subset == "iso" else free - self.isolated
        if self.hide:
            free = free - self.hide
        return free

    def _marked(self, free: AbstractSet[int], marks: list[str]) -> AbstractSet[int]:
        """``free`` as a key's marks leave it (see NEAR, MINE, ...)."""
        for mark in marks:
            if mark in ("near", "far") and self.near is not None:
                free = free & self.near if mark == "near" else free - self.near
            elif mark == "mine":
                free = free & self.mine
            elif mark == "notmine":
                free = free - self.mine
            elif mark == "locked":
                free = free & self.locked
        if self.locked and "any" not in marks and "locked" not in marks:
            free = free - self.locked
        return free

    def view(self, key: str) -> View:
        """The candidates for ``key`` per cell, and their count per node."""
        if (known := self._views.get(key)) is not None and not self._stale[key]:
            return known
        if key not in self._views and self._carries(key):
            cells_, counts_ = (self.carried.whole_view() if self.opts.policy == FULL_PCPUS
                               else (self.carried.cells, self.carried.counts))
            # not copied: only steps (capacity) change a view
            known = self._views[key] = cast(View, (cells_, counts_))
            self._stale[key] = set()
            return known
        if key not in self._views:
            cands = self.candidates(key)
            if not self.steps:
                self._everything[key] = cands
            cells = {cell: cands & cpus for cell, cpus in self.groups.items()}
            counts: dict[int, int] = {}
            for (x, _), cs in cells.items():
                if cs:
                    counts[x] = counts.get(x, 0) + len(cs)
            self._views[key] = cells, counts
            self._stale[key] = set()
        cells, counts = self._views[key]
        for cell in self._stale[key]:
            new = self.candidates(key, self.groups[cell])
            x = cell[0]
            left = counts.get(x, 0) - len(cells[cell]) + len(new)
            cells[cell] = new
            if left:
                counts[x] = left
            else:
                counts.pop(x, None)
        self._stale[key].clear()
        return cells, counts

    def _carries(self, key: str) -> bool:
        """The carried view (Ledger.free_view) is this key's view: one choice, no exclusivity,
        no mark or subset, nothing hidden, no core kept for others (config keep_near), the
        takeable CPUs the allocatable ones, cores in one node each (full-pcpus filters by core
        per cell). (One choice: nothing it asks changes, so the answer is kept.)"""
        if self._carried is None:
            self._carried = (not self.steps and not self.hide and not self.locked
                             and self.budget() > 0 and self.cells.nested)
        return self._carried and key == NO_EXCLUSIVE

    def picking(self, key: str, nodes: Collection[int]
                ) -> tuple[Collection[int], int, Classes | None]:
        """everything(key, nodes), level(nodes), and pack's classes of those candidates or
        spread-pcpus' primaries there (pack._pick), carried with the free view per node where
        one node's candidates are the carried view's (None: _pick finds them itself)."""
        if len(nodes) == 1 and not self.steps and self._carries(key):
            cell, policy, view = self.in_node[next(iter(nodes))][0], self.opts.policy, self.carried
            classes = (view.primaries(cell, self.shy()) if policy == SPREAD_PCPUS else
                       view.full_classes(cell) if policy == FULL_PCPUS else
                       view.classes(cell))
            return self.view(key)[0][cell], self.level(nodes), classes
        return self.everything(key, nodes), self.level(nodes), None

    def everything(self, key: str, nodes: Collection[int]) -> Collection[int]:
        """The candidates for ``key`` in ``nodes`` (nodes with candidates)."""
        cells, counts = self.view(key)
        if key in self._everything and len(nodes) == len(counts):
            return self._everything[key]
        in_node = self.in_node
        if len(nodes) == 1 and not self.steps:
            return cells[in_node[next(iter(nodes))][0]]
        return [c for x in nodes for cell in in_node[x] for c in cells[cell]]

    def level(self, nodes: Collection[int]) -> int:
        """The first level of the walk (pack._take) at which CPUs of ``nodes`` may differ: 2
        (L3 groups) inside one node of one socket, else 0."""
        return 2 if len(nodes) == 1 and self.cells.node_socket is not None else 0

    def primaries(self, cell: Cell, key: str, cands: Collection[int]) -> tuple[list[int], ...]:
        """The lowest candidate thread of each partly free core of a cell that spread-pcpus
        uses, of each core whose online threads are all candidates, and of each other core with
        candidates (as _pick for spread-pcpus)."""
        if (cell, key) not in self._primary:
            cores: dict[int, list[int]] = {}
            for c in cands:
                cores.setdefault(self.core_of[c], []).append(c)
            paired: list[int] = []
            full: list[int] = []
            partial: list[int] = []
            shy, threads = self.shy(), self.topology.sizes[3]
            for k, t in cores.items():
                if len(t) == threads[k]:
                    full.append(min(t))
                else:
                    (paired if k in shy else partial).append(min(t))
            self._primary[cell, key] = paired, full, partial
        return self._primary[cell, key]

    def packed_classes(self, cell: Cell, key: str, cands: Collection[int]
                       ) -> tuple[list[int], ...]:
        """pack's classes (classify) of a cell's candidates, the loose threads split by
        whether spread-pcpus uses their core (shy): wide, single, loose elsewhere, loose on
        shy cores; kept across steps until a step touches the cell (packed only: shy does
        not change; full-pcpus: no loose thread)."""
        if (cell, key) not in self._packed:
            wide, single, loose = classify(self.topology, cands)
            shy = self.shy() if loose else ()
            self._packed[cell, key] = (wide, single,
                                       [c for c in loose if self.core_of[c] not in shy],
                                       [c for c in loose if self.core_of[c] in shy])
        return self._packed[cell, key]

    def fragments_in(self, level: int, group: int) -> Collection[int]:
        """Fragment CPUs in a node (level 1) or L3 group (level 2)."""
        if self._fragments_in is None:
            self._fragments_in = {}
            for c in self.rooms:
                self._index_fragment(c)
        return self._fragments_in.get((level, group), ())

    def _index_fragment(self, cpu: int) -> None:
        if self._fragments_in is not None:
            self._fragments_in.setdefault((1, self.node_of[cpu]), set()).add(cpu)
            self._fragments_in.setdefault((2, self.l3_of[cpu]), set()).add(cpu)

    def from_shared(self, taken: Collection[int]) -> int:
        """How many of ``taken`` (free CPUs) leave the shared pool."""
        if not self.isolated:
            return len(taken)
        return sum(c not in self.isolated for c in taken)

    def leaving(self, cpus: CPUSet) -> int:
        """How many of ``cpus`` (CPUs an allocation holds already, which the ledger no longer
        counts as held) leave the shared pool: len(cpus & ledger.shared), without deriving the
        shared pool."""
        if not cpus:
            return 0
        ledger = self.ledger
        return len(cpus.ids.intersection(ledger.online.ids).difference(
            ledger.isolated.ids, ledger.exclusive.ids, ledger.fragment_pieces))

    def take(self, whole: list[int], fragment: int | None, fresh: bool, pieces: int) -> None:
        """Hold ``whole`` and ``pieces`` of ``fragment`` (``fresh``: a CPU no fragment used) as
        one more allocation of these options would; only the cells touched are looked at
        again (needs Topology.cells.nested: a core in two cells would change both)."""
        assert self.steps, "Free.take needs steps=True (views of one choice are shared)"
        taken = [*whole, fragment] if fresh and fragment is not None else whole
        had_budget = self.budget() > 0
        self.free = self.free.difference(taken)
        self.free_isolated = self.free_isolated.difference(taken)
        self.shared -= self.from_shared(taken)
        self._takeable = None
        held = [*whole, fragment] if fragment is not None else whole
        touched = {self.cell_of[c] for c in held}
        if self.opts.policy == Policy.SPREAD_PCPUS:
            self.shy()
            assert self._shy is not None
            self._shy.update(self.core_of[c] for c in whole)
        if fragment is not None:
            if fresh:
                self.rooms[fragment] = self.g - pieces
                self._index_fragment(fragment)
            else:
                self.rooms[fragment] -= pieces
        if self.opts.exclusive != Exclusive.NONE:
            new_nodes = {self.node_of[c] for c in held} - self.used_nodes
            self._use(held)  # their cores lie in the cells touched
            touched.update(cell for x in new_nodes for cell in self.cells.in_node.get(x, ()))
        if had_budget and not self.budget():  # takeable: the free isolated CPUs only
            self._views.clear()
            self._primary.clear()
            self._packed.clear()
            return
        for cell in touched:
            for key in self._views:
                self._stale[key].add(cell)
                self._primary.pop((cell, key), None)
                self._packed.pop((cell, key), None)

    def _use(self, cpus: Iterable[int]) -> None:
        for c in cpus:
            self.used_cores.add(self.core_of[c])
            self.used_nodes.add(self.node_of[c])
