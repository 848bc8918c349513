"""The D-Bus objects' common ground: who is calling, the error boundary, object paths, the bus
connection, and org.cpuservice1.Allocation (one object per allocation; its Manager is in
cpuservice.bus.api).

Every method runs behind one boundary: a CPUServiceError becomes its named D-Bus error, anything
else is logged and answered with a generic error, so no caller ever sees a traceback.
(No ``from __future__ import annotations`` here: dbus-fast reads the signature annotations.)
"""

import collections
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from dbus_fast import DBusError, Message, MessageFlag, MessageType, PropertyAccess, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, dbus_property, method

from cpuservice.model import cpuset
from cpuservice.model.errors import CPUServiceError, InvalidArgument

log = logging.getLogger(__name__)
BUS_NAME = "org.cpuservice1"
PATH = "/org/cpuservice1"
ALLOCATION_PREFIX = "/org/cpuservice1/allocation/"
FAILED = CPUServiceError.dbus_name

# (sender, ALLOW_INTERACTIVE_AUTHORIZATION) of the method call being handled
current_call: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "call", default=("", False))
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


# What one call may carry, checked before any work (a 31 MB option map stalled the daemon):
MAX_MAP_ENTRIES = 64  # an option map (a{sv}) has 11 known keys
MAX_LIST_ITEMS = 4096  # an array (Attach's PIDs: at most 256 distinct)
MAX_TEXT = cpuset.MAX_TEXT  # a string (the longest cpu list a request may name)


def _oversized(value: Any) -> str | None:
    """Why an argument exceeds the bounds above, or None (one level into maps and arrays)."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters (at most {MAX_TEXT})" \
            if len(value) > MAX_TEXT else None
    if isinstance(value, dict):
        if len(value) > MAX_MAP_ENTRIES:
            return f"a map of {len(value)} entries (at most {MAX_MAP_ENTRIES})"
        for key, item in value.items():
            inner = item.value if isinstance(item, Variant) else item
            if why := _oversized(key):
                return f"a key: {why}"
            if isinstance(inner, str | bytes | list) and (why := _oversized(inner)):
                return f"{key!r}: {why}" if isinstance(key, str) and len(key) <= 64 else why
        return None
    if isinstance(value, list | bytes):
        if len(value) > MAX_LIST_ITEMS:
            return f"an array of {len(value)} items (at most {MAX_LIST_ITEMS})"
        return None
    return None


def capture_sender(msg: Message) -> bool:
    """Message handler that remembers who is calling (exported methods are not told), and
    refuses a call to cpuservice whose arguments exceed the bounds above before any work
    (InvalidArgument)."""
    if msg.message_type == MessageType.METHOD_CALL:
        interactive = bool(msg.flags & MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION)
        current_call.set((msg.sender or "", interactive))
        if (msg.path or "").startswith(PATH):
            for arg in msg.body:
                if isinstance(arg, Variant):  # Properties.Set
                    arg = arg.value
                if why := _oversized(arg):
                    raise DBusError(InvalidArgument.dbus_name,
                                    f"{msg.member}: an argument is too large: {why}")
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
            result = await fn(*args)
        except CPUServiceError as exc:
            _count(args, fn.__name__, exc.dbus_name)
            raise DBusError(exc.dbus_name, ascii_text(str(exc))) from None
        except DBusError as exc:
            _count(args, fn.__name__, exc.type)
            raise
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            _count(args, fn.__name__, FAILED)
            raise DBusError(FAILED, f"internal error in {fn.__name__}; see the service log") from None
        _count(args, fn.__name__, "ok")
        return result
    return wrapper  # type: ignore[return-value]


def _count(args: tuple[Any, ...], method: str, result: str) -> None:
    """Count the call for the metrics: "ok" or the error's last name (InvalidArgument)."""
    count = getattr(args[0], "count_request", None) if args else None
    if count is not None:
        count(method, result.rsplit(".", 1)[-1])


def plain_options(options: dict[str, Variant]) -> dict[str, Any]:
    return {k: v.value for k, v in options.items()}


ALLOCATION_SIGNATURES = {
    "Name": "s", "CPUs": "s", "Bound": "b", "CPUSet": "s", "Shares": "a{uu}",
    "CPUQuotaPerSecUSec": "t", "CPUWeight": "t", "MemoryNodes": "s", "Unit": "s", "Owner": "u",
    "State": "s", "Lifetime": "s", "Movable": "s", "Lending": "b", "LentCPUs": "s",
    "Partition": "s", "PartitionState": "s",
    "Health": "s", "HealthReason": "s", "Aligned": "b", "AlignmentReason": "s",
    "NearDevices": "a(sisss)", "NearPolicy": "s",
}


class _Fifo(collections.deque):  # type: ignore[type-arg]
    """dbus-fast's queue of messages to write, taken oldest first. dbus-fast 1.84 (Debian 12)
    takes the newest first (``pop``): messages queued behind a large one left in reverse, a
    PropertiesChanged before the InterfacesAdded it follows. 5.x takes ``popleft``."""

    def pop(self, *_: Any) -> Any:
        return self.popleft()


class _Sender:
    """The bus socket as dbus-fast's writer sees it, where a full socket means "wait".

    dbus-fast writes at once when its queue is empty, even while a big message is still half
    written: the socket is full, ``send`` raises BlockingIOError and dbus-fast drops the
    connection (the daemon exits, "lost the system bus"). Any caller could bring that about
    with a large reply followed by any other message. Here ``send`` then reports that nothing
    was written, and dbus-fast waits for the socket to be writable, as it does after a short
    write. (python-dbus-next issue 153, inherited by dbus-fast 1.84 and 5.x.)"""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def send(self, data: Any) -> int:
        try:
            return int(self._sock.send(data))
        except BlockingIOError:
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class Bus(MessageBus):
    """dbus-fast sends InterfacesAdded/InterfacesRemoved itself on export/unexport, from the
    object's own path; the D-Bus specification has them come from the ObjectManager's path
    (/org/cpuservice1). The Manager sends them, with the values it is handed. A full socket
    makes the writer wait instead of dropping the connection (``_Sender``), and messages leave in
    the order they were sent on every dbus-fast release (``_Fifo``). A signal finds the path of
    its object in one lookup (``_interface_signal_notify``), not by a walk over every exported
    object."""

    async def connect(self) -> "Bus":
        await super().connect()
        writer = getattr(self, "_writer", None)
        if writer is not None and not isinstance(getattr(writer, "sock", None), _Sender):
            writer.sock = _Sender(writer.sock)
            writer.messages = _Fifo(writer.messages)
        return self

    def _emit_interface_added(self, path: str, interface: ServiceInterface) -> None:
        pass

    def _emit_interface_removed(self, path: str, removed_interfaces: list[str]) -> None:
        pass

    def _exported(self) -> dict[int, set[str]]:
        """id(interface) -> the paths it is exported at (dbus-fast walks every export instead)."""
        return self.__dict__.setdefault("_paths_of", {})  # type: ignore[no-any-return]

    def export(self, path: str, interface: ServiceInterface) -> None:
        super().export(path, interface)
        self._exported().setdefault(id(interface), set()).add(path)

    def unexport(self, path: str, interface: ServiceInterface | str | None = None) -> None:
        before = list(_interfaces(self._path_exports.get(path)))
        super().unexport(path, interface)
        after = _interfaces(self._path_exports.get(path))
        index = self._exported()
        for iface in before:
            if not any(i is iface for i in after) and (paths := index.get(id(iface))):
                paths.discard(path)
                if not paths:
                    del index[id(iface)]

    def _has_interface(self, interface: ServiceInterface) -> bool:
        """dbus-fast 1.84 asks, on every unexport, by walking every export."""
        return any(_exports(self._path_exports.get(p), interface)
                   for p in self._exported().get(id(interface), ()))

    def _interface_signal_notify(self, interface: ServiceInterface, interface_name: str,
                                 member: str, signature: str, body: list[Any],
                                 unix_fds: list[int] | None = None) -> None:
        """What dbus-fast (1.84 to 5.x) does on every signal and PropertiesChanged, finding
        the interface's path by walking every exported path: with 3,000 allocations exported
        that walk was most of what a change cost the daemon beyond the change itself."""
        path = next((p for p in sorted(self._exported().get(id(interface), ()))
                     if _exports(self._path_exports.get(p), interface)), None)
        if path is None:
            raise RuntimeError(f"{interface_name} is not exported on this bus")
        self.send(Message.new_signal(path=path, interface=interface_name, member=member,
                                     signature=signature, body=body, unix_fds=unix_fds or []))


def _interfaces(exports: Any) -> list[ServiceInterface]:
    """One path's exports: a list on dbus-fast 1.84, a dict by name later."""
    if exports is None:
        return []
    return list(exports.values() if isinstance(exports, dict) else exports)


def _exports(exports: Any, interface: ServiceInterface) -> bool:
    """Whether one path's exports hold ``interface`` itself."""
    return any(i is interface for i in _interfaces(exports))


class AllocationHost(Protocol):
    """What an Allocation object asks of the Manager that exports it."""

    def allocation_values(self, name: str) -> dict[str, Any]: ...

    async def release_as_caller(self, name: str) -> None: ...

    def count_request(self, method: str, result: str) -> None: ...


class Allocation(ServiceInterface):
    def __init__(self, manager: AllocationHost, name: str) -> None:
        super().__init__("org.cpuservice1.Allocation")
        self.manager = manager
        self.allocation = name

    def values(self) -> dict[str, Any]:
        return self.manager.allocation_values(self.allocation)

    def count_request(self, method: str, result: str) -> None:
        self.manager.count_request(method, result)

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

    @dbus_property(access=PropertyAccess.READ)
    def Movable(self) -> "s":
        return self.values()["Movable"]

    @dbus_property(access=PropertyAccess.READ)
    def Lending(self) -> "b":
        return self.values()["Lending"]

    @dbus_property(access=PropertyAccess.READ)
    def LentCPUs(self) -> "s":
        return self.values()["LentCPUs"]

    @dbus_property(access=PropertyAccess.READ)
    def Partition(self) -> "s":
        return self.values()["Partition"]

    @dbus_property(access=PropertyAccess.READ)
    def PartitionState(self) -> "s":
        return self.values()["PartitionState"]

    @dbus_property(access=PropertyAccess.READ)
    def Health(self) -> "s":
        return self.values()["Health"]

    @dbus_property(access=PropertyAccess.READ)
    def HealthReason(self) -> "s":
        return self.values()["HealthReason"]

    @dbus_property(access=PropertyAccess.READ)
    def Aligned(self) -> "b":
        return self.values()["Aligned"]

    @dbus_property(access=PropertyAccess.READ)
    def AlignmentReason(self) -> "s":
        return self.values()["AlignmentReason"]

    @dbus_property(access=PropertyAccess.READ)
    def NearDevices(self) -> "a(sisss)":
        return self.values()["NearDevices"]

    @dbus_property(access=PropertyAccess.READ)
    def NearPolicy(self) -> "s":
        return self.values()["NearPolicy"]

    @method()
    @boundary
    async def Release(self) -> None:
        await self.manager.release_as_caller(self.allocation)


class Spares:
    """Allocation objects no longer exported, made over for new allocations: dbus-fast's
    ServiceInterface walks its class's members (inspect.getmembers) for every object made,
    30-50 us of an Allocate. At most KEEP are kept. Safe to reuse: nothing keeps an object past
    its unexport (the bulk reads look objects up by path when they answer; Allocation.Release
    reads its name when called)."""

    KEEP = 64

    def __init__(self, host: AllocationHost) -> None:
        self.host = host
        self._free: list[Allocation] = []

    def new(self, name: str) -> "Allocation":
        if self._free:
            obj = self._free.pop()
            obj.allocation = name
            return obj
        return Allocation(self.host, name)

    def keep(self, obj: "Allocation | None") -> None:
        """``obj`` was unexported: it may be made over."""
        if obj is not None and len(self._free) < self.KEEP:
            self._free.append(obj)
