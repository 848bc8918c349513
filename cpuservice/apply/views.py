"""What callers see of the state: the property values of the Manager and of each Allocation.
Pure; the engine hands them to the bus layer with every event, so the bus keeps no copies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpuservice import placement
from cpuservice.apply import partitions
from cpuservice.apply.units import NO_QUOTA
from cpuservice.model import device_irqs as device_irq_plan
from cpuservice.model import lending, near
from cpuservice.model.alignment import misalignment
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.health import describe
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.state import Record, State
from cpuservice.model.topology import Topology

# Manager properties that change at runtime, with where they come from; Topology is announced
# as invalidated (a large value), the rest with their values.
MANAGER_CHANGING = ("OnlineCPUs", "IsolatedCPUs", "SharedCPUs", "ExclusiveCPUs", "FragmentCPUs",
                    "LentCPUs")


def device_irqs(topology: Topology, state: State, reports: Mapping[str, Any] | None
                ) -> list[dict[str, tuple[str, Any]]]:
    """The IRQIsolation property's ``devices`` (option near-irqs): for each PCI function whose
    interrupts are kept, where they are planned (its node's shared CPUs, or the whole pool and
    why) and what the last write did (``reports``: address -> cpuservice.host.irqs.DeviceReport,
    none before the first write)."""
    out = []
    plans = device_irq_plan.plan(topology, state.ledger.bound, state.ledger.shared)
    for p in plans.values():
        done = (reports or {}).get(p.address)
        out.append({
            "address": ("s", p.address), "node": ("i", p.node), "cpus": ("s", p.cpus.format()),
            "local": ("b", p.local), "why": ("s", p.why), "allocations": ("as", list(p.names)),
            "written": ("s", done.cpus.format() if done is not None else ""),
            "confined": ("au", list(done.confined) if done is not None else []),
            "unmovable": ("au", list(done.unmovable) if done is not None else []),
            "pending": ("au", list(done.pending) if done is not None else []),
        })
    return out


def manager(ledger: Ledger, lent: CPUSet = EMPTY) -> dict[str, Any]:
    """The Manager's changing properties (``lent``: the CPUs lent now, lending.all_lent)."""
    return {
        "OnlineCPUs": ledger.online.format(),
        "IsolatedCPUs": ledger.isolated.format(),
        "SharedCPUs": ledger.shared.format(),
        "ExclusiveCPUs": ledger.exclusive.format(),
        "FragmentCPUs": ledger.fragment.format(),
        "LentCPUs": lent.format(),
    }


# the last views made, by the identity of the state and topology they were made of (both are
# replaced, never changed): a change's events, its audit entry and the bus's reads ask for the
# same view; at most _RECENT_MAX
_recent: dict[tuple[int, int, str], tuple[Topology, State, Any, tuple[str, ...],
                                          dict[str, Any]]] = {}
_RECENT_MAX = 32


def allocation(topology: Topology, state: State, name: str,
               partition: partitions.State | None = None,
               strain: tuple[str, ...] = ()) -> dict[str, Any]:
    """The org.cpuservice1.Allocation properties of one allocation (``partition``: what the
    kernel reports of its slice's cpuset partition, when it asked for one; ``strain``: the
    health reasons its figures raised, cpuservice.model.health: Health only, not State)."""
    key = (id(topology), id(state), name)
    hit = _recent.get(key)
    if hit is not None and hit[0] is topology and hit[1] is state and hit[2] == partition \
            and hit[3] == strain:
        return dict(hit[4])
    out = _allocation(topology, state, name, partition, strain)
    if len(_recent) >= _RECENT_MAX:
        _recent.clear()
    _recent[key] = (topology, state, partition, strain, out)
    return dict(out)


def _allocation(topology: Topology, state: State, name: str,
                partition: partitions.State | None, strain: tuple[str, ...]) -> dict[str, Any]:
    a = state.ledger.allocations[name]
    record = state.records.get(name, Record())
    p = placement.describe(topology, state.ledger, a)
    wanted = str(a.request.options.partition)
    made = partitions.mode(wanted, set(a.held.ids), set(state.ledger.isolated.ids))
    health = "; ".join(filter(None, (short(a, state.ledger.granularity),
                                     partitions.degraded(made, partition), missing(record))))
    why = misalignment(topology, a)
    opts = a.request.options
    # a borrower runs on the shared pool and on every CPU lent now
    cpus = lending.borrowed(topology, state) if opts.borrow else p.cpus
    return {
        "Name": name, "CPUs": str(a.request.cpus), "Bound": a.bound,
        "CPUSet": cpus.format(), "Shares": dict(p.shares),
        "CPUQuotaPerSecUSec": NO_QUOTA if p.cpu_quota_usec is None else p.cpu_quota_usec,
        "CPUWeight": p.cpu_weight, "MemoryNodes": p.memory_nodes.format(),
        "Unit": record.unit, "Owner": record.owner,
        "State": "degraded" if health else "active",
        "Health": "degraded" if health or strain else "ok",
        "HealthReason": "; ".join(filter(None, (health, describe(strain)))),
        "Aligned": not why, "AlignmentReason": "; ".join(why),
        "Lifetime": a.request.options.lifetime,
        "Movable": str(opts.movable),
        "Lending": opts.lend, "LentCPUs": lending.lent(topology, state, name).format(),
        "NearDevices": near.views(topology, a.request.devices),
        "NearPolicy": str(opts.near_policy) if opts.near is not None else "",
        **partitions.views(wanted, partition),
    }


def short(a: Allocation, granularity: int) -> str:
    """Why a repaired allocation is degraded: what it holds of what it asked for."""
    if not a.degraded:
        return ""
    if not a.held:
        return f"holds none of its {a.request.cpus} CPUs (runs on the shared pool)"
    pieces = len(a.whole) * granularity + (a.fragment.pieces if a.fragment else 0)
    has = f"{pieces / granularity:g}"
    return f"holds {has} of {a.request.cpus} CPUs (no room to place it in full)"


def missing(record: Record) -> str:
    """Why an allocation of option near is degraded: devices no longer there."""
    if not record.gone:
        return ""
    return (f"device {', '.join(record.gone)} not found (it keeps the CPUs next to where it "
            "was)")


def changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in after.items() if before.get(k) != v}
