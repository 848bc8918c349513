"""The signals a committed change sends (issue 40): each event (cpuservice.shell.ports.Event)
as the messages it sends and the object it exports, made while systemd applies the change
(``Outbox.prepare``) and sent when it is delivered, or made then (an event not prepared, or
prepared for other values). Marshalled when made (``Ready``): sending writes the serial in.
Between a bound Allocate's calls to systemd and its reply this was 0.5 ms of the daemon's
time in the container host.
(No ``from __future__ import annotations`` here, as in the other modules of the bus.)
"""

from collections.abc import Callable, Mapping
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast import introspection as intr
from dbus_fast.service import ServiceInterface

from cpuservice.bus.objects import ALLOCATION_SIGNATURES, PATH, path_of
from cpuservice.shell.ports import Event, Kind

MANAGER_IFACE = "org.cpuservice1.Manager"
ALLOCATION_IFACE = "org.cpuservice1.Allocation"
OBJECT_MANAGER = "org.freedesktop.DBus.ObjectManager"
PROPERTIES = "org.freedesktop.DBus.Properties"
Made = tuple[ServiceInterface | None, list[Message]]


class Ready(Message):
    """A signal marshalled when it is made and sent later: sending writes its serial in (bytes
    8-11 of the header, little-endian as dbus-fast marshals), the rest is as made."""

    def __init__(self, path: str, interface: str, member: str, signature: str,
                 body: list[Any]) -> None:
        super().__init__(message_type=MessageType.SIGNAL, path=path, interface=interface,
                         member=member, signature=signature, body=body)
        self.ready = bytes(super()._marshall(False))

    def _marshall(self, negotiate_unix_fd: bool) -> bytearray:
        out = bytearray(self.ready)
        out[8:12] = self.serial.to_bytes(4, "little")
        return out


def properties_changed(path: str, interface: str, signatures: Mapping[str, str],
                       changed: Mapping[str, Any], invalidated: list[str]) -> Message:
    """PropertiesChanged of ``interface`` at ``path``, the properties by name (as dbus-fast
    lists them; a name the interface does not declare is left out, as dbus-fast does)."""
    values = {name: Variant(signatures[name], changed[name]) for name in sorted(changed)
              if name in signatures}
    return Ready(path, PROPERTIES, "PropertiesChanged", "sa{sv}as",
                 [interface, values, invalidated])


def _manager(member: str, signature: str, body: list[Any]) -> Message:
    return Ready(PATH, MANAGER_IFACE, member, signature, body)


def messages(event: Event, manager_signatures: Mapping[str, str]) -> list[Message]:
    """What ``event`` sends, in order: the Manager's own signal, PropertiesChanged, and the
    ObjectManager's (from /org/cpuservice1, as the D-Bus specification has them)."""
    kind, args = event
    name = args[0]
    if kind is Kind.ADDED:
        body = {k: Variant(ALLOCATION_SIGNATURES[k], v) for k, v in args[1].items()}
        return [_manager("AllocationAdded", "so", [name, path_of(name)]),
                Ready(PATH, OBJECT_MANAGER, "InterfacesAdded", "oa{sa{sv}}",
                      [path_of(name), {ALLOCATION_IFACE: body}])]
    if kind is Kind.REMOVED:
        return [_manager("AllocationRemoved", "so", [name, path_of(name)]),
                Ready(PATH, OBJECT_MANAGER, "InterfacesRemoved", "oas",
                      [path_of(name), [ALLOCATION_IFACE]])]
    if kind is Kind.CHANGED:
        _, reason, changed = args
        out = [properties_changed(path_of(name), ALLOCATION_IFACE, ALLOCATION_SIGNATURES,
                                  changed, [])] if changed else []
        return [*out, _manager("AllocationChanged", "sos", [name, path_of(name), reason])]
    if kind is Kind.MOVED:
        return [_manager("AllocationMoved", "soss", [name, path_of(name), *args[1:]])]
    if kind is Kind.POOLS:
        return [_manager("PoolsChanged", "sss", list(args))]
    changed, invalidated = args
    return [properties_changed(PATH, MANAGER_IFACE, manager_signatures, changed,
                               list(invalidated))]


def _key(event: Event) -> tuple[Kind, str]:
    """An event's place in a change: one per allocation and kind, one POOLS and MANAGER."""
    return event.kind, event.args[0] if event.kind not in (Kind.POOLS, Kind.MANAGER) else ""


class Outbox:
    """What delivering the events of the change being applied sends. ``new_object``: the
    object an ADDED event exports; ``introspect``: the Manager's interface (its properties'
    signatures)."""

    def __init__(self, new_object: Callable[[str], ServiceInterface],
                 introspect: Callable[[], intr.Interface]) -> None:
        self.new_object = new_object
        self.introspect = introspect
        self._signatures: dict[str, str] | None = None
        self._ready: dict[tuple[Kind, str], tuple[tuple[Any, ...], Made]] = {}

    def prepare(self, event: Event, first: bool) -> None:
        """Make what delivering ``event`` will send. Nothing of it is seen until then; a
        change that fails is never delivered, and what was made for it goes with the
        ``first`` event of the next."""
        if first:
            self._ready.clear()
        self._ready[_key(event)] = (event.args, self._make(event))

    def take(self, kind: Kind, *args: Any) -> Made:
        """What delivering this event sends: made ahead for these very values, or now."""
        event = Event(kind, args)
        ready = self._ready.pop(_key(event), None)
        if ready is not None and len(ready[0]) == len(args) and \
                all(a is b for a, b in zip(ready[0], args, strict=True)):
            return ready[1]
        return self._make(event)

    def _make(self, event: Event) -> Made:
        if self._signatures is None and event.kind is Kind.MANAGER:
            self._signatures = {p.name: p.signature for p in self.introspect().properties}
        obj = self.new_object(event.args[0]) if event.kind is Kind.ADDED else None
        return obj, messages(event, self._signatures or {})
