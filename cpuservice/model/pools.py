"""The ledger: who holds which CPUs, and the pools that follow from it.

Pools: online; reserved (configured, part of shared, never allocated); isolated (kernel isolcpus:
never shared, bound allocations only); exclusive (whole CPUs of one bound allocation); fragment
(CPUs split in pieces between bound allocations); shared = online - exclusive - fragment - isolated.
The ledger is an immutable value: every change returns a new one.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.freeview import FreeView
from cpuservice.model.keep import NO_KEEP, Keep
from cpuservice.model.layered import layered
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology

GRANULARITIES = (100, 1000)


@dataclass(frozen=True)
class Fragment:
    """``pieces`` of ``cpu``, out of the ledger's granularity."""

    cpu: int
    pieces: int


@dataclass(frozen=True)
class Allocation:
    """One named allocation. Unbound ones hold nothing: they run on the shared pool."""

    name: str
    request: Request
    whole: CPUSet = EMPTY
    fragment: Fragment | None = None
    degraded: bool = False

    @property
    def bound(self) -> bool:
        return self.request.options.bind

    @property
    def held(self) -> CPUSet:
        """Every CPU this allocation runs on exclusively or in pieces."""
        return self.whole | CPUSet((self.fragment.cpu,)) if self.fragment else self.whole


class InvariantError(AssertionError):
    """The ledger broke one of its invariants (a bug, never a caller's fault)."""


@dataclass(frozen=True)
class Ledger:
    online: CPUSet
    reserved: CPUSet = EMPTY
    isolated: CPUSet = EMPTY
    granularity: int = 100
    min_shared_cpus: int = 1
    allocations: Mapping[str, Allocation] = field(default_factory=lambda: MappingProxyType({}))
    bound: Mapping[str, Allocation] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )
    keep: Keep = NO_KEEP  # cores kept next to devices for their users (cpuservice.model.keep)

    def __post_init__(self) -> None:
        """``bound`` (the bound allocations) is derived; with_allocation/without keep it up to
        date in O(bound) so that a thousand unbound allocations cost the pools nothing."""
        if len(self.bound) > len(self.allocations) or any(
            self.allocations.get(n) is not a for n, a in self.bound.items()
        ) or sum(a.bound for a in self.allocations.values()) != len(self.bound):
            bound = {n: a for n, a in self.allocations.items() if a.bound}
            object.__setattr__(self, "bound", MappingProxyType(bound))

    @cached_property
    def exclusive(self) -> CPUSet:
        return CPUSet.union_all(a.whole for a in self.bound.values())

    @cached_property
    def borrowers(self) -> int:
        """How many allocations borrow (option borrow): the borrow slice exists while one does.
        Carried from ledger to ledger (with_allocation, without) like the pools."""
        return sum(1 for a in self.allocations.values() if a.request.options.borrow)

    @cached_property
    def fragment_pieces(self) -> dict[int, int]:
        """Fragment CPU -> pieces used on it."""
        used: dict[int, int] = {}
        for a in self.bound.values():
            if a.fragment:
                used[a.fragment.cpu] = used.get(a.fragment.cpu, 0) + a.fragment.pieces
        return used

    @cached_property
    def fragment(self) -> CPUSet:
        return CPUSet(self.fragment_pieces)

    @cached_property
    def held(self) -> CPUSet:
        return self.exclusive | self.fragment

    @cached_property
    def shared(self) -> CPUSet:
        return self.online - self.held - self.isolated

    @cached_property
    def free_isolated(self) -> CPUSet:
        """Isolated CPUs no allocation holds and none reserved (a reserved CPU is never
        allocated, isolated or not)."""
        return (self.isolated & self.online) - self.held - self.reserved

    @cached_property
    def allocatable(self) -> CPUSet:
        """CPUs a bound allocation may take whole: shared minus reserved, plus free isolated."""
        return (self.shared - self.reserved) | self.free_isolated

    @property
    def takeable(self) -> CPUSet:
        """Allocatable CPUs, less the shared ones when the shared pool is at its minimum."""
        return self.allocatable if self.shared_budget else self.free_isolated

    @property
    def shared_budget(self) -> int:
        """How many CPUs may still leave the shared pool."""
        return max(0, len(self.shared) - self.min_shared_cpus)

    def free_pieces(self, cpu: int) -> int:
        return self.granularity - self.fragment_pieces.get(cpu, 0)

    def free_view(self, topology: Topology) -> FreeView:
        """The allocatable CPUs per NUMA node of ``topology`` (FreeView): carried over from the
        ledger this one was made from when that had one, else derived once."""
        view: FreeView | None = self.__dict__.get("_free_view")
        if view is None or view.topology is not topology:
            _ = self.exclusive, self.fragment_pieces  # so that _with carries them, and the view
            view = self.__dict__["_free_view"] = FreeView.build(topology, self)
        return view

    def owner_of(self, cpu: int) -> list[str]:
        """Names of the allocations holding ``cpu``."""
        return sorted(a.name for a in self.bound.values() if cpu in a.held)

    def with_allocation(self, allocation: Allocation) -> Ledger:
        allocations = layered(self.allocations)  # (_copy, one call less: on every change)
        before = allocations.get(allocation.name)
        allocations[allocation.name] = allocation
        bound = layered(self.bound)
        gone = bound.pop(allocation.name, None)
        options = allocation.request.options
        if options.bind:
            bound[allocation.name] = allocation
        borrows = options.borrow - (before is not None and before.request.options.borrow)
        return self._with(allocations, bound, gone, allocation if options.bind else None,
                          borrows)

    def with_allocations(self, changed: list[Allocation]) -> Ledger:
        """with_allocation of each of ``changed`` (distinct names) in turn, as one change: the
        mappings copied once, the exclusive CPUs, fragment pieces and borrowers carried over
        as _with carries them, the free view derived again with its spread cores carried
        (re-packing changes hundreds of allocations at once on 1,024 CPUs: a copy of the
        mappings and of the view per allocation was most of a search)."""
        if len(changed) == 1:
            return self.with_allocation(changed[0])
        allocations = _copy(self.allocations)
        bound = _copy(self.bound)
        known = self.__dict__
        new = Ledger.__new__(Ledger)
        new.__dict__.update(
            online=known["online"], reserved=known["reserved"], isolated=known["isolated"],
            granularity=known["granularity"], min_shared_cpus=known["min_shared_cpus"],
            allocations=MappingProxyType(allocations), bound=MappingProxyType(bound),
            keep=known["keep"])
        gone: list[Allocation] = []
        added: list[Allocation] = []
        steps: list[tuple[Allocation, int]] = []  # in the order with_allocation would take
        borrowers = 0
        for a in changed:
            before = allocations.get(a.name)
            allocations[a.name] = a
            old = bound.pop(a.name, None)
            if old is not None:
                gone.append(old)
                steps.append((old, -1))
            if a.bound:
                bound[a.name] = a
                added.append(a)
                steps.append((a, 1))
            borrowers += _borrows(a) - _borrows(before)
        if "borrowers" in known:
            new.__dict__["borrowers"] = known["borrowers"] + borrowers
        if "exclusive" in known:  # whole CPUs never overlap: take the old ones, add the new
            new.__dict__["exclusive"] = (known["exclusive"] - CPUSet.union_all(
                a.whole for a in gone)) | CPUSet.union_all(a.whole for a in added)
        if "fragment_pieces" in known:
            pieces = known["fragment_pieces"]
            if any(a.fragment for a, _ in steps):
                pieces = dict(pieces)
                for a, sign in steps:
                    if a.fragment:
                        left = pieces.get(a.fragment.cpu, 0) + sign * a.fragment.pieces
                        if left:
                            pieces[a.fragment.cpu] = left
                        else:
                            pieces.pop(a.fragment.cpu, None)
            elif "fragment" in known:
                new.__dict__["fragment"] = known["fragment"]
            new.__dict__["fragment_pieces"] = pieces
        view: FreeView | None = known.get("_free_view")
        if view is not None and "exclusive" in new.__dict__ and "fragment_pieces" in new.__dict__:
            new.__dict__["_free_view"] = view.again(new, steps)
        return new

    def without(self, name: str) -> Ledger:
        allocations = _copy(self.allocations)
        before = allocations.pop(name)
        bound = _copy(self.bound)
        gone = bound.pop(name, None)
        return self._with(allocations, bound, gone, None, -_borrows(before))

    def _with(self, allocations: MutableMapping[str, Allocation],
              bound: MutableMapping[str, Allocation],
              gone: Allocation | None, added: Allocation | None, borrowers: int = 0) -> Ledger:
        """A ledger with other allocations; the pools this one has computed are carried over,
        less what ``gone`` held and plus what ``added`` holds (bound allocations; whole CPUs
        never overlap), instead of being derived again from every allocation; ``borrowers``:
        how many more borrow."""
        new = Ledger.__new__(Ledger)
        known = self.__dict__
        carried = new.__dict__
        carried.update(  # the fields, as a frozen dataclass keeps them
            online=known["online"], reserved=known["reserved"], isolated=known["isolated"],
            granularity=known["granularity"], min_shared_cpus=known["min_shared_cpus"],
            allocations=MappingProxyType(allocations), bound=MappingProxyType(bound),
            keep=known["keep"])
        if "borrowers" in known:
            carried["borrowers"] = known["borrowers"] + borrowers
        if "exclusive" in known:
            exclusive = known["exclusive"]
            if gone is not None and gone.whole:
                exclusive = exclusive - gone.whole
            if added is not None and added.whole:
                exclusive = exclusive | added.whole
            carried["exclusive"] = exclusive
        moved = (gone is not None and gone.fragment) or (added is not None and added.fragment)
        if "fragment_pieces" in known and not moved:
            carried["fragment_pieces"] = known["fragment_pieces"]
            if "fragment" in known:
                carried["fragment"] = known["fragment"]
        elif "fragment_pieces" in known:
            pieces = dict(known["fragment_pieces"])
            for a, sign in ((gone, -1), (added, 1)):
                if a is not None and a.fragment:
                    left = pieces.get(a.fragment.cpu, 0) + sign * a.fragment.pieces
                    if left:
                        pieces[a.fragment.cpu] = left
                    else:
                        pieces.pop(a.fragment.cpu, None)
            carried["fragment_pieces"] = pieces
        view: FreeView | None = known.get("_free_view")
        if view is not None and "exclusive" in carried and "fragment_pieces" in carried:
            if gone is not None and not gone.request.options.bind:  # (Allocation.bound)
                gone = None
            if added is not None and not added.request.options.bind:
                added = None
            carried["_free_view"] = (view.after(self, new, gone, added)
                                     if gone is not None or added is not None else view)
        return new

    def with_online(self, online: CPUSet, isolated: CPUSet | None = None) -> Ledger:
        """The same allocations on another online set; callers repair what that breaks."""
        if isolated is None:
            isolated = self.isolated
        return replace(self, online=online, isolated=isolated)


def _borrows(a: Allocation | None) -> int:
    return int(a is not None and a.request.options.borrow)


def _copy(mapping: Mapping[str, Allocation]) -> MutableMapping[str, Allocation]:
    """A copy of ``mapping`` to change (cpuservice.model.layered.layered: the allocations are
    copied on every change; past a thousand, a copy costs what changed since its base)."""
    return layered(mapping)


def check_index(ledger: Ledger) -> None:
    """The bound index lists exactly the bound allocations, and unbound ones hold nothing
    (O(all allocations): the tests' check, where check_invariants looks at bound ones only)."""
    bound = {n: a for n, a in ledger.allocations.items() if a.bound}
    if dict(ledger.bound) != bound:
        raise InvariantError("the index of bound allocations does not match the allocations")
    for a in ledger.allocations.values():
        if not a.bound and a.held:
            raise InvariantError(f"unbound allocation {a.name!r} holds CPUs {a.held}")
    fresh = Ledger(ledger.online, ledger.reserved, ledger.isolated, ledger.granularity,
                   ledger.min_shared_cpus, ledger.allocations)
    if (ledger.exclusive, ledger.fragment_pieces) != (fresh.exclusive, fresh.fragment_pieces):
        raise InvariantError("the pools carried over from an earlier ledger are not those of "
                             "its allocations")


def _allocations_hold_well(ledger: Ledger) -> bool:
    """Whether no bound allocation breaks an invariant of its own (_allocation_problems finds
    none): every whole CPU held once, all online, fragments of a valid size. The same facts in
    a few set operations over all of them (check_invariants runs on every change)."""
    online = ledger.online.ids
    granularity = ledger.granularity
    wholes = [a.whole.ids for a in ledger.bound.values()]
    union = frozenset().union(*wholes)
    if sum(map(len, wholes)) != len(union) or not union <= online:
        return False
    return all(f.cpu in online and 0 < f.pieces < granularity
               for a in ledger.bound.values() if (f := a.fragment) is not None)


def _allocation_problems(ledger: Ledger) -> list[str]:
    """What each bound allocation breaks on its own, named (O(bound) CPU by CPU)."""
    problems: list[str] = []
    seen: dict[int, str] = {}
    for a in ledger.bound.values():
        for cpu in a.whole:
            if cpu in seen:
                problems.append(f"CPU {cpu} is exclusive to both {seen[cpu]!r} and {a.name!r}")
            seen[cpu] = a.name
        offline = a.held - ledger.online
        if offline:
            problems.append(f"allocation {a.name!r} holds offline CPUs {offline}")
        if a.fragment and not 0 < a.fragment.pieces < ledger.granularity:
            problems.append(f"allocation {a.name!r} has a fragment of {a.fragment.pieces} pieces")
    return problems


def check_invariants(ledger: Ledger) -> None:
    """Raise InvariantError naming every broken invariant of the pools (cost: O(bound))."""
    problems = [] if _allocations_hold_well(ledger) else _allocation_problems(ledger)
    overlap = ledger.exclusive & ledger.fragment
    if overlap:
        problems.append(f"CPUs {overlap} are both exclusive and fragment")
    for cpu, pieces in ledger.fragment_pieces.items():
        if pieces > ledger.granularity:
            problems.append(f"fragment CPU {cpu} has {pieces} > {ledger.granularity} pieces")
    if ledger.held & ledger.reserved:
        problems.append(f"reserved CPUs {ledger.held & ledger.reserved} are allocated")
    if not ledger.shared >= (ledger.reserved & ledger.online) - ledger.isolated:
        problems.append("the shared pool does not contain every online reserved CPU")
    if len(ledger.shared) < min(ledger.min_shared_cpus, len(ledger.online - ledger.isolated)):
        problems.append(f"shared pool {ledger.shared} is smaller than {ledger.min_shared_cpus}")
    # (an isolated CPU that is reserved is in none of the pools but itself: never shared,
    # never allocated)
    kept = (ledger.reserved & ledger.isolated & ledger.online) - ledger.held
    parts = (ledger.shared, ledger.exclusive, ledger.fragment, ledger.free_isolated, kept)
    if sum(map(len, parts)) != len(ledger.online) or CPUSet.union_all(parts) != ledger.online:
        problems.append("shared, exclusive, fragment, free isolated and reserved isolated do "
                        "not partition online")
    if problems:
        raise InvariantError("; ".join(problems))
