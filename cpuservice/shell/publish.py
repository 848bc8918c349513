"""What a committed change tells the bus: the events, with their values, for what changed. Pure
apart from calling the sinks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from cpuservice.apply import partitions, views
from cpuservice.model import lending
from cpuservice.model.state import State
from cpuservice.model.topology import Topology
from cpuservice.shell.ports import Events

MOVED = "moved"  # the reason of an allocation a change moved to other CPUs (AllocationMoved)

# a side of a change: the state, the topology, what the kernel reports of partitions
Side = tuple[State, Topology, Mapping[str, partitions.State | None]]


def publish(events: Events, forget: Callable[[str], None], before: Side, after: Side,
            changed: set[str], reasons: Mapping[str, str],
            strain: Mapping[str, tuple[str, ...]] = MappingProxyType({})) -> None:
    """Events for what changed between two sides of a change. An unbound allocation's CPUSet is
    the shared pool: it is announced once, by SharedCPUs and PoolsChanged, not per
    allocation. ``forget``: told each allocation that is gone; ``strain``: the health reasons
    of the allocations' figures now (the same on both sides: a change does not alter them)."""
    old, old_topology, old_reports = before
    new, topology, reports = after
    was_in, now_in = old.ledger.allocations, new.ledger.allocations
    for name in sorted(changed | reasons.keys()):
        if name not in now_in:
            forget(name)
            events.allocation_removed(name)
        elif name not in was_in:
            events.allocation_added(name, views.allocation(topology, new, name,
                                                           reports.get(name), strain.get(name, ())))
        elif was_in[name] is not now_in[name] or name in reasons or (
            new.records.get(name) is not old.records.get(name)
        ):
            mine = strain.get(name, ())
            diff = views.changed(views.allocation(old_topology, old, name, old_reports.get(name),
                                                  mine),
                                 views.allocation(topology, new, name, reports.get(name), mine))
            reason = reasons.get(name, "changed")
            if reason == MOVED and was_in[name].held != now_in[name].held:
                events.allocation_moved(name, was_in[name].held.format(),
                                        now_in[name].held.format())
            events.allocation_changed(name, reason, diff)
    was, now = old.ledger, new.ledger
    if (was.shared, was.exclusive, was.fragment) != (now.shared, now.exclusive, now.fragment):
        events.pools_changed(now.shared.format(), now.exclusive.format(), now.fragment.format())
    manager = views.changed(views.manager(was, lending.all_lent(old_topology, old)),
                            views.manager(now, lending.all_lent(topology, new)))
    invalidated = ["Topology"] if topology != old_topology else []
    if manager or invalidated:
        events.manager_changed(manager, invalidated)
