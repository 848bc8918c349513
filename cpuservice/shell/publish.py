"""What a committed change tells the bus: the events, with their values, for what changed
(``each``, ``changes``: pure; the engine derives them while systemd applies the change), and
their delivery to the sinks (``deliver``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from types import MappingProxyType

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
    """The events for what changed between two sides of a change (``each``)."""
    return list(each(before, after, changed, reasons, strain))


def each(before: Side, after: Side, changed: set[str], reasons: Mapping[str, str],
         strain: Mapping[str, tuple[str, ...]]) -> Iterator[Event]:
    """The events for what changed between two sides of a change, in the order they are
    delivered, one at a time. An unbound allocation's CPUSet is the shared pool: it is
    announced once, by SharedCPUs and PoolsChanged, not per allocation. ``strain``: the health
    reasons of the allocations' figures now (the same on both sides: a change does not alter
    them)."""
    old, old_topology, old_reports = before
    new, topology, reports = after
    was_in, now_in = old.ledger.allocations, new.ledger.allocations
    for name in sorted(changed | reasons.keys()):
        if name not in now_in:
            yield Event(Kind.REMOVED, (name,))
        elif name not in was_in:
            yield Event(Kind.ADDED, (name, views.allocation(
                topology, new, name, reports.get(name), strain.get(name, ()))))
        elif was_in[name] is not now_in[name] or name in reasons or (
            new.records.get(name) is not old.records.get(name)
        ):
            mine = strain.get(name, ())
            diff = views.changed(views.allocation(old_topology, old, name, old_reports.get(name),
                                                  mine),
                                 views.allocation(topology, new, name, reports.get(name), mine))
            reason = reasons.get(name, "changed")
            if reason == MOVED and was_in[name].held != now_in[name].held:
                yield Event(Kind.MOVED, (name, was_in[name].held.format(),
                                         now_in[name].held.format()))
            yield Event(Kind.CHANGED, (name, reason, diff))
    was, now = old.ledger, new.ledger
    if (was.shared, was.exclusive, was.fragment) != (now.shared, now.exclusive, now.fragment):
        yield Event(Kind.POOLS, (now.shared.format(), now.exclusive.format(),
                                 now.fragment.format()))
    manager = views.changed(views.manager(was, lending.all_lent(old_topology, old)),
                            views.manager(now, lending.all_lent(topology, new)))
    invalidated = ["Topology"] if topology != old_topology else []
    if manager or invalidated:
        yield Event(Kind.MANAGER, (manager, invalidated))


class Ahead:
    """A change's events, derived while systemd applies it (``steps``: one event at a time,
    each handed to ``sink.prepare`` where the sink prepares, ports.Preparing), for the sides
    ``before`` and ``after`` whose partition reports and figures' ``strain`` are those of that
    instant (a change observes its partitions after systemd applied it)."""

    def __init__(self, sink: Events, before: Side, after: Side, changed: set[str],
                 reasons: Mapping[str, str], strain: Mapping[str, tuple[str, ...]]) -> None:
        self.sink, self.strain = sink, strain
        self.reports = (before[2], after[2])
        self.events: list[Event] = []
        self.failed = False  # a bug while deriving: derived again at delivery
        self._left = each(before, after, changed, reasons, strain)

    def steps(self) -> Iterator[None]:
        """Derive and prepare the next event, one per step (the next call goes on)."""
        prepare = getattr(self.sink, "prepare", None)
        try:
            for event in self._left:
                if prepare is not None:
                    prepare(event, not self.events)
                self.events.append(event)
                yield
        except Exception:
            log.exception("deriving the events of a change ahead (they are derived again)")
            self.failed = True

    def done(self, before: Mapping[str, partitions.State],
             after: Mapping[str, partitions.State],
             strain: Mapping[str, tuple[str, ...]]) -> list[Event] | None:
        """Every event (the rest derived now), if they are those of reports ``before`` and
        ``after`` the change and ``strain``; else None."""
        if self.strain is not strain or self.reports != (before, after):
            return None
        for _ in self.steps():
            pass
        return None if self.failed else self.events


async def meanwhile(work: Callable[[Callable[[], None]], Awaitable[None]],
                    steps: Iterator[None]) -> None:
    """Await ``work`` (a transaction, handed what to call just before its last calls to
    systemd) and, once those calls are sent and it waits for them, take ``steps``, one per turn
    of the loop (a reply from systemd waits for one step at most), until it ends; what is left
    is left. The steps are the loop's callbacks: ``work`` is awaited as it is, its failure
    raised and a cancellation handed to it."""
    loop = asyncio.get_running_loop()
    over = False

    def step() -> None:
        if over or next(steps, _END) is _END:
            return
        loop.call_soon(step)

    def last() -> None:  # two turns on: the last calls are sent by the transaction's next
        loop.call_soon(loop.call_soon, step)  # step, or by the tasks of its gather

    try:
        await work(last)
    finally:
        over = True


_END = object()
