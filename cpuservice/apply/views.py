"""What callers see of the state: the property values of the Manager and of each Allocation.
Pure; the engine hands them to the bus layer with every event, so the bus keeps no copies."""

from __future__ import annotations

from typing import Any

from cpuservice import placement
from cpuservice.apply import partitions
from cpuservice.apply.units import NO_QUOTA
from cpuservice.model.pools import Ledger
from cpuservice.model.state import Record, State
from cpuservice.model.topology import Topology

# Manager properties that change at runtime, with where they come from; Topology is announced
# as invalidated (a large value), the rest with their values.
MANAGER_CHANGING = ("OnlineCPUs", "IsolatedCPUs", "SharedCPUs", "ExclusiveCPUs", "FragmentCPUs")


def manager(ledger: Ledger) -> dict[str, Any]:
    return {
        "OnlineCPUs": ledger.online.format(),
        "IsolatedCPUs": ledger.isolated.format(),
        "SharedCPUs": ledger.shared.format(),
        "ExclusiveCPUs": ledger.exclusive.format(),
        "FragmentCPUs": ledger.fragment.format(),
    }


def allocation(topology: Topology, state: State, name: str,
               partition: partitions.State | None = None) -> dict[str, Any]:
    """The org.cpuservice1.Allocation properties of one allocation (``partition``: what the
    kernel reports of its slice's cpuset partition, when it asked for one)."""
    a = state.ledger.allocations[name]
    record = state.records.get(name, Record())
    p = placement.describe(topology, state.ledger, a)
    wanted = str(a.request.options.partition)
    made = partitions.mode(wanted, set(a.held.ids), set(state.ledger.isolated.ids))
    return {
        "Name": name, "CPUs": str(a.request.cpus), "Bound": a.bound,
        "CPUSet": p.cpus.format(), "Shares": dict(p.shares),
        "CPUQuotaPerSecUSec": NO_QUOTA if p.cpu_quota_usec is None else p.cpu_quota_usec,
        "CPUWeight": p.cpu_weight, "MemoryNodes": p.memory_nodes.format(),
        "Unit": record.unit, "Owner": record.owner,
        "State": "degraded" if a.degraded or partitions.degraded(made, partition)
        else "active",
        "Lifetime": a.request.options.lifetime,
        **partitions.views(wanted, partition),
    }


def changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in after.items() if before.get(k) != v}
