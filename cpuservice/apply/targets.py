"""What systemd must hold for a state: one UnitSpec per unit, for the shared pool's holders and
for each allocation. Pure; memoized by identity (an unchanged allocation keeps its Allocation and
Record objects), so a change costs what it touches, not what exists."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from cpuservice import placement
from cpuservice.apply import partitions, units
from cpuservice.apply.reconcile import UnitSpec
from cpuservice.model import lending
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import Request
from cpuservice.model.state import Record, State
from cpuservice.model.topology import Topology


def own_slice(record: Record) -> bool:
    """Whether the allocation has its own slice (foreign units never start with cpuservice)."""
    return units.is_own(record.unit)


def slice_of(name: str, request: Request) -> str:
    """The slice of an allocation of its own made with ``request``."""
    return units.slice_name(name, request.options.bind, partition_of_request(request),
                            request.options.borrow)


def partition_of_request(request: Request) -> str:
    """The cpuset partition a request's slice is made (``none``: not a partition)."""
    return str(request.options.partition)


def partition_of(a: Allocation) -> str:
    return partition_of_request(a.request)


def partition_mode(a: Allocation, ledger: Ledger) -> str:
    """The partition the allocation's slice is made, on the CPUs it holds (partitions.mode)."""
    return partitions.mode(partition_of(a), set(a.held.ids), set(ledger.isolated.ids))


def follows_shared(a: Allocation, own: bool) -> bool:
    """Whether an allocation's unit properties change with the shared pool."""
    if a.bound:
        return not a.held  # degraded to nothing: it runs on the shared pool
    return a.request.options.memory_nodes or not own


Entry = tuple[Allocation, Record, CPUSet | None, UnitSpec]


@dataclass
class Memo:
    """What Targets.restore() puts back: each name's entry (None: none) and follower flag as
    they were at Targets.memo(), for the names changed since; ``cleared``: the cache was
    emptied meanwhile (entries are memoized by identity: one missing is only computed again)."""

    before: dict[str, tuple[Entry | None, bool]] = field(default_factory=dict)
    cleared: bool = False


class Targets:
    def __init__(self, confine_host: bool, kernel_holders: tuple[str, ...] = ()) -> None:
        self.shared_units = (units.SHARED, *(units.CONFINED if confine_host else ()),
                             *kernel_holders)
        self._cache: dict[str, Entry] = {}
        self._followers: set[str] = set()  # allocations whose unit follows the shared pool
        # since the last memo(): each name's entry and follower flag before it first changed,
        # so that restore() costs what the change touched, not what exists
        self._undo: Memo = Memo()
        # systemd knows CPUSetPartition (>= 261): otherwise a partition recorded earlier (a
        # checkpoint from before a downgrade) is a plain slice: systemd would refuse the property
        self.partitions = True

    def set_partitions(self, known: bool) -> None:
        if known != self.partitions:
            self.partitions = known
            self._cache.clear()
            self._undo.cleared = True

    def specs(self, topology: Topology, state: State, names: Iterable[str]) -> dict[str, UnitSpec]:
        """The shared pool's holders (while a borrower exists, the borrow slice, which holds the
        lent CPUs too) and the named allocations' units."""
        out = {u: UnitSpec(units.shared_props(state.ledger.shared), own=False)
               for u in self.shared_units}
        if state.ledger.borrowers:
            out[units.BORROW] = UnitSpec(units.borrow_props(lending.borrowed(topology, state)),
                                         own=True)
        for name in names:
            if name in state.ledger.allocations:
                record = state.records.get(name, Record())
                out[record.unit] = self.spec(topology, state, name)
        return out

    def shareable(self, topology: Topology, state: State, before: Mapping[str, UnitSpec]
                  ) -> CPUSet:
        """The CPUs the borrow slice may share with their owner while systemd is taken from
        ``before`` to ``state`` (a sync): those ``state`` lends, less any that a unit other
        than its owner's and the shared pool's holders still holds (a restart in the middle
        of a change that gave it to the owner: exclusive as usual until that unit leaves)."""
        owners = lending.lent_by(topology, state)
        pool = {*self.shared_units, units.BORROW}
        others = {c: {u for u, spec in before.items() if u not in pool and c in (spec.cpus or ())}
                  for c in owners}
        return CPUSet(c for c in lending.shareable((topology, state), (topology, state))
                      if others[c] <= {state.records[owners[c]].unit})

    def spec(self, topology: Topology, state: State, name: str) -> UnitSpec:
        a = state.ledger.allocations[name]
        record = state.records.get(name, Record())
        own = own_slice(record)
        follows = follows_shared(a, own)
        shared = state.ledger.shared if follows else None
        hit = self._cache.get(name)
        if hit is not None and hit[0] is a and hit[1] is record and hit[2] == shared:
            return hit[3]
        p = placement.describe(topology, state.ledger, a)
        props = units.allocation_props(p, a.bound, a.request.options.memory_nodes, not own,
                                       partition_mode(a, state.ledger)
                                       if own and self.partitions else partitions.NONE,
                                       bool(a.held))
        if own:
            props = {**props, "Description": (
                "s", units.describe(name, units.description_fields(a, record)))}
        spec = UnitSpec(props, own, {} if own else record.saved, () if own else record.fresh)
        self._keep(name)
        self._cache[name] = (a, record, shared, spec)
        if follows:
            self._followers.add(name)
        else:
            self._followers.discard(name)
        return spec

    def _keep(self, name: str) -> None:
        """Before ``name``'s entry first changes after memo(): remember it."""
        if name not in self._undo.before:
            self._undo.before[name] = (self._cache.get(name), name in self._followers)

    def changed(self, old: State, new: State, touched: AbstractSet[str] | None) -> set[str]:
        """Allocations whose units may differ between two states (``touched``: the ones the
        change is about; None: compare them all)."""
        if touched is None:
            names = {
                n for n in old.ledger.allocations.keys() | new.ledger.allocations.keys()
                if old.ledger.allocations.get(n) is not new.ledger.allocations.get(n)
                or old.records.get(n) is not new.records.get(n)
            }
        else:
            names = set(touched)
        if old.ledger.shared != new.ledger.shared:
            names |= self._followers & new.ledger.allocations.keys()
        return names

    def memo(self) -> Memo:
        """From now on, remember what restore() puts back (the specs known and the followers
        as they are now)."""
        self._undo = Memo()
        return self._undo

    def restore(self, memo: Memo) -> None:
        """Back to ``memo``: a change systemd did not accept leaves nothing of itself here."""
        if memo.cleared:
            self._cache.clear()
        for name, (entry, follows) in memo.before.items():
            if entry is None:
                self._cache.pop(name, None)
            else:
                self._cache[name] = entry
            if follows:
                self._followers.add(name)
            else:
                self._followers.discard(name)
        self._undo = Memo()

    def forget(self, name: str) -> None:
        self._keep(name)
        self._cache.pop(name, None)
        self._followers.discard(name)
