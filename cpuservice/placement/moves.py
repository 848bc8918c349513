"""Moving a movable allocation (issue 27): which allocations may move, what a move must keep, and
one move made by the engine's own choice code. Pure.

A move keeps the allocation's request (its size and options) and its fragment: a fragment CPU is
shared with other allocations in pieces, and moving a fragment frees no core, so it stays where
it is. Only whole CPUs move: those the move keeps stay, the others are chosen by take_whole (the
one engine, as resize and repair use it) on the ledger without the allocation, near the CPUs it
keeps, never on CPUs the move must leave free. The new CPUs must keep the allocation's quality
(``problems``): no NUMA node it did not use for movable=node and no more nodes for anywhere, no
more L3 groups, no more CPUs away from its devices (option near), no split core for
full-pcpus, no more split cores for packed, no fewer cores for spread-pcpus, no more sharing
with allocations of its exclusive setting; and the shared pool keeps its minimum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from cpuservice.model import near
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import Exclusive, Movable, Partition, Policy
from cpuservice.model.topology import Topology
from cpuservice.placement.whole import take_whole


@dataclass(frozen=True)
class Move:
    """Allocation ``name`` moves from ``old`` to ``new`` (same request and fragment, other whole
    CPUs)."""

    name: str
    old: Allocation
    new: Allocation

    @property
    def cpus(self) -> int:
        """How many CPUs it leaves (and takes)."""
        return len(self.old.whole - self.new.whole)


def movable(a: Allocation) -> bool:
    """Whether ``a`` may be moved: option movable, bound, holding whole CPUs in full, not pinned
    (cpuset) and in no partition."""
    opts = a.request.options
    return (a.bound and opts.movable != Movable.NO and a.request.cpuset is None
            and opts.partition == Partition.NONE and not a.degraded and bool(a.whole))


def may_move(ledger: Ledger, allowed: Callable[[str], bool]) -> dict[str, Allocation]:
    """The allocations of ``ledger`` that may move now (movable, and ``allowed`` by name)."""
    return {n: a for n, a in ledger.bound.items() if movable(a) and allowed(n)}


def problems(topology: Topology, old: Allocation, new: Allocation) -> list[str]:
    """How moving ``old`` to ``new`` would break its request or lower its quality (empty: a
    valid move)."""
    why = []
    if (new.name, new.request, new.fragment, new.degraded, len(new.whole)) != (
            old.name, old.request, old.fragment, old.degraded, len(old.whole)):
        why.append("its request, size or fragment changed")
    _, node_of, l3_of, _ = topology.levels
    nodes_old, nodes_new = ({node_of[c] for c in a.held} for a in (old, new))
    if old.request.options.movable == Movable.NODE and not nodes_new <= nodes_old:
        why.append(f"leaves its NUMA nodes {sorted(nodes_old)}")
    if len(nodes_new) > len(nodes_old):
        why.append(f"spans {len(nodes_new)} NUMA nodes instead of {len(nodes_old)}")
    devices = old.request.devices
    if devices and near.away(topology, devices, new.held) > near.away(topology, devices,
                                                                       old.held):
        why.append("moves CPUs away from its devices (near)")
    l3_old, l3_new = (len({l3_of[c] for c in a.held}) for a in (old, new))
    if l3_new > l3_old:
        why.append(f"spans {l3_new} L3 groups instead of {l3_old}")
    policy = old.request.options.policy
    if policy == Policy.FULL_PCPUS and topology.whole_cores(new.whole) != new.whole:
        why.append("splits a core (full-pcpus)")
    elif policy == Policy.PACKED and split_cores(topology, new.whole) > split_cores(
            topology, old.whole):
        why.append("splits more cores")
    elif policy == Policy.SPREAD_PCPUS and cores(topology, new.whole) < cores(topology, old.whole):
        why.append("runs on fewer cores (spread-pcpus)")
    return why


def cores(topology: Topology, cpus: CPUSet) -> int:
    """How many cores ``cpus`` touch."""
    core_of = topology.levels[3]
    return len({core_of[c] for c in cpus})


def split_cores(topology: Topology, cpus: CPUSet) -> int:
    """Cores of which ``cpus`` hold some threads but not all."""
    return cores(topology, cpus) - cores(topology, topology.whole_cores(cpus))


def keeps(topology: Topology, a: Allocation, vacate: CPUSet) -> list[CPUSet]:
    """What ``a`` may keep when it must leave ``vacate``, most first: the rest of its CPUs
    (not for full-pcpus when that would leave part of a core), the rest of its cores, nothing."""
    core_of = topology.levels[3]
    touched = {core_of[c] for c in vacate}
    out = []
    rest = a.whole - vacate
    if a.request.options.policy != Policy.FULL_PCPUS or topology.whole_cores(rest) == rest:
        out.append(rest)
    out.append(CPUSet(c for c in a.whole if core_of[c] not in touched))
    out.append(EMPTY)
    unique: list[CPUSet] = []
    for keep in out:
        if keep not in unique:
            unique.append(keep)
    return unique


def place(topology: Topology, ledger: Ledger, old: Allocation, keep: CPUSet, hide: CPUSet
          ) -> Allocation | None:
    """``old`` moved: ``keep`` and as many more whole CPUs as it asks for, chosen by take_whole
    on ``ledger`` without the allocation of its name (whatever it holds there now), none of
    ``hide``, its fragment CPU or (movable=node) a CPU outside its NUMA nodes. None when the
    engine finds none, the shared pool would fall below its minimum, or the move would break
    its quality (problems)."""
    opts = old.request.options
    base = ledger.without(old.name) if old.name in ledger.allocations else ledger
    if old.fragment is not None:
        hide = hide | CPUSet((old.fragment.cpu,))
    if opts.movable == Movable.NODE:
        node_of = topology.levels[1]
        nodes = {node_of[c] for c in old.held}
        hide = hide | CPUSet(c for c in base.allocatable if node_of[c] not in nodes)
    try:
        got = take_whole(topology, base, opts, old.request.whole - len(keep), keep, hide)
    except InsufficientCPUs:
        return None
    new = replace(old, whole=keep | got)
    if (len(new.held & base.shared) > base.shared_budget or problems(topology, old, new)
            or sharing(topology, base, new) > sharing(topology, base, old)):
        return None
    return new


def sharing(topology: Topology, ledger: Ledger, a: Allocation) -> int:
    """For exclusive=pcpu (numa): how many CPUs of other allocations of that setting in
    ``ledger`` lie on the cores (NUMA nodes) of ``a`` (a move must not raise it: take_whole
    falls back from numa to pcpu when no node is free of them)."""
    exclusive = a.request.options.exclusive
    if exclusive == Exclusive.NONE:
        return 0
    group = topology.levels[1 if exclusive == Exclusive.NUMA else 3]
    mine = {group[c] for c in a.held}
    return sum(group[c] in mine for b in ledger.bound.values() if b.name != a.name
               and b.request.options.exclusive == exclusive for c in b.held)
