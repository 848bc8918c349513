"""One method call on a dbus-fast bus, with the reply's error turned into an exception."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dbus_fast import Message, MessageFlag, MessageType
from dbus_fast.aio import MessageBus

BUS = ("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus")


class CallError(Exception):
    """The peer answered with a D-Bus error (or not at all)."""

    def __init__(self, name: str, text: str) -> None:
        super().__init__(text)
        self.name = name
        self.text = text


async def call(
    bus: MessageBus,
    destination: str,
    path: str,
    interface: str,
    member: str,
    signature: str = "",
    body: Sequence[Any] = (),
    flags: MessageFlag = MessageFlag.NONE,
) -> list[Any]:
    """The reply's body; CallError when the reply is an error."""
    reply = await bus.call(Message(destination=destination, path=path, interface=interface,
                                   member=member, signature=signature, body=list(body),
                                   flags=flags))
    if reply is None:
        raise CallError("org.freedesktop.DBus.Error.NoReply", f"no reply to {member}")
    if reply.message_type == MessageType.ERROR:
        text = str(reply.body[0]) if reply.body else reply.error_name or "failed"
        raise CallError(reply.error_name or "", text)
    return list(reply.body)


class NameOwner:
    """The unique name that owns a well-known bus name now, followed through the bus daemon's
    NameOwnerChanged. A signal is trusted only when it comes from that unique name: any local
    user can send a signal with any path, interface and member to any connection."""

    def __init__(self, bus: MessageBus, name: str) -> None:
        self.bus = bus
        self.name = name
        self.unique: str | None = None

    async def follow(self) -> None:
        self.bus.add_message_handler(self._on_message)
        await call(self.bus, *BUS, "AddMatch", "s", [
            f"type='signal',sender='{BUS[0]}',interface='{BUS[2]}',"
            f"member='NameOwnerChanged',arg0='{self.name}'"])
        try:
            (owner,) = await call(self.bus, *BUS, "GetNameOwner", "s", [self.name])
        except CallError:
            return  # nobody owns it now; NameOwnerChanged tells when somebody does
        self.unique = str(owner)

    def _on_message(self, msg: Message) -> bool:
        if (msg.message_type == MessageType.SIGNAL and msg.sender == BUS[0]
                and msg.member == "NameOwnerChanged" and msg.body
                and msg.body[0] == self.name):
            self.unique = str(msg.body[2]) or None
        return False

    def sent(self, msg: Message) -> bool:
        """Whether ``msg`` comes from the name's current owner."""
        return msg.sender is not None and msg.sender == self.unique
