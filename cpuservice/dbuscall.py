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
