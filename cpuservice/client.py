"""A small asyncio client of org.cpuservice1, shared by cpuservicectl and cpuservice-run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dbus_fast import BusType, MessageFlag, Variant
from dbus_fast.aio import MessageBus

from . import dbuscall

DEST = "org.cpuservice1"
PATH = "/org/cpuservice1"
MANAGER = "org.cpuservice1.Manager"
ALLOCATION = "org.cpuservice1.Allocation"
PROPERTIES = "org.freedesktop.DBus.Properties"
NO_QUOTA = 2**64 - 1
UNLIMITED = 2**32 - 1

# exit codes, as cpuservicectl documents them
EXIT_FAILURE, EXIT_USAGE, EXIT_NO_SUCH, EXIT_NO_CPUS, EXIT_DENIED = 1, 2, 4, 5, 13
EXIT_BY_ERROR = {
    "org.cpuservice1.Error.NoSuchAllocation": EXIT_NO_SUCH,
    "org.cpuservice1.Error.InsufficientCPUs": EXIT_NO_CPUS,
    "org.freedesktop.DBus.Error.AccessDenied": EXIT_DENIED,
    "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired": EXIT_DENIED,
    "org.cpuservice1.Error.InvalidArgument": EXIT_USAGE,
}


def exit_code(error: dbuscall.CallError) -> int:
    """The exit code the command-line tools give an error reply."""
    return EXIT_BY_ERROR.get(error.name, EXIT_FAILURE)


def variants(options: Mapping[str, Any]) -> dict[str, Variant]:
    """Allocate options as D-Bus variants (bool -> b, everything else -> s)."""
    return {k: Variant("b", v) if isinstance(v, bool) else Variant("s", str(v))
            for k, v in options.items()}


def unwrap(value: Any) -> Any:
    if isinstance(value, Variant):
        return unwrap(value.value)
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [unwrap(v) for v in value]
    return value


class Client:
    def __init__(self, bus: MessageBus, interactive: bool = True) -> None:
        self.bus = bus
        self.flags = MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if interactive else \
            MessageFlag.NONE

    @classmethod
    async def connect(cls, address: str | None = None, interactive: bool = True) -> Client:
        bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
        return cls(bus, interactive)

    def close(self) -> None:
        self.bus.disconnect()

    async def call(
        self, member: str, signature: str = "", body: Sequence[Any] = (), path: str = PATH,
        interface: str = MANAGER,
    ) -> list[Any]:
        return await dbuscall.call(self.bus, DEST, path, interface, member, signature, body,
                                   self.flags)

    async def properties(self, path: str = PATH, interface: str = MANAGER) -> dict[str, Any]:
        (values,) = await self.call("GetAll", "s", [interface], path=path, interface=PROPERTIES)
        return {k: unwrap(v) for k, v in values.items()}

    async def allocations(self) -> list[dict[str, Any]]:
        """Every allocation with all its properties."""
        (rows,) = await self.call("ListAllocations")
        return [await self.properties(row[4], ALLOCATION) | {"Path": row[4]} for row in rows]

    async def allocate(self, name: str, cpus: str, options: Mapping[str, Any]) -> str:
        (path,) = await self.call("Allocate", "ssa{sv}", [name, cpus, variants(options)])
        return str(path)

    async def attach(self, name: str, pids: Sequence[int]) -> str:
        (unit,) = await self.call("Attach", "sau", [name, list(pids)])
        return str(unit)

    async def release(self, name: str) -> None:
        await self.call("Release", "s", [name])
