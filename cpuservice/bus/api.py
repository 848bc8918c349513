"""The D-Bus face of the service: org.cpuservice1.Manager at /org/cpuservice1 (the methods,
the pools' properties and signals, the ObjectManager's signals); it is the service's Events sink.
The allocation objects and the error boundary are in cpuservice.bus.objects.
(No ``from __future__ import annotations`` here: dbus-fast reads the signature annotations.)
"""

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, cast

from dbus_fast import Message, PropertyAccess, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from cpuservice import __version__
from cpuservice.apply import views
from cpuservice.apply.units import NO_QUOTA
from cpuservice.bus import statistics
from cpuservice.bus.callers import Callers
from cpuservice.bus.irq_report import irq_isolation
from cpuservice.bus.objects import (
    BUS_NAME,
    PATH,
    Allocation,
    Bus,
    Spares,
    boundary,
    capture_sender,
    path_of,
    plain_options,
)
from cpuservice.bus.reads import Reads, in_turn
from cpuservice.bus.signals import OBJECT_MANAGER, Outbox
from cpuservice.host.authz import (
    ALLOCATE,
    MANAGE,
    Authority,
    BusyError,
    PidHandles,
    RateLimit,
    may_move,
)
from cpuservice.model import lending
from cpuservice.model.errors import (
    InvalidArgument,
    LimitExceeded,
    NoSuchAllocation,
    SharedPoolStarving,
)
from cpuservice.shell.engine import Snapshot
from cpuservice.shell.ports import Event, Kind
from cpuservice.shell.service import Service

__all__ = ["BUS_NAME", "Bus", "Manager", "capture_sender"]
log = logging.getLogger(__name__)


class Manager(Callers, ServiceInterface):
    """org.cpuservice1.Manager; also the service's Events sink."""

    def __init__(self, service: Service, bus: MessageBus, authority: Authority) -> None:
        super().__init__("org.cpuservice1.Manager")
        self.service = service
        self.bus = bus
        self.authority = authority
        self.objects: dict[str, Allocation] = {}
        self._values: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.spares = Spares(self)  # Allocation objects unexported, made over
        self.outbox = Outbox(self.spares.new, self.introspect)
        self.exported = False  # on the bus (export_all): its own signals are sent
        self._uids = OrderedDict()
        self._asking = {}
        self.rate = RateLimit(service.config.max_changes_per_user_per_minute)
        self.reads = Reads(bus, self)  # GetManagedObjects, GetAll, Introspect: in turn, cached
        self.statistics = service.statistics  # GetStatistics: from the kernel, in turn
        service.subscribe(self)

    def export_all(self) -> None:
        """Export the Manager and every allocation, and start answering the bulk reads (the
        bus's message handler; after capture_sender, which the daemon adds first)."""
        self.bus.add_message_handler(self.reads.handler)
        self.bus.export(PATH, self)
        self.exported = True
        self.reads.exported(PATH, self)
        for name in self.service.ledger.allocations:
            if name not in self.objects:  # an event during startup may have exported it
                self._export(name)

    def _export(self, name: str, obj: Allocation | None = None) -> Allocation:
        obj = obj or self.spares.new(name)
        self.objects[name] = obj
        self.bus.export(path_of(name), obj)
        self.reads.exported(path_of(name), obj)
        return obj

    # ---- Events ----

    def prepare(self, event: Event, first: bool) -> None:
        """Make, while systemd applies a change, what delivering an event sends (Outbox)."""
        self.outbox.prepare(event, first)

    def _send(self, messages: Sequence[Message]) -> None:
        """Send, but the Manager's own signals only once it is exported (export_all)."""
        for message in messages:
            if self.exported or message.path != PATH or message.interface == OBJECT_MANAGER:
                self.bus.send(message)

    def allocation_added(self, name: str, values: Mapping[str, Any]) -> None:
        obj, messages = self.outbox.take(Kind.ADDED, name, values)
        self._export(name, cast(Allocation, obj))
        self._send(messages)

    def allocation_removed(self, name: str) -> None:
        _, messages = self.outbox.take(Kind.REMOVED, name)
        obj = self.objects.pop(name, None)
        self._values.pop(name, None)
        self.bus.unexport(path_of(name))
        self.reads.unexported(path_of(name))
        self.spares.keep(obj)
        self._send(messages)

    def allocation_changed(self, name: str, reason: str, changed: Mapping[str, Any]) -> None:
        _, messages = self.outbox.take(Kind.CHANGED, name, reason, changed)
        if name not in self.objects:
            self._export(name)
        self._send(messages)

    def allocation_moved(self, name: str, old: str, new: str) -> None:
        self._send(self.outbox.take(Kind.MOVED, name, old, new)[1])

    def pools_changed(self, shared: str, exclusive: str, fragment: str) -> None:
        self._send(self.outbox.take(Kind.POOLS, shared, exclusive, fragment)[1])

    def manager_changed(self, changed: Mapping[str, Any], invalidated: Sequence[str]) -> None:
        self._send(self.outbox.take(Kind.MANAGER, changed, invalidated)[1])

    # ---- methods ----

    @method()
    @boundary
    async def Allocate(self, name: "s", cpus: "s", options: "a{sv}") -> "o":
        # a kernel partition keeps every other process of the host off its CPUs: the host's
        # administrator's call, like explicit CPUs and foreign units
        partition = options.get("partition")
        force = statistics.force(options)  # past the admission guard: never recorded
        admin = "cpuset" in options or "unit" in options or force or (
            partition is not None and getattr(partition, "value", None) != "none")
        owner = await self.authorize(MANAGE if admin else ALLOCATE)
        await self.count_change(owner)
        opts = plain_options(options)
        try:
            await self.service.allocate(name, cpus, opts, owner,
                                        limited=not admin and owner != 0, force=force)
        except LimitExceeded:
            if admin or not await self.exempt(owner):
                raise
            await self.service.allocate(name, cpus, opts, owner)
        return path_of(name)

    @method()
    @boundary
    async def Release(self, name: "s") -> None:
        await self.release_as_caller(name)

    async def release_as_caller(self, name: str) -> None:
        """Release, for the caller of this call (Manager.Release, Allocation.Release)."""
        uid, serial = await self.authorize_for(name)
        await self.count_change(uid)
        await self.service.release(name, serial=serial)

    def count_request(self, method: str, result: str) -> None:
        self.service.count_request(method, result)

    def snapshot(self) -> Snapshot:
        return self.service.snapshot()

    def allocation_values(self, name: str, snap: Snapshot | None = None) -> dict[str, Any]:
        """All properties of an allocation, from the service's current state (or ``snap``).
        Computed once per state (the state and the topology are replaced, never changed, on
        every change): GetAll and GetManagedObjects read every allocation's properties."""
        snap = snap or self.service.snapshot()
        key = (snap.state, snap.topology, snap.partition_report(name), snap.strain.get(name, ()))
        cached = self._values.get(name)
        if cached is None or any(a is not b for a, b in zip(cached[0], key, strict=True)):
            cached = self._values[name] = (key, views.allocation(snap.topology, snap.state,
                                                                 name, key[2], key[3]))
        return cached[1]

    def manager_key(self, snap: Snapshot | None = None) -> tuple[object, ...]:
        """What the Manager's and the allocations' properties are computed from: the service's
        state, topology, capabilities and interrupt report (each replaced, never changed) and
        the kernel's partition reports."""
        snap = snap or self.service.snapshot()
        return (snap.state, snap.topology, snap.capabilities, snap.irqs, snap.partition_reports,
                snap.strain)

    @method()
    @boundary
    async def SetMovable(self, name: "s", movable: "s") -> None:
        uid, serial = await self.authorize_for(name)
        await self.count_change(uid)
        await self.service.set_movable(name, movable, serial)

    @method()
    @boundary
    async def SetLending(self, name: "s", lend: "b") -> None:
        uid, serial = await self.authorize_for(name)
        await self.count_change(uid)
        await self.service.set_lending(name, lend, serial)

    @method()
    @boundary
    async def Defragment(self, dry_run: "b") -> "a(sss)":
        await self.authorize(MANAGE)
        moves = await self.service.defragment(dry_run)
        return [[m.name, m.old.held.format(), m.new.held.format()] for m in moves]

    @method()
    @boundary
    async def Resize(self, name: "s", cpus: "s") -> None:
        uid, serial = await self.authorize_for(name)
        await self.count_change(uid)
        try:  # (the admission guard holds the callers the limits hold: Resize has no force)
            await self.service.resize(name, cpus, serial, limited=uid != 0)
        except (LimitExceeded, SharedPoolStarving):
            if not await self.exempt(uid):
                raise
            await self.service.resize(name, cpus, serial)

    @method()
    @boundary
    @in_turn
    async def Plan(self, cpus: "s", options: "a{sv}") -> "a{sv}":
        p = self.service.plan(cpus, plain_options(options))
        quota = NO_QUOTA if p.cpu_quota_usec is None else p.cpu_quota_usec
        return {
            "cpuset": Variant("s", p.cpus.format()),
            "shares": Variant("a{uu}", dict(p.shares)),
            "cpu-quota-per-sec-usec": Variant("t", quota),
            "cpu-weight": Variant("t", p.cpu_weight),
            "memory-nodes": Variant("s", p.memory_nodes.format()),
            "whole": Variant("s", p.whole.format()),
            "fragment-cpu": Variant("i", p.fragment.cpu if p.fragment else -1),
        }

    @method()
    @boundary
    @in_turn
    async def Capacity(self, cpus: "s", options: "a{sv}") -> "u":
        return self.service.capacity(cpus, plain_options(options))

    @method()
    @boundary
    @in_turn
    async def ListAllocations(self) -> "a(ssbso)":
        out = []
        for name in sorted(self.service.ledger.allocations):
            a = self.service.allocation(name)
            cpus = self.service.placement_of(name).cpus.format()
            out.append([name, str(a.request.cpus), a.bound, cpus, path_of(name)])
        return out

    @method()
    @boundary
    @in_turn
    async def GetAllocation(self, name: "s") -> "o":
        if name not in self.service.ledger.allocations:
            raise NoSuchAllocation(f"no allocation named {name!r}")
        return path_of(name)

    @method()
    @boundary
    @in_turn
    async def GetStatistics(self, names: "as") -> "a{sa{sv}}":
        return await statistics.reply(self.statistics, names)

    @method()
    @boundary
    @in_turn
    async def GetHostPressure(self) -> "a{sa{sv}}":
        return statistics.host_reply(self.service.host)

    @method()
    @boundary
    async def Attach(self, name: "s", pids: "au") -> "s":
        uid, serial = await self.authorize_for(name)
        await self.count_change(uid)
        try:
            handles = PidHandles(list(pids))
        except LookupError as exc:
            raise InvalidArgument(str(exc)) from None
        except BusyError as exc:
            raise LimitExceeded(str(exc)) from None
        try:
            if uid != 0:
                mine = {self.service.record(n).unit for n in self.service.ledger.allocations
                        if self.service.record(n).owner == uid}
                try:
                    foreign = [p for p in handles.pids if not may_move(p, uid, mine)]
                except LookupError as exc:
                    raise InvalidArgument(str(exc)) from None
                if foreign:  # another user's process, or one of a unit that is not the caller's
                    await self.authorize(MANAGE)
            unit = await self.service.attach(name, handles.pids, serial)
            if not handles.all_alive():
                log.warning("a process attached to %s exited during the move; its PID may "
                            "have been reused (systemd 252 takes PIDs, not pidfds)", name)
            return unit
        finally:
            handles.close()

    @method()
    @boundary
    async def Revalidate(self) -> None:
        await self.authorize(MANAGE)
        await self.service.revalidate()

    @method()
    @boundary
    @in_turn
    async def ExportNodeResourceTopology(self, node_name: "s") -> "s":
        return json.dumps(self.service.node_resource_topology(node_name))

    # ---- properties ----

    @dbus_property(access=PropertyAccess.READ)
    def Version(self) -> "s":
        return __version__

    @dbus_property(access=PropertyAccess.READ)
    def OnlineCPUs(self) -> "s":
        return self.service.ledger.online.format()

    @dbus_property(access=PropertyAccess.READ)
    def ReservedCPUs(self) -> "s":
        return self.service.ledger.reserved.format()

    @dbus_property(access=PropertyAccess.READ)
    def IsolatedCPUs(self) -> "s":
        return self.service.ledger.isolated.format()

    @dbus_property(access=PropertyAccess.READ)
    def SharedCPUs(self) -> "s":
        return self.service.ledger.shared.format()

    @dbus_property(access=PropertyAccess.READ)
    def ExclusiveCPUs(self) -> "s":
        return self.service.ledger.exclusive.format()

    @dbus_property(access=PropertyAccess.READ)
    def FragmentCPUs(self) -> "s":
        return self.service.ledger.fragment.format()

    @dbus_property(access=PropertyAccess.READ)
    def LentCPUs(self) -> "s":
        snap = self.service.snapshot()
        return lending.all_lent(snap.topology, snap.state).format()

    @dbus_property(access=PropertyAccess.READ)
    def Granularity(self) -> "u":
        return self.service.ledger.granularity

    @dbus_property(access=PropertyAccess.READ)
    def IRQIsolation(self) -> "a{sv}":
        return irq_isolation(self.service.snapshot(), self.service.config.isolate_irqs)

    @dbus_property(access=PropertyAccess.READ)
    def Capabilities(self) -> "a{sv}":
        """What this host can do beyond AllowedCPUs (cpuset partitions), as detected at
        startup."""
        return {k: Variant(sig, v) for k, (sig, v) in
                self.service.snapshot().capabilities.as_dbus().items()}

    @dbus_property(access=PropertyAccess.READ)
    def Topology(self) -> "s":
        return self.service.topology.to_json()

    # ---- signals ----

    @signal()
    def PoolsChanged(self, shared: str, exclusive: str, fragment: str) -> "sss":
        return [shared, exclusive, fragment]

    @signal()
    def AllocationAdded(self, name: str, path: str) -> "so":
        return [name, path]

    @signal()
    def AllocationRemoved(self, name: str, path: str) -> "so":
        return [name, path]

    @signal()
    def AllocationChanged(self, name: str, path: str, reason: str) -> "sos":
        return [name, path, reason]

    @signal()
    def AllocationMoved(self, name: str, path: str, old: str, new: str) -> "soss":
        return [name, path, old, new]
