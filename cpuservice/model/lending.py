"""Lending idle exclusive CPUs (issue 26), pure: which CPUs a bound allocation may lend (option
``lend``), which it lends now, which CPUs the borrow slice may share with their owner while a
change is applied. The controller that decides, core by core, when they are lent and when they
are withdrawn is cpuservice.model.lending_control.

What is lent goes to ``cpuservice-borrow.slice`` (CPUWeight=idle), whose AllowedCPUs is the
shared pool plus every CPU lent now; unbound allocations with option ``borrow`` run below it. The
scheduler gives a waking task of the owner its CPU at once (a cgroup with cpu.idle=1 never
delays a non-idle one); the allocation level takes the CPUs back when the owner stays busy.

Only whole cores are lent: every online thread of the core is a whole CPU of the allocation.
Never a fragment CPU (shared in pieces), never a partition's CPUs (the kernel keeps every other
cgroup off them), never a kernel-isolated CPU (isolcpus: the scheduler would not balance a
borrower onto it), never a degraded allocation's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.pools import Allocation
from cpuservice.model.request import Partition
from cpuservice.model.state import Record, State, copy_records
from cpuservice.model.topology import Topology


def lendable(topology: Topology, allocation: Allocation) -> CPUSet:
    """The CPUs ``allocation`` may lend now: its whole CPUs that form whole cores (every
    online thread of the core is one of them); none when it does not lend, is a partition or
    is degraded."""
    opts = allocation.request.options
    if (not opts.lend or not allocation.bound or opts.partition != Partition.NONE
            or allocation.degraded):
        return EMPTY
    whole = allocation.whole - topology.isolated
    out = []
    for cpu in whole:
        if cpu not in topology.cpus:
            continue
        core = topology.siblings(cpu)
        if cpu in core and core <= whole:
            out.append(cpu)
    return CPUSet(out)


def lent(topology: Topology, state: State, name: str) -> CPUSet:
    """The CPUs allocation ``name`` lends now: what its record says it lent, within what it
    may lend now (a Resize, a move or a repair that took CPUs away needs no special case)."""
    record = state.records.get(name)
    a = state.ledger.allocations.get(name)
    if record is None or a is None or not record.lent:
        return EMPTY
    return record.lent & lendable(topology, a)


def lenders(state: State) -> list[str]:
    """The allocations that lend or may lend (option lend), by name."""
    return sorted(n for n, a in state.ledger.bound.items() if a.request.options.lend)


def lent_by(topology: Topology, state: State) -> dict[int, str]:
    """Every CPU lent now -> the allocation that lends it (O(bound allocations), as the
    ledger's own checks: a change costs what is bound, not every unbound allocation)."""
    out: dict[int, str] = {}
    for name, a in state.ledger.bound.items():
        record = state.records.get(name)
        if record is not None and record.lent and a.request.options.lend:
            out.update(dict.fromkeys(record.lent & lendable(topology, a), name))
    return out


def all_lent(topology: Topology, state: State) -> CPUSet:
    """Every CPU lent now (the borrow slice has them besides the shared pool)."""
    return CPUSet(lent_by(topology, state))


def borrowed(topology: Topology, state: State) -> CPUSet:
    """The CPUs a borrower may run on: the shared pool and every CPU lent now."""
    return state.ledger.shared | all_lent(topology, state)


def shareable(before: tuple[Topology, State], after: tuple[Topology, State]) -> CPUSet:
    """The exclusive CPUs the borrow slice may hold together with their owner's unit while a
    change is applied: lent before or after it, and held by no other allocation on either
    side (a CPU lent before and given to another allocation after is exclusive as usual: the
    borrow slice gives it up first)."""
    was, now = lent_by(*before), lent_by(*after)
    out = []
    for cpu in was.keys() | now.keys():
        owner = was.get(cpu) or now[cpu]
        if all(_only(state, cpu, owner) for _, state in (before, after)):
            out.append(cpu)
    return CPUSet(out)


def _only(state: State, cpu: int, owner: str) -> bool:
    """Whether ``cpu`` is no whole CPU of another allocation than ``owner`` in ``state``."""
    if cpu not in state.ledger.exclusive:
        return True
    a = state.ledger.allocations.get(owner)
    return a is not None and cpu in a.whole


def with_lent(state: State, lent_now: Mapping[str, CPUSet]) -> State:
    """``state`` with these allocations' records saying they lend these CPUs (empty: none)."""
    records = copy_records(state.records)
    for name, cpus in lent_now.items():
        records[name] = replace(records.get(name, Record()), lent=cpus)
    return State(state.ledger, records)
