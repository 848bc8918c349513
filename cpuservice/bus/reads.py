"""The bulk reads of the bus, which anyone may make (issue 37): ObjectManager.GetManagedObjects,
Properties.GetAll and Get, and Introspect on cpuservice's objects.

dbus-fast answers them itself, synchronously, as it reads them: GetManagedObjects read all
properties of all allocations one at a time (quadratic in its bookkeeping) and marshalled them
anew for every caller, 99-443 ms at 1,000 allocations, and 128 of them pipelined on a
connection froze the daemon for seconds. Here a message handler, which runs before dbus-fast's
own dispatch, takes these calls and answers them
- **in turn** (cpuservice.bus.fair): one at a time, round robin over connections, at most a
  fifth of the time, a bounded number waiting;
- **from what was built before**: every allocation's entry is marshalled once for each value it
  takes, and a reply is the entries' bytes joined behind a header of its own (``Prepared``), so
  answering costs a copy, not a marshalling (after a change, only the entries whose values
  changed are marshalled again); introspection XML is built once per set of objects.
- **after the previous one was written** (back-pressure): the turn is held until the reply has
  left for the bus, so a caller that reads slowly cannot make the daemon hold its replies.
(No ``from __future__ import annotations`` here, as in the other modules of the bus.)
"""

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from dbus_fast import Message, MessageFlag, MessageType, Variant
from dbus_fast import introspection as intr
from dbus_fast.aio import MessageBus
from dbus_fast.constants import ErrorType
from dbus_fast.service import ServiceInterface

from cpuservice.bus.fair import Refused, Turns
from cpuservice.bus.objects import (
    ALLOCATION_PREFIX,
    ALLOCATION_SIGNATURES,
    PATH,
    Allocation,
    current_call,
    path_of,
)
from cpuservice.model.errors import CPUServiceError, LimitExceeded
from cpuservice.shell.engine import Snapshot

log = logging.getLogger(__name__)
MANAGER_IFACE = "org.cpuservice1.Manager"
ALLOCATION_IFACE = "org.cpuservice1.Allocation"
PROPERTIES = "org.freedesktop.DBus.Properties"
INTROSPECTABLE = "org.freedesktop.DBus.Introspectable"
OBJECT_MANAGER = "org.freedesktop.DBus.ObjectManager"
MANAGED = "a{oa{sa{sv}}}"
# the paths above the objects: GetManagedObjects there lists the objects below
ALLOCATIONS = ALLOCATION_PREFIX.rstrip("/")
ANCESTORS = ("/", "/org", PATH, ALLOCATIONS)
SLICE = 0.002  # seconds a reply is built for before the loop runs what else is ready
Answer = Callable[[Message], Awaitable[Message]]


class Prepared(Message):
    """A method return whose body was marshalled before: only the header is marshalled for
    this caller. (dbus-fast writes what ``_marshall`` returns; the header's body length is
    replaced by the prepared body's.)"""

    def __init__(self, call: Message, signature: str, body: bytes) -> None:
        super().__init__(message_type=MessageType.METHOD_RETURN, reply_serial=call.serial,
                         destination=call.sender, signature=signature,
                         body=[_EMPTY[signature[0]]])
        self.prepared = body

    def _marshall(self, negotiate_unix_fd: bool) -> bytearray:
        return _join(super()._marshall(negotiate_unix_fd), self.prepared)


_EMPTY: dict[str, Any] = {"a": {}, "s": ""}  # the cheapest body of each prepared signature


def _join(message: bytearray, body: bytes) -> bytearray:
    """``message`` (little-endian, as dbus-fast marshals) with its body replaced by ``body``."""
    old = int.from_bytes(message[4:8], "little")
    out = message[:len(message) - old]
    out[4:8] = len(body).to_bytes(4, "little")
    out += body
    return out


def body_bytes(signature: str, value: Any) -> bytes:
    """The marshalled body of a message whose one argument is ``value``."""
    message = Message(message_type=MessageType.METHOD_RETURN, reply_serial=1,
                      signature=signature, body=[value])._marshall(False)
    size = int.from_bytes(message[4:8], "little")
    return bytes(message[len(message) - size:])


def entry_bytes(path: str, interfaces: Mapping[str, Mapping[str, Variant]]) -> bytes:
    """One entry of a GetManagedObjects reply, marshalled: it starts 8-aligned in any reply, so
    its bytes are the same wherever it stands."""
    return body_bytes(MANAGED, {path: interfaces})[8:]  # after the array's length and padding


def managed_body(entries: Iterable[bytes]) -> bytes:
    """A GetManagedObjects body from its entries (each 8-aligned: padded between)."""
    out = bytearray()
    for entry in entries:
        out += bytes(-len(out) % 8) + entry
    return len(out).to_bytes(4, "little") + bytes(4) + bytes(out)


class Host(Protocol):
    """What the reads ask of the Manager."""

    def snapshot(self) -> Snapshot: ...

    async def uid_of(self, sender: str) -> int: ...

    def allocation_values(self, name: str, snap: Snapshot | None = None) -> dict[str, Any]: ...

    def manager_key(self, snap: Snapshot | None = None) -> tuple[object, ...]:
        """What the properties are computed from (objects compared by identity, mappings by
        value)."""


class Reads:
    """Answers the bulk reads of cpuservice's objects (``handler`` is the bus's message
    handler); the Manager tells it when objects come and go."""

    def __init__(self, bus: MessageBus, host: Host, turns: Turns | None = None) -> None:
        self.bus = bus
        self.host = host
        self.turns = turns or Turns()
        self.manager: ServiceInterface | None = None
        self.allocations: dict[str, Allocation] = {}  # path -> its object
        self._entries: dict[str, tuple[object, bytes]] = {}  # path -> (values, entry bytes)
        self._getall: dict[str, tuple[object, bytes]] = {}  # path -> (values, body bytes)
        self._manager: tuple[tuple[object, ...], dict[str, Variant]] | None = None
        self._manager_body: tuple[tuple[object, ...], bytes] | None = None
        self._introspection: dict[str, bytes] = {}  # path -> body
        self._managed: dict[str, tuple[tuple[object, ...], bytes]] = {}  # path -> (key, body)
        self._version = 0  # of the set of objects
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- the objects ----

    def exported(self, path: str, obj: ServiceInterface) -> None:
        if path == PATH:
            self.manager = obj
        elif isinstance(obj, Allocation):
            self.allocations[path] = obj
        self._version += 1
        self._introspection.clear()

    def unexported(self, path: str) -> None:
        self.allocations.pop(path, None)
        self._entries.pop(path, None)
        self._getall.pop(path, None)
        self._version += 1
        self._introspection.clear()

    # ---- the handler ----

    def handler(self, msg: Message) -> bool:
        """Take the bulk reads of cpuservice's objects (True: handled here)."""
        if msg.message_type is not MessageType.METHOD_CALL:
            return False
        if (msg.flags & MessageFlag.NO_REPLY_EXPECTED and msg.interface == MANAGER_IFACE
                and msg.member in IN_TURN):
            return True  # a read whose answer no one wants: no turn spent on it
        answer = self._answerer(msg)
        if answer is None:
            return False
        if not msg.flags & MessageFlag.NO_REPLY_EXPECTED:
            task = asyncio.ensure_future(self._answer(msg, answer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    def _answerer(self, msg: Message) -> Answer | None:
        member, path = msg.member, msg.path or ""
        if msg.interface == OBJECT_MANAGER and member == "GetManagedObjects":
            return self._managed_objects
        if msg.interface == INTROSPECTABLE and member == "Introspect" and msg.signature == "":
            return self._introspect
        if msg.interface != PROPERTIES or not (path == PATH or path in self.allocations):
            return None
        iface = MANAGER_IFACE if path == PATH else ALLOCATION_IFACE
        if member == "GetAll" and msg.signature == "s" and msg.body[0] == iface:
            return self._get_all
        if member == "Get" and msg.signature == "ss" and msg.body[0] == iface:
            return self._get
        return None  # dbus-fast answers the rest (errors, Set): no bulk work

    async def _answer(self, msg: Message, answer: Answer) -> None:
        try:
            async with self.turns.turn(await self.caller(msg.sender or "")) as turn:
                if self.bus.connected:  # (a daemon that stops has no one to answer)
                    reply = await answer(msg)
                    turn.sent = len(reply.prepared) if isinstance(reply, Prepared) else 0
                    await self.bus.send(reply)  # the turn ends once it has left
        except Refused as exc:
            reply = Message.new_error(msg, LimitExceeded.dbus_name, str(exc))
        except Exception:
            if not self.bus.connected:
                return
            log.exception("internal error answering %s.%s", msg.interface, msg.member)
            reply = Message.new_error(msg, ErrorType.FAILED.value,
                                      f"internal error in {msg.member}")
        else:
            return
        if self.bus.connected:
            self.bus.send(reply)

    async def caller(self, sender: str) -> str:
        """Whose turn a call of ``sender`` takes: its user's (a user's connections share one
        place in the round), or the connection's when the bus does not say."""
        try:
            return f"uid {await self.host.uid_of(sender)}"
        except CPUServiceError:
            return f"connection {sender}"

    # ---- the answers ----

    async def _managed_objects(self, msg: Message) -> Message:
        if msg.signature != "":
            return Message.new_error(msg, ErrorType.UNKNOWN_METHOD.value,
                                     f"GetManagedObjects takes no arguments, not "
                                     f"{msg.signature!r}")
        path = msg.path or ""
        if path not in ANCESTORS:
            return Prepared(msg, MANAGED, managed_body(()))
        snap = self.host.snapshot()
        key = self.host.manager_key(snap)
        cached = self._managed.get(path)
        if cached is None or not _same(cached[0], key):
            body = await self._build(path, snap, SLICE)
            snap = self.host.snapshot()
            if not _same(key, now := self.host.manager_key(snap)):
                # a change committed meanwhile and sent its signals: a reply of the state before
                # it, sent after them, would leave a client with objects that are gone
                key, body = now, await self._build(path, snap, None)
            cached = self._managed[path] = (key, body)
        return Prepared(msg, MANAGED, cached[1])

    async def _build(self, path: str, snap: Snapshot, pause: float | None) -> bytes:
        """A GetManagedObjects body as of ``snap``. After a change every allocation's values
        are computed again (18 ms at 1,000 allocations): the loop is yielded every ``pause``
        seconds meanwhile, so that a change's next step or the lending loop's sample does not
        wait for all of it (other reads do: the turn is held); None: not yielded."""
        entries = []
        if path in ("/", "/org") and self.manager is not None:
            entries.append(entry_bytes(PATH, {MANAGER_IFACE: self._manager_values()}))
        since = time.monotonic()
        for name in sorted(snap.state.ledger.allocations):
            entries.append(self._entry(path_of(name), self.host.allocation_values(name, snap)))
            if pause is not None and time.monotonic() - since > pause:
                await asyncio.sleep(0)
                since = time.monotonic()
        return managed_body(entries)

    def _values(self, path: str) -> dict[str, Any]:
        return self.host.allocation_values(self.allocations[path].allocation)

    def _entry(self, path: str, values: dict[str, Any]) -> bytes:
        """An allocation's entry, marshalled again only when its values changed."""
        cached = self._entries.get(path)
        if cached is None or cached[0] is not values:
            same = cached is not None and cached[0] == values
            data = cached[1] if cached is not None and same else entry_bytes(
                path, {ALLOCATION_IFACE: self._variants(values)})
            cached = (values, data)
            if path in self.allocations:  # (not one released while the reply was built)
                self._entries[path] = cached
        return cached[1]

    @staticmethod
    def _variants(values: Mapping[str, Any]) -> dict[str, Variant]:
        return {k: Variant(ALLOCATION_SIGNATURES[k], v) for k, v in values.items()}

    def _manager_values(self) -> dict[str, Variant]:
        key = self.host.manager_key()
        if self._manager is None or not _same(self._manager[0], key):
            assert self.manager is not None
            props = self.manager.introspect().properties
            self._manager = (key, {p.name: Variant(p.signature, getattr(self.manager, p.name))
                                   for p in props})
        return self._manager[1]

    async def _get_all(self, msg: Message) -> Message:
        path = msg.path or ""
        if path == PATH:
            key = self.host.manager_key()
            if self._manager_body is None or not _same(self._manager_body[0], key):
                self._manager_body = (key, body_bytes("a{sv}", self._manager_values()))
            return Prepared(msg, "a{sv}", self._manager_body[1])
        if path not in self.allocations:
            return _gone(msg)
        values = self._values(path)
        cached = self._getall.get(path)
        if cached is None or cached[0] is not values:
            same = cached is not None and cached[0] == values
            data = cached[1] if cached is not None and same else body_bytes(
                "a{sv}", self._variants(values))
            cached = self._getall[path] = (values, data)
        return Prepared(msg, "a{sv}", cached[1])

    async def _get(self, msg: Message) -> Message:
        path, name = msg.path or "", msg.body[1]
        if path == PATH:
            values = self._manager_values()
            value = values.get(name)
        elif path not in self.allocations:
            return _gone(msg)
        else:
            plain = self._values(path)
            value = Variant(ALLOCATION_SIGNATURES[name], plain[name]) if name in plain else None
        if value is None:
            return Message.new_error(msg, ErrorType.UNKNOWN_PROPERTY.value,
                                     f'interface "{msg.body[0]}" does not have property '
                                     f'"{name}"')
        return Message.new_method_return(msg, "v", [value])

    async def _introspect(self, msg: Message) -> Message:
        path = msg.path or ""
        body = self._introspection.get(path)
        if body is None:
            body = body_bytes("s", self._node(path).tostring())
            if path in ANCESTORS or path in self.allocations:
                self._introspection[path] = body  # a bounded set: the objects and above them
        return Prepared(msg, "s", body)

    def _node(self, path: str) -> intr.Node:
        """The introspection of ``path``: its interfaces, and its children's names."""
        obj = self.manager if path == PATH else self.allocations.get(path)
        node = intr.Node.default(path) if obj is not None else intr.Node(path)
        if obj is not None:
            node.interfaces.append(obj.introspect())
        if path in ANCESTORS:
            prefix = path.rstrip("/") + "/"
            paths = [*self.allocations, *([PATH] if self.manager is not None else [])]
            node.nodes = [intr.Node(name) for name in sorted(
                {p[len(prefix):].split("/", 1)[0] for p in paths if p.startswith(prefix)})]
        return node


def _gone(msg: Message) -> Message:
    """The answer to a read of an allocation released while the read waited (as dbus-fast
    answers a path with no object)."""
    return Message.new_error(msg, ErrorType.UNKNOWN_OBJECT.value,
                             f'no interfaces at path: "{msg.path}"')


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Keys of values: the same objects (values that are replaced, never changed), or equal
    mappings (the partition reports, copied for every snapshot)."""
    return len(a) == len(b) and all(x is y or (isinstance(x, Mapping) and x == y)
                                    for x, y in zip(a, b, strict=True))


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


IN_TURN: set[str] = set()  # the Manager's methods that take turns (their names)


def in_turn(fn: F) -> F:
    """A Manager method anyone may call (Plan, Capacity, ...) runs in its caller's turn, like
    the bulk reads (inside ``boundary``: a refusal is LimitExceeded). It has no effect but its
    answer: a call that wants none is not run (``Reads.handler``)."""
    IN_TURN.add(fn.__name__)

    @functools.wraps(fn)
    async def wrapper(self: Any, *args: Any) -> Any:
        try:
            async with self.reads.turns.turn(await self.reads.caller(current_call.get()[0])):
                return await fn(self, *args)
        except Refused as exc:
            raise LimitExceeded(str(exc)) from None
    return wrapper  # type: ignore[return-value]
