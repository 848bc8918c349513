"""Repair: bring the ledger in line with a new topology (CPUs offline, online, added, removed).

Lost CPUs are replaced by the nearest free ones the allocation's policy allows; an allocation
that cannot be made whole keeps what it has and is marked degraded; degraded allocations heal
first when CPUs come back. The shared pool never drops below its minimum: when it is short,
bound allocations first move onto free isolated CPUs (keeping their size), and only then give
CPUs back (degraded). Exactly: an allocation is left degraded only when the placement engine
cannot place it in full next to the others as repaired (neither around what it keeps nor
afresh). Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs, InvalidArgument
from cpuservice.model.pools import Allocation, Fragment, Ledger
from cpuservice.model.request import Policy
from cpuservice.model.topology import Topology
from cpuservice.placement import bound_cpus, pack, take_fragment, take_whole, whole_core_step


@dataclass(frozen=True)
class Change:
    """What repair did to one allocation."""

    name: str
    lost: CPUSet
    gained: CPUSet
    degraded: bool
    was_degraded: bool

    @property
    def reason(self) -> str:
        parts = []
        if self.lost:
            parts.append(f"lost {self.lost}")
        if self.gained:
            parts.append(f"gained {self.gained}")
        if self.degraded:
            parts.append("degraded")
        elif self.was_degraded:
            parts.append("healed")
        return ", ".join(parts)


def repair(topology: Topology, ledger: Ledger) -> tuple[Ledger, list[Change]]:
    """The ledger on ``topology``'s online set, every allocation on online, unreserved CPUs.

    Also the way to adopt a changed configuration: a CPU that became reserved is treated like one
    that went offline."""
    stripped = ledger.with_online(topology.online, topology.isolated)
    usable = topology.online - ledger.reserved
    allocations = dict(stripped.allocations)
    todo = []
    for name, a in allocations.items():
        if not a.bound:
            continue
        kept = _strip(topology, a, usable)
        if kept != a or a.degraded:
            allocations[name] = kept
            todo.append(name)
    current = replace(stripped, allocations=MappingProxyType(allocations))
    todo.sort(key=lambda n: (not ledger.allocations[n].degraded, n))
    for name in todo:
        current = _regrow(topology, current, current.allocations[name])
    current = _restore_shared_minimum(topology, current)
    current = _heal(topology, current)
    changes = []
    for name, new in sorted(current.allocations.items()):
        old = ledger.allocations[name]
        if new != old:
            changes.append(
                Change(name, old.held - new.held, new.held - old.held, new.degraded, old.degraded)
            )
    return current, changes


def _strip(topology: Topology, a: Allocation, usable: CPUSet) -> Allocation:
    """``a`` without the CPUs it may no longer hold (whole cores only for full-pcpus)."""
    whole = a.whole & usable
    if a.request.options.policy == Policy.FULL_PCPUS and whole != a.whole:
        core = topology.levels[3]
        counts: dict[int, int] = {}
        for c in whole:
            counts[core[c]] = counts.get(core[c], 0) + 1
        whole = CPUSet(c for c in whole if counts[core[c]] == topology.core_size[core[c]])
    fragment = a.fragment if a.fragment and a.fragment.cpu in usable else None
    return replace(a, whole=whole, fragment=fragment)


def _regrow(topology: Topology, ledger: Ledger, a: Allocation) -> Ledger:
    """Give ``a`` back its full size near what it holds, or as much as fits (degraded)."""
    base = ledger.without(a.name)
    request = a.request
    placed = _place(topology, base, a)
    if placed is not None:
        return placed
    if request.cpuset is None:
        whole, fragment = _partial(topology, base, a)
    else:
        whole = a.whole | (request.cpuset & base.takeable)
        fragment = None
    degraded = len(whole) < request.whole or (fragment is None) != (request.fraction == 0)
    return base.with_allocation(replace(a, whole=whole, fragment=fragment, degraded=degraded))


def _place(topology: Topology, base: Ledger, a: Allocation) -> Ledger | None:
    """``base`` with ``a`` placed in full (not degraded): around what it holds, else afresh
    (anywhere it fits); None when neither fits."""
    attempts = [(a.whole, a.fragment)]
    if a.request.cpuset is None and (a.whole or a.fragment):
        attempts.append((CPUSet(), None))
    for keep, keep_fragment in attempts:
        try:
            whole, fragment = bound_cpus(topology, base, a.request, keep, keep_fragment)
        except (InsufficientCPUs, InvalidArgument):
            continue
        return base.with_allocation(replace(a, whole=whole, fragment=fragment, degraded=False))
    return None


def _heal(topology: Topology, ledger: Ledger) -> Ledger:
    """Place in full every degraded allocation that fits now (e.g. afresh, or once another one
    healed by moving), until none does: what stays degraded cannot be placed in full."""
    healed = True
    while healed:
        healed = False
        for name in sorted(n for n, a in ledger.bound.items() if a.degraded):
            placed = _place(topology, ledger.without(name), ledger.allocations[name])
            if placed is not None:
                ledger, healed = placed, True
    return ledger


def _partial(topology: Topology, base: Ledger, a: Allocation) -> tuple[CPUSet, Fragment | None]:
    """As many of the missing whole CPUs (and the fragment) as fit within the shared budget."""
    opts = a.request.options
    step = whole_core_step(topology) if opts.policy == Policy.FULL_PCPUS else 1
    budget = base.shared_budget - len(a.held & base.shared)
    whole = a.whole
    # the fragment it keeps is no candidate for its whole CPUs (never whole and fragment both)
    view = base.with_allocation(replace(a, whole=CPUSet())) if a.fragment else base
    for extra in range(a.request.whole - len(whole) - step, 0, -step):
        try:
            more = take_whole(topology, view, opts, extra, whole)
        except InsufficientCPUs:
            continue
        if len(more & base.shared) <= budget:
            budget -= len(more & base.shared)
            whole = whole | more
            break
    fragment = a.fragment
    pieces = int(a.request.fraction * base.granularity)
    if pieces and fragment is None:
        try:
            candidate = take_fragment(topology, base, opts, pieces, whole)
            if candidate.cpu not in base.shared or budget > 0:
                fragment = candidate
        except InsufficientCPUs:
            pass
    return whole, fragment


def _restore_shared_minimum(topology: Topology, ledger: Ledger) -> Ledger:
    """Take CPUs back from bound allocations while the shared pool is below its minimum."""
    need = min(ledger.min_shared_cpus, len(ledger.online - ledger.isolated))
    while len(ledger.shared) < need:
        moved = _move_to_isolated(topology, ledger)
        if moved is not None:
            ledger = moved
            continue
        donors = [a for a in ledger.bound.values() if a.whole - ledger.isolated]
        if donors:
            donor = max(donors, key=lambda a: (len(a.whole), a.name))
            movable = donor.whole - ledger.isolated
            kept = pack(topology, movable.ids, len(movable) - 1)
            keep = (donor.whole & ledger.isolated) | CPUSet(kept)
            ledger = ledger.with_allocation(replace(donor, whole=keep, degraded=True))
            continue
        cpu = max(ledger.fragment - ledger.isolated, key=lambda c: (-ledger.fragment_pieces[c], c))
        for a in list(ledger.bound.values()):
            if a.fragment and a.fragment.cpu == cpu:
                ledger = ledger.with_allocation(replace(a, fragment=None, degraded=True))
    return ledger


def _move_to_isolated(topology: Topology, ledger: Ledger) -> Ledger | None:
    """One bound allocation moved from shared-eligible CPUs onto free isolated ones, keeping
    its size: ``step`` whole CPUs (a whole core for full-pcpus) swapped for as many free
    isolated CPUs its options allow, else its fragment moved off a CPU it alone holds. None
    when no allocation can move (pinned ``cpuset`` allocations never do)."""
    if not ledger.free_isolated:
        return None
    for a in sorted(ledger.bound.values(), key=lambda a: (-len(a.whole), a.name)):
        if a.request.cpuset is not None:
            continue
        opts = a.request.options
        full = opts.policy == Policy.FULL_PCPUS
        step = whole_core_step(topology) if full else 1
        movable = a.whole - ledger.isolated
        if len(movable) >= step:
            try:
                kept = CPUSet(pack(topology, movable.ids, len(movable) - step, strict=full))
                keep = (a.whole & ledger.isolated) | kept
                more = take_whole(topology, _no_budget(ledger, replace(a, whole=keep)), opts,
                                  len(a.whole) - len(keep), keep)
            except InsufficientCPUs:
                more = None
            if more is not None and more <= ledger.free_isolated:
                return ledger.with_allocation(replace(a, whole=keep | more))
        f = a.fragment
        if f and f.cpu not in ledger.isolated and ledger.fragment_pieces[f.cpu] == f.pieces:
            view = _no_budget(ledger, replace(a, fragment=None))
            try:
                new = take_fragment(topology, view, opts, f.pieces, a.whole)
            except InsufficientCPUs:
                continue
            if new.cpu not in view.shared:
                return ledger.with_allocation(replace(a, fragment=new))
    return None


def _no_budget(ledger: Ledger, a: Allocation) -> Ledger:
    """``ledger`` with ``a`` in it and no CPU left to take from the shared pool (so only free
    isolated CPUs and existing fragment CPUs are takeable)."""
    view = ledger.with_allocation(a)
    return replace(view, min_shared_cpus=len(view.shared))
