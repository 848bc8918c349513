"""What a committed change tells the bus: the events, with their values, for what changed
(``events``, pure: the engine derives them while systemd applies the change), and their
delivery to the sinks (``deliver``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from cpuservice.apply import partitions, views
from cpuservice.model import lending
from cpuservice.model.state import State
from cpuservice.model.topology import Topology
from cpuservice.shell.ports import Event, Events, Kind
from cpuservice.shell.ports import deliver as deliver_one

log = logging.getLogger(__name__)
MOVED = "moved"  # the reason of an allocation a change moved to other CPUs (AllocationMoved)

# a side of a change: the state, the topology, what the kernel reports of partitions
Side = tuple[State, Topology, Mapping[str, partitions.State | None]]


def publish(events: Events, forget: Callable[[str], None], before: Side, after: Side,
            changed: set[str], reasons: Mapping[str, str],
            strain: Mapping[str, tuple[str, ...]] = MappingProxyType({})) -> None:
    """Deliver the events of a change (``changes``) to ``events``."""
    deliver(events, forget, changes(before, after, changed, reasons, strain))


def deliver(events: Events, forget: Callable[[str], None], found: Sequence[Event]) -> None:
    """Hand each event to ``events`` in turn; ``forget`` is told each allocation that is gone,
    before its event."""
    for event in found:
        if event.kind is Kind.REMOVED:
            forget(event.args[0])
        deliver_one(events, event)


def changes(before: Side, after: Side, changed: set[str], reasons: Mapping[str, str],
            strain: Mapping[str, tuple[str, ...]] = MappingProxyType({})) -> list[Event]:
    """The events for what changed between two sides of a change, in the order they are
    delivered. An unbound allocation's CPUSet is the shared pool: it is announced once, by
    SharedCPUs and PoolsChanged, not per allocation. ``strain``: the health reasons of the
    allocations' figures now (the same on both sides: a change does not alter them)."""
    out: list[Event] = []
    old, old_topology, old_reports = before
    new, topology, reports = after
    was_in, now_in = old.ledger.allocations, new.ledger.allocations
    for name in sorted(changed | reasons.keys()):
        if name not in now_in:
            out.append(Event(Kind.REMOVED, (name,)))
        elif name not in was_in:
            out.append(Event(Kind.ADDED, (name, views.allocation(
                topology, new, name, reports.get(name), strain.get(name, ())))))
        elif was_in[name] is not now_in[name] or name in reasons or (
            new.records.get(name) is not old.records.get(name)
        ):
            mine = strain.get(name, ())
            diff = views.changed(views.allocation(old_topology, old, name, old_reports.get(name),
                                                  mine),
                                 views.allocation(topology, new, name, reports.get(name), mine))
            reason = reasons.get(name, "changed")
            if reason == MOVED and was_in[name].held != now_in[name].held:
                out.append(Event(Kind.MOVED, (name, was_in[name].held.format(),
                                              now_in[name].held.format())))
            out.append(Event(Kind.CHANGED, (name, reason, diff)))
    was, now = old.ledger, new.ledger
    if (was.shared, was.exclusive, was.fragment) != (now.shared, now.exclusive, now.fragment):
        out.append(Event(Kind.POOLS, (now.shared.format(), now.exclusive.format(),
                                      now.fragment.format())))
    manager = views.changed(views.manager(was, lending.all_lent(old_topology, old)),
                            views.manager(now, lending.all_lent(topology, new)))
    invalidated = ["Topology"] if topology != old_topology else []
    if manager or invalidated:
        out.append(Event(Kind.MANAGER, (manager, invalidated)))
    return out


@dataclass(frozen=True)
class Ready:
    """A change's events, derived from the partitions' ``reports`` and the figures' ``strain``
    of one instant."""

    events: list[Event]
    reports: Mapping[str, partitions.State]
    strain: Mapping[str, tuple[str, ...]]

    def holds(self, before: Mapping[str, partitions.State],
              after: Mapping[str, partitions.State],
              strain: Mapping[str, tuple[str, ...]]) -> bool:
        """Whether these are the events for reports ``before`` and ``after`` the change and
        ``strain``."""
        return self.strain is strain and before == self.reports and after == self.reports


T = TypeVar("T")


async def meanwhile(work: Coroutine[Any, Any, None], prepare: Callable[[], T]) -> T | None:
    """Run ``work`` (a transaction) and, once it has sent its first call to systemd and waits,
    ``prepare`` (None if that failed: a bug, logged; what it prepares is then made later).
    A failure of ``work`` is raised as it is; cancelling this cancels ``work``."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.sleep(0)  # the task's first step: up to its first wait
        try:
            out: T | None = prepare()
        except Exception:
            log.exception("preparing the events of a change (they are derived after it)")
            out = None
        await task
    except BaseException:
        task.cancel()
        raise
    return out
