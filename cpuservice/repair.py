"""Repair: bring the ledger in line with a new topology (CPUs offline, online, added, removed).

Lost CPUs are replaced by the nearest free ones the allocation's policy allows; an allocation
that cannot be made whole keeps what it has and is marked degraded; degraded allocations heal
first when CPUs come back. The shared pool never drops below its minimum. Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from .cpuset import CPUSet
from .errors import InsufficientCPUs
from .placement import _bound, _take, take_fragment, take_whole
from .pools import Allocation, Fragment, Ledger
from .topology import Topology


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
    if a.request.options.policy == "full-pcpus" and whole != a.whole:
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
    if request.cpuset is None:
        try:
            whole, fragment = _bound(topology, base, request, a.whole, a.fragment)
            return base.with_allocation(replace(a, whole=whole, fragment=fragment, degraded=False))
        except InsufficientCPUs:
            pass
        whole, fragment = _partial(topology, base, a)
    else:
        whole = a.whole | (request.cpuset & base.takeable)
        fragment = None
    degraded = len(whole) < request.whole or (fragment is None) != (request.fraction == 0)
    return base.with_allocation(replace(a, whole=whole, fragment=fragment, degraded=degraded))


def _partial(topology: Topology, base: Ledger, a: Allocation) -> tuple[CPUSet, Fragment | None]:
    """As many of the missing whole CPUs (and the fragment) as fit within the shared budget."""
    opts = a.request.options
    step = topology.threads_per_core if opts.policy == "full-pcpus" else 1
    budget = base.shared_budget - len(a.held & base.shared)
    whole = a.whole
    for extra in range(a.request.whole - len(whole) - step, 0, -step):
        try:
            more = take_whole(topology, base, opts, extra, whole)
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
        donors = [a for a in ledger.bound.values() if a.whole - ledger.isolated]
        if donors:
            donor = max(donors, key=lambda a: (len(a.whole), a.name))
            movable = donor.whole - ledger.isolated
            kept = _take(topology, movable.ids, len(movable) - 1, frozenset())
            keep = (donor.whole & ledger.isolated) | CPUSet(kept)
            ledger = ledger.with_allocation(replace(donor, whole=keep, degraded=True))
            continue
        cpu = max(ledger.fragment - ledger.isolated, key=lambda c: (-ledger.fragment_pieces[c], c))
        for a in list(ledger.bound.values()):
            if a.fragment and a.fragment.cpu == cpu:
                ledger = ledger.with_allocation(replace(a, fragment=None, degraded=True))
    return ledger
