"""A host-side dbus-fast client of the daemon in the container (signals, concurrency)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from cpuservice.host import dbuscall

DEST, PATH, IFACE = "org.cpuservice1", "/org/cpuservice1", "org.cpuservice1.Manager"
CallError = dbuscall.CallError


async def connect(address: str) -> MessageBus:
    return await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()


async def call(
    bus: MessageBus, member: str, signature: str = "", body: Sequence[Any] = (),
    path: str = PATH, interface: str = IFACE,
) -> list[Any]:
    return await dbuscall.call(bus, DEST, path, interface, member, signature, body)


class Signals:
    """Collects the daemon's signals from the moment it is started."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self.seen: list[tuple[str, str, list[Any]]] = []

    async def start(self) -> Signals:
        await dbuscall.call(self.bus, *dbuscall.BUS, "AddMatch", "s",
                            [f"type='signal',sender='{DEST}'"])
        self.bus.add_message_handler(self._on)
        return self

    def _on(self, msg: Message) -> bool:
        if msg.message_type == MessageType.SIGNAL and msg.path and msg.path.startswith(PATH):
            self.seen.append((msg.member or "", msg.path, list(msg.body)))
        return False

    async def settle(self, seconds: float = 0.3) -> list[tuple[str, str, list[Any]]]:
        await asyncio.sleep(seconds)
        return self.seen
