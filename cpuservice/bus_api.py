"""The D-Bus face of the service: org.cpuservice1.Manager and org.cpuservice1.Allocation.

Every method runs behind one boundary: a CPUServiceError becomes its named D-Bus error, anything
else is logged and answered with a generic error, so no caller ever sees a traceback.
(No ``from __future__ import annotations`` here: dbus-fast reads the signature annotations.)
"""

import contextvars
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from dbus_fast import DBusError, Message, MessageFlag, MessageType, PropertyAccess, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from . import __version__, dbuscall, views
from .authz import ALLOCATE, MANAGE, AccessDenied, Authority, PidHandles, may_move
from .errors import CPUServiceError, InvalidArgument, LimitExceeded, NoSuchAllocation
from .service import Service
from .units import NO_QUOTA

log = logging.getLogger(__name__)
BUS_NAME = "org.cpuservice1"
PATH = "/org/cpuservice1"
ALLOCATION_PREFIX = "/org/cpuservice1/allocation/"
FAILED = "org.cpuservice1.Error.Failed"

# (sender, ALLOW_INTERACTIVE_AUTHORIZATION) of the method call being handled
current_call: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "call", default=("", False))
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def capture_sender(msg: Message) -> bool:
    """Message handler that remembers who is calling (exported methods are not told)."""
    if msg.message_type == MessageType.METHOD_CALL:
        interactive = bool(msg.flags & MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION)
        current_call.set((msg.sender or "", interactive))
    return False


def path_of(name: str) -> str:
    """Object path of an allocation: bytes outside [A-Za-z0-9] become _xx (as sd_bus does)."""
    return ALLOCATION_PREFIX + "".join(
        ch if ch.isascii() and ch.isalnum() else f"_{ord(ch):02x}" for ch in name
    )


def ascii_text(text: str) -> str:
    """Escape non-ASCII: dbus-fast 1.84 (Debian 12) marshals multi-byte strings with a wrong
    length, and the bus then drops the connection. Error texts quote callers' input."""
    return text.encode("ascii", "backslashreplace").decode("ascii")


def boundary(fn: F) -> F:
    """Named errors out, tracebacks never."""

    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except CPUServiceError as exc:
            raise DBusError(exc.dbus_name, ascii_text(str(exc))) from None
        except DBusError:
            raise
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise DBusError(FAILED, f"internal error in {fn.__name__}; see the service log") from None
    return wrapper  # type: ignore[return-value]


def _options(options: dict[str, Variant]) -> dict[str, Any]:
    return {k: v.value for k, v in options.items()}


ALLOCATION_SIGNATURES = {
    "Name": "s", "CPUs": "s", "Bound": "b", "CPUSet": "s", "Shares": "a{uu}",
    "CPUQuotaPerSecUSec": "t", "CPUWeight": "t", "MemoryNodes": "s", "Unit": "s", "Owner": "u",
    "State": "s", "Lifetime": "s",
}


class Bus(MessageBus):
    """dbus-fast sends InterfacesAdded/InterfacesRemoved itself on export/unexport, from the
    object's own path; the D-Bus specification has them come from the ObjectManager's path
    (/org/cpuservice1). The Manager sends them, with the values it is handed."""

    def _emit_interface_added(self, path: str, interface: ServiceInterface) -> None:
        pass

    def _emit_interface_removed(self, path: str, removed_interfaces: list[str]) -> None:
        pass


class Allocation(ServiceInterface):
    def __init__(self, manager: "Manager", name: str) -> None:
        super().__init__("org.cpuservice1.Allocation")
        self.manager = manager
        self.service = manager.service
        self.allocation = name

    def values(self) -> dict[str, Any]:
        """All properties, from the service's current state (no copy is kept here)."""
        service = self.service
        return views.allocation(service.topology, service.state, self.allocation)

    @dbus_property(access=PropertyAccess.READ)
    def Name(self) -> "s":
        return self.allocation

    @dbus_property(access=PropertyAccess.READ)
    def CPUs(self) -> "s":
        return self.values()["CPUs"]

    @dbus_property(access=PropertyAccess.READ)
    def Bound(self) -> "b":
        return self.values()["Bound"]

    @dbus_property(access=PropertyAccess.READ)
    def CPUSet(self) -> "s":
        return self.values()["CPUSet"]

    @dbus_property(access=PropertyAccess.READ)
    def Shares(self) -> "a{uu}":
        return self.values()["Shares"]

    @dbus_property(access=PropertyAccess.READ)
    def CPUQuotaPerSecUSec(self) -> "t":
        return self.values()["CPUQuotaPerSecUSec"]

    @dbus_property(access=PropertyAccess.READ)
    def CPUWeight(self) -> "t":
        return self.values()["CPUWeight"]

    @dbus_property(access=PropertyAccess.READ)
    def MemoryNodes(self) -> "s":
        return self.values()["MemoryNodes"]

    @dbus_property(access=PropertyAccess.READ)
    def Unit(self) -> "s":
        return self.values()["Unit"]

    @dbus_property(access=PropertyAccess.READ)
    def Owner(self) -> "u":
        return self.values()["Owner"]

    @dbus_property(access=PropertyAccess.READ)
    def State(self) -> "s":
        return self.values()["State"]

    @dbus_property(access=PropertyAccess.READ)
    def Lifetime(self) -> "s":
        return self.values()["Lifetime"]

    @method()
    @boundary
    async def Release(self) -> None:
        await self.manager.authorize_for(self.allocation)
        await self.service.release(self.allocation)


class Manager(ServiceInterface):
    """org.cpuservice1.Manager; also the service's Events sink."""

    def __init__(self, service: Service, bus: MessageBus, authority: Authority) -> None:
        super().__init__("org.cpuservice1.Manager")
        self.service = service
        self.bus = bus
        self.authority = authority
        self.objects: dict[str, Allocation] = {}
        self._uids: OrderedDict[str, int] = OrderedDict()
        service.events = self

    def export_all(self) -> None:
        self.bus.export(PATH, self)
        for name in self.service.ledger.allocations:
            self._export(name)

    def _export(self, name: str) -> Allocation:
        obj = Allocation(self, name)
        self.objects[name] = obj
        self.bus.export(path_of(name), obj)
        return obj

    async def authorize(self, action: str) -> int:
        """The caller's uid, once polkit allows ``action`` (uid 0 needs no asking)."""
        uid = await self._caller_uid()
        sender, interactive = current_call.get()
        await self.authority.check(sender, uid, action, interactive)
        return uid

    async def authorize_for(self, name: str) -> tuple[int, int]:
        """Work on an existing allocation: allocate for one's own, manage for anyone's.
        Returns the caller's uid and the allocation's serial: the service acts only if the
        name still means that allocation once it holds its lock."""
        serial = self.service.serial(name)
        owner = self.service.record(name).owner
        uid = await self._caller_uid()
        return await self.authorize(ALLOCATE if owner == uid else MANAGE), serial

    async def exempt(self, uid: int) -> bool:
        """Whether the per-user limits spare this caller: root, or a holder of manage
        (asked without interaction: a limit is no reason to prompt)."""
        if uid == 0:
            return True
        try:
            await self.authority.check(current_call.get()[0], uid, MANAGE, False)
        except CPUServiceError:
            return False
        return True

    async def _caller_uid(self) -> int:
        """The caller's uid from the bus (unique names are never reused: cache them)."""
        sender = current_call.get()[0]
        if not sender:  # only a peer-to-peer connection has none: not the system bus's word
            raise AccessDenied("a call that names no sender is not accepted")
        if sender in self._uids:
            return self._uids[sender]
        try:
            (uid,) = await dbuscall.call(self.bus, *dbuscall.BUS, "GetConnectionUnixUser", "s",
                                         [sender])
        except dbuscall.CallError:
            raise AccessDenied("the caller's uid is unknown") from None
        self._uids[sender] = int(uid)
        while len(self._uids) > 4096:
            self._uids.popitem(last=False)
        return self._uids[sender]

    # ---- Events ----

    def allocation_added(self, name: str, values: Mapping[str, Any]) -> None:
        self._export(name)
        self.AllocationAdded(name, path_of(name))
        body = {k: Variant(ALLOCATION_SIGNATURES[k], v) for k, v in values.items()}
        self._object_manager("InterfacesAdded", "oa{sa{sv}}",
                             [path_of(name), {"org.cpuservice1.Allocation": body}])

    def allocation_removed(self, name: str) -> None:
        self.objects.pop(name, None)
        self.bus.unexport(path_of(name))
        self.AllocationRemoved(name, path_of(name))
        self._object_manager("InterfacesRemoved", "oas",
                             [path_of(name), ["org.cpuservice1.Allocation"]])

    def allocation_changed(self, name: str, reason: str, changed: Mapping[str, Any]) -> None:
        obj = self.objects.get(name) or self._export(name)
        if changed:
            obj.emit_properties_changed(dict(changed))
        self.AllocationChanged(name, path_of(name), reason)

    def pools_changed(self, shared: str, exclusive: str, fragment: str) -> None:
        self.PoolsChanged(shared, exclusive, fragment)

    def manager_changed(self, changed: Mapping[str, Any], invalidated: Sequence[str]) -> None:
        self.emit_properties_changed(dict(changed), list(invalidated))

    def _object_manager(self, member: str, signature: str, body: list[Any]) -> None:
        self.bus.send(Message.new_signal(PATH, "org.freedesktop.DBus.ObjectManager", member,
                                         signature, body))

    # ---- methods ----

    @method()
    @boundary
    async def Allocate(self, name: "s", cpus: "s", options: "a{sv}") -> "o":
        admin = "cpuset" in options or "unit" in options
        owner = await self.authorize(MANAGE if admin else ALLOCATE)
        opts = _options(options)
        try:
            await self.service.allocate(name, cpus, opts, owner, limited=not admin and owner != 0)
        except LimitExceeded:
            if admin or not await self.exempt(owner):
                raise
            await self.service.allocate(name, cpus, opts, owner)
        return path_of(name)

    @method()
    @boundary
    async def Release(self, name: "s") -> None:
        _, serial = await self.authorize_for(name)
        await self.service.release(name, serial=serial)

    @method()
    @boundary
    async def Resize(self, name: "s", cpus: "s") -> None:
        uid, serial = await self.authorize_for(name)
        try:
            await self.service.resize(name, cpus, serial, limited=uid != 0)
        except LimitExceeded:
            if not await self.exempt(uid):
                raise
            await self.service.resize(name, cpus, serial)

    @method()
    @boundary
    async def Plan(self, cpus: "s", options: "a{sv}") -> "a{sv}":
        p = self.service.plan(cpus, _options(options))
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
    async def Capacity(self, cpus: "s", options: "a{sv}") -> "u":
        return self.service.capacity(cpus, _options(options))

    @method()
    @boundary
    async def ListAllocations(self) -> "a(ssbso)":
        out = []
        for name in sorted(self.service.ledger.allocations):
            a = self.service.allocation(name)
            cpus = self.service.placement_of(name).cpus.format()
            out.append([name, str(a.request.cpus), a.bound, cpus, path_of(name)])
        return out

    @method()
    @boundary
    async def GetAllocation(self, name: "s") -> "o":
        if name not in self.service.ledger.allocations:
            raise NoSuchAllocation(f"no allocation named {name!r}")
        return path_of(name)

    @method()
    @boundary
    async def Attach(self, name: "s", pids: "au") -> "s":
        uid, serial = await self.authorize_for(name)
        try:
            handles = PidHandles(list(pids))
        except LookupError as exc:
            raise InvalidArgument(str(exc)) from None
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
    def Granularity(self) -> "u":
        return self.service.ledger.granularity

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
