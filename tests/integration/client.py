"""A host-side dbus-fast client of the daemon in the container (signals, concurrency)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

DEST, PATH, IFACE = "org.cpuservice1", "/org/cpuservice1", "org.cpuservice1.Manager"


class CallError(Exception):
    def __init__(self, name: str, text: str) -> None:
        super().__init__(f"{name}: {text}")
        self.name = name
        self.text = text


async def connect(address: str) -> MessageBus:
    return await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()


async def call(
    bus: MessageBus, member: str, signature: str = "", body: Sequence[Any] = (),
    path: str = PATH, interface: str = IFACE,
) -> list[Any]:
    reply = await bus.call(Message(destination=DEST, path=path, interface=interface,
                                   member=member, signature=signature, body=list(body)))
    assert reply is not None
    if reply.message_type == MessageType.ERROR:
        raise CallError(reply.error_name or "", reply.body[0] if reply.body else "")
    return list(reply.body)


class Signals:
    """Collects the daemon's signals from the moment it is started."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self.seen: list[tuple[str, str, list[Any]]] = []

    async def start(self) -> Signals:
        await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="AddMatch", signature="s",
            body=[f"type='signal',sender='{DEST}'"]))
        self.bus.add_message_handler(self._on)
        return self

    def _on(self, msg: Message) -> bool:
        if msg.message_type == MessageType.SIGNAL and msg.path and msg.path.startswith(PATH):
            self.seen.append((msg.member or "", msg.path, list(msg.body)))
        return False

    async def settle(self, seconds: float = 0.3) -> list[tuple[str, str, list[Any]]]:
        await asyncio.sleep(seconds)
        return self.seen
