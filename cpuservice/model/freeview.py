"""The free CPUs per NUMA node, carried with the ledger from one change to the next (issue 40).

A bound allocation's choice starts from the CPUs it may take per NUMA node (placement/free.py).
Derived afresh from the ledger that costs a few passes over every CPU of the machine (held,
shared, allocatable, then one intersection per node) on every call. A FreeView holds them per
node cell (Topology.cells.nodes) for one ledger; Ledger.with_allocation and Ledger.without hand
the next ledger a view updated in the cells the changed allocation's CPUs lie in, so a call
looks at the CPUs it changes rather than at the machine. Pure; tests/unit/test_freeview.py
checks that a carried view always equals one built from the ledger.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.topology import Cell, Topology
from cpuservice.model.vocab import SPREAD_PCPUS

# placement/pack.py's view of its candidates: wide, single and loose (classify)
Classes = tuple[Collection[int], Collection[int], Collection[int]]
_NONE: frozenset[int] = frozenset()


class _Options(Protocol):
    @property
    def policy(self) -> str: ...


class _Request(Protocol):
    @property
    def options(self) -> _Options: ...


class _Fragment(Protocol):
    @property
    def cpu(self) -> int: ...


class Allocation(Protocol):
    """What the view reads of an allocation (pools.Allocation)."""

    @property
    def whole(self) -> CPUSet: ...
    @property
    def fragment(self) -> _Fragment | None: ...
    @property
    def held(self) -> CPUSet: ...
    @property
    def request(self) -> _Request: ...


class Ledger(Protocol):
    """What the view reads of a ledger (pools.Ledger, which imports this module)."""

    @property
    def online(self) -> CPUSet: ...
    @property
    def reserved(self) -> CPUSet: ...
    @property
    def isolated(self) -> CPUSet: ...
    @property
    def exclusive(self) -> CPUSet: ...
    @property
    def fragment_pieces(self) -> Mapping[int, int]: ...
    @property
    def allocatable(self) -> CPUSet: ...
    @property
    def shared(self) -> CPUSet: ...
    @property
    def free_isolated(self) -> CPUSet: ...


class FreeView:
    """For one ledger and topology: ``cells``, node cell -> its allocatable CPUs (free shared
    CPUs that are not reserved, and free isolated ones: Ledger.allocatable); ``counts``, node
    -> their number (nodes with any); ``shared``, the size of the shared pool; ``isolated``, the
    number of free isolated CPUs. ``whole(cell)``: the CPUs of a cell on cores all of whose
    threads (online or not) are allocatable; ``classes(cell)``: pack's classes of a cell. Both
    follow from the cell's CPUs whose core's online threads are all allocatable, found when
    first asked for and then carried from view to view (after: a change looks at the cores of
    the CPUs it moves, not at the cell), so that a choice does not count the threads of every
    core of the cell it lands in."""

    __slots__ = ("_ow", "_whole_cells", "_whole_counts", "cells", "counts", "isolated", "shared",
                 "spread", "topology")

    def __init__(self, topology: Topology, cells: dict[Cell, frozenset[int]],
                 counts: dict[int, int], shared: int, isolated: int,
                 ow: dict[Cell, frozenset[int]] | None = None,
                 whole_counts: dict[int, int] | None = None,
                 whole_cells: dict[Cell, frozenset[int]] | None = None,
                 spread: dict[int, int] | None = None) -> None:
        self.topology = topology
        self.cells = cells
        self.counts = counts
        self.shared = shared
        self.isolated = isolated
        # cell -> its CPUs whose core's online threads are all allocatable (cells asked for;
        # only where cores lie in one cell: Topology.cells.nested)
        self._ow: dict[Cell, frozenset[int]] = {} if ow is None else ow
        self._whole_counts = whole_counts  # of whole_view, when asked
        self._whole_cells = whole_cells  # whole_view's cells, when asked
        # core -> how many of its threads spread-pcpus allocations hold (Free.shy), filled in
        # by the first choice that asks
        self.spread = spread

    @classmethod
    def build(cls, topology: Topology, ledger: Ledger) -> FreeView:
        """The view of ``ledger``, derived from its pools."""
        free = ledger.allocatable.ids
        cells = {cell: free & cpus for cell, cpus in topology.cells.nodes.items()}
        counts: dict[int, int] = {}
        for (x, _), cs in cells.items():
            if cs:
                counts[x] = counts.get(x, 0) + len(cs)
        return cls(topology, cells, counts, len(ledger.shared), len(ledger.free_isolated))

    def _whole_online(self, cell: Cell) -> frozenset[int]:
        """The CPUs of ``cell`` whose core's online threads are all allocatable."""
        out = self._ow.get(cell)
        if out is None:
            cpus, of = self.cells[cell], self.topology.core_threads.of
            out = self._ow[cell] = frozenset(c for c in cpus if of[c] <= cpus)
        return out

    def whole(self, cell: Cell) -> frozenset[int]:
        """The CPUs of ``cell`` whose core is wholly allocatable (cores lie in one cell:
        Topology.cells.nested)."""
        partial = self.topology.core_threads.partial
        out = self._whole_online(cell)
        return out.difference(partial) if partial else out

    def classes(self, cell: Cell) -> Classes:
        """classify of the cell's CPUs, from its wholly allocatable cores (where cores lie in
        one cell)."""
        if not self.topology.cells.nested:
            return classify(self.topology, self.cells[cell])
        threads = self.topology.core_threads
        whole = self._whole_online(cell)
        return whole & threads.wide, whole - threads.full, self.cells[cell] - whole

    def primaries(self, cell: Cell, shy: Collection[int]) -> Classes | None:
        """spread-pcpus' primaries in a cell (pack._pick): the lowest free thread of each
        partly free core that spread-pcpus uses (``shy``), of each wholly free core, of each
        other partly free core; None where cores do not lie in one cell."""
        if not self.topology.cells.nested:
            return None
        whole = self._whole_online(cell)
        full = whole & self.topology.core_threads.first
        loose = self.cells[cell] - whole
        if not loose:
            return (), full, ()
        core_of = self.topology.levels[3]
        lowest: dict[int, int] = {}
        for c in loose:
            if (k := core_of[c]) not in lowest or c < lowest[k]:
                lowest[k] = c
        return ([c for k, c in lowest.items() if k in shy], full,
                [c for k, c in lowest.items() if k not in shy])

    def full_classes(self, cell: Cell) -> Classes:
        """classify of whole(cell), full-pcpus' candidates in the cell."""
        threads = self.topology.core_threads
        whole = self.whole(cell)
        return whole & threads.wide, whole - threads.full, ()

    def whole_view(self) -> tuple[dict[Cell, frozenset[int]], dict[int, int]]:
        """whole() of every cell, and their number per node (nodes with any)."""
        cells = self._whole_cells
        if cells is None:
            cells = self._whole_cells = {cell: self.whole(cell) for cell in self.cells}
        if self._whole_counts is None:
            counts: dict[int, int] = {}
            for (x, _), cs in cells.items():
                if cs:
                    counts[x] = counts.get(x, 0) + len(cs)
            self._whole_counts = counts
        return cells, self._whole_counts

    def after(self, old: Ledger, new: Ledger, gone: Allocation | None,
              added: Allocation | None) -> FreeView:
        """The view of ``new``: ``old`` (this view's ledger) without the bound allocation
        ``gone`` and with the bound allocation ``added`` (either may be None). ``new`` must know
        its exclusive CPUs and fragment pieces (Ledger._with carries them)."""
        leave: AbstractSet[int] = _NONE  # CPUs no longer free
        back: AbstractSet[int] = _NONE  # CPUs free again
        if gone is None and added is not None:  # the common cases first: one allocation
            leave = added.whole.ids
            fragment = added.fragment
            if fragment and fragment.cpu not in old.fragment_pieces:
                leave = leave | {fragment.cpu}
        elif added is None and gone is not None:
            back = gone.whole.ids
            fragment = gone.fragment
            if fragment and fragment.cpu not in new.fragment_pieces:
                back = back | {fragment.cpu}
        else:  # one replaced by another (resize, repair): ask both ledgers
            old_x, old_f = old.exclusive.ids, old.fragment_pieces
            new_x, new_f = new.exclusive.ids, new.fragment_pieces
            went: set[int] = set()
            came: set[int] = set()
            for c in {c for a in (gone, added) if a is not None for c in a.held}:
                was = c not in old_x and c not in old_f
                if was != (c not in new_x and c not in new_f):
                    (came if not was else went).add(c)
            leave, back = went, came
        online, reserved, isolated = old.online.ids, old.reserved.ids, old.isolated.ids
        shared, free_isolated = self.shared, self.isolated
        node_of = self.topology.levels[1]
        node_cpus = self.topology.cells.nodes
        moved: dict[int, list[Collection[int]]] = {}  # node -> [CPUs out, CPUs in]
        for cpus, sign, i in ((leave, -1, 0), (back, 1, 1)):
            if not cpus:
                continue
            if not cpus <= online:
                cpus = cpus & online
            if isolated and not isolated.isdisjoint(cpus):
                iso = cpus & isolated
                free_isolated += sign * len(iso - reserved)
                shared += sign * (len(cpus) - len(iso))
            else:
                shared += sign * len(cpus)
            mine = cpus - reserved if reserved else cpus  # Ledger.allocatable
            if not mine:
                continue
            x = node_of[next(iter(mine))]
            if mine <= node_cpus[x, -1]:  # the common case: one node
                moved.setdefault(x, [_NONE, _NONE])[i] = mine
                continue
            per_node: dict[int, list[int]] = {}
            for c in mine:
                per_node.setdefault(node_of[c], []).append(c)
            for x, part in per_node.items():
                moved.setdefault(x, [_NONE, _NONE])[i] = part
        spread = self.spread
        if spread is not None and (
                (gone is not None and gone.request.options.policy == SPREAD_PCPUS)
                or (added is not None and added.request.options.policy == SPREAD_PCPUS)):
            spread = self._spread_after(gone, added)
        if not moved:
            return FreeView(self.topology, self.cells, self.counts, shared, free_isolated,
                            self._ow, self._whole_counts, self._whole_cells, spread)
        cells = self.cells.copy()
        counts = self.counts.copy()
        ow = self._ow.copy()
        whole_counts = self._whole_counts
        if whole_counts is not None:
            whole_counts = whole_counts.copy()
        whole_cells = self._whole_cells
        if whole_cells is not None:
            whole_cells = whole_cells.copy()
        threads = self.topology.core_threads
        of, partial = threads.of, threads.partial
        reorder = False
        for x, (out, into) in moved.items():
            cell = (x, -1)
            before = cells[cell]
            now = before.difference(out).union(into) if into else before.difference(out)
            left = counts.get(x, 0) - len(before) + len(now)
            cells[cell] = now
            if left:
                if x not in counts:
                    reorder = True
                counts[x] = left
            else:
                counts.pop(x, None)
            had = ow.get(cell)
            if had is None:
                whole_counts = whole_cells = None
                continue
            # less the cores of the CPUs that left, plus those now wholly allocatable
            has = had.difference(*map(of.__getitem__, out)) if out else had
            if into:
                has = has.union(*[of[c] for c in into if of[c] <= now])
            ow[cell] = has
            if whole_cells is not None:
                whole_cells[cell] = has.difference(partial) if partial else has
            if whole_counts is not None:  # whole(cell)'s number per node (whole_view)
                left = whole_counts.get(x, 0) + (len(has.difference(partial))
                                                 - len(had.difference(partial)) if partial
                                                 else len(has) - len(had))
                if left:
                    if x not in whole_counts:
                        reorder = True
                    whole_counts[x] = left
                else:
                    whole_counts.pop(x, None)
        if reorder:  # nodes in the order a fresh view lists them
            counts = dict(sorted(counts.items()))
            if whole_counts is not None:
                whole_counts = dict(sorted(whole_counts.items()))
        return FreeView(self.topology, cells, counts, shared, free_isolated, ow, whole_counts,
                        whole_cells, spread)

    def again(self, new: Ledger, changed: Sequence[tuple[Allocation, int]]) -> FreeView:
        """The view of ``new``, this view's ledger after the bound allocations of ``changed``
        left (-1) or came (1), many at once (Ledger.with_allocations): derived afresh, the
        spread cores carried over."""
        view = FreeView.build(self.topology, new)
        view.spread = self._spread_changed(changed)
        return view

    def _spread_after(self, gone: Allocation | None, added: Allocation | None
                      ) -> dict[int, int] | None:
        """``spread`` less ``gone``'s and plus ``added``'s threads, where they are
        spread-pcpus allocations."""
        return self._spread_changed([(a, sign) for a, sign in ((gone, -1), (added, 1))
                                     if a is not None])

    def _spread_changed(self, changed: Sequence[tuple[Allocation, int]]
                        ) -> dict[int, int] | None:
        """``spread`` with the threads of ``changed``'s spread-pcpus allocations taken away
        (-1) or added (1)."""
        if self.spread is None:
            return None
        spread: dict[int, int] | None = None
        core_of = self.topology.levels[3]
        for a, sign in changed:
            if a.request.options.policy != SPREAD_PCPUS:
                continue
            if spread is None:
                spread = self.spread.copy()
            for c in a.whole.ids:
                left = spread.get(k := core_of[c], 0) + sign
                if left:
                    spread[k] = left
                else:
                    del spread[k]
        return self.spread if spread is None else spread


def classify(topology: Topology, cands: Collection[int]
             ) -> tuple[list[int], list[int], list[int]]:
    """One thread of each wholly free core of threads_per_core threads; the threads of wholly
    free cores of fewer online threads; the free threads of partly free cores (pack's classes,
    which the free view carries per cell)."""
    core_of, size, tpc = topology.levels[3], topology.sizes[3], topology.threads_per_core
    by_core: dict[int, list[int]] = {}
    for c in cands:
        by_core.setdefault(core_of[c], []).append(c)
    wide: list[int] = []
    single: list[int] = []
    loose: list[int] = []
    for k, threads in by_core.items():
        if len(threads) < size[k]:
            loose += threads
        elif len(threads) == tpc:
            wide.append(min(threads))
        else:
            single += threads
    return wide, single, loose
