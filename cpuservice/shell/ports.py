"""The shell's ports: what the engine asks of systemd and of the kernel, and what it tells the
bus after each committed change. The adapters (cpuservice.host.systemd, cpuservice.host.irqs) and
the unit
tests' fakes implement them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any, NamedTuple, Protocol

from cpuservice.host.irqs import Report
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.props import Props

UNIT_IFACE = "org.freedesktop.systemd1.Unit"
_TYPE_IFACE = {"slice": "Slice", "scope": "Scope", "service": "Service", "socket": "Socket",
               "mount": "Mount", "swap": "Swap"}


def cgroup_iface(unit: str) -> str:
    return f"org.freedesktop.systemd1.{_TYPE_IFACE[unit.rsplit('.', 1)[1]]}"


class SystemdAPI(Protocol):
    """What cpuservice asks of systemd."""

    on_unit_removed: Callable[[str], None]
    on_unit_new: Callable[[str], None]
    on_unit_state: Callable[[str, str], None]

    async def start_transient(self, unit: str, props: Props) -> None: ...
    async def set_properties(self, unit: str, props: Props, missing_ok: bool = False) -> None: ...
    async def stop(self, unit: str) -> None: ...
    async def remove_overrides(self, unit: str, names: Sequence[str]) -> None: ...
    async def unit_path(self, unit: str) -> str | None: ...
    async def load_state(self, unit: str) -> str: ...
    async def manager_version(self) -> str: ...
    async def get(self, unit: str, interface: str, names: Iterable[str]) -> dict[str, Any]: ...
    async def list_units(self, patterns: Sequence[str]) -> list[tuple[str, str]]: ...
    async def processes(self, unit: str) -> list[int]: ...
    async def member_units(self, unit: str) -> set[str]: ...
    async def watch_unit(self, unit_path: str) -> None: ...
    async def unwatch_unit(self, unit_path: str) -> None: ...


class KernelAPI(Protocol):
    """What cpuservice asks of the kernel for isolation beyond cgroups (cpuservice.host.irqs)."""

    report: Report

    async def set_cpus(self, holder: str, cpus: CPUSet) -> None: ...
    async def set_many(self, wants: Mapping[str, CPUSet]) -> None: ...
    async def get_cpus(self, holder: str) -> CPUSet | None: ...
    async def settle(self) -> None: ...
    async def release(self, holder: str) -> None: ...
    def devices(self) -> list[str]: ...


class Kind(StrEnum):
    """What a committed change tells the bus, one event each: the Events method it goes to."""

    ADDED = "allocation_added"
    REMOVED = "allocation_removed"
    CHANGED = "allocation_changed"
    MOVED = "allocation_moved"
    POOLS = "pools_changed"
    MANAGER = "manager_changed"


class Event(NamedTuple):
    """One event, as a value: its kind and the arguments of its Events method."""

    kind: Kind
    args: tuple[Any, ...]


class Events(Protocol):
    """What the bus layer is told after each committed change, with the values to publish."""

    def allocation_added(self, name: str, values: Mapping[str, Any]) -> None: ...
    def allocation_removed(self, name: str) -> None: ...
    def allocation_changed(self, name: str, reason: str, changed: Mapping[str, Any]) -> None: ...
    def allocation_moved(self, name: str, old: str, new: str) -> None: ...
    def pools_changed(self, shared: str, exclusive: str, fragment: str) -> None: ...
    def manager_changed(self, changed: Mapping[str, Any], invalidated: Sequence[str]) -> None: ...


class Preparing(Events, Protocol):
    """A sink that can do ahead what delivering an event will ask of it (the bus: make the
    object to export and marshal the signals), while systemd applies its change; ``first``:
    the first event of a change (what was made for an earlier change goes). Nothing it does
    ahead may be seen: a change that fails is never delivered."""

    def prepare(self, event: Event, first: bool) -> None: ...


def deliver(sink: Events, event: Event) -> None:
    """Hand ``event`` to ``sink``'s method for its kind."""
    getattr(sink, event.kind)(*event.args)


class Fanout:
    """The engine's events, handed to every subscribed sink in turn (the bus; tests' recorders).
    Sinks that only need to know that something changed (the status line, the metrics file)
    subscribe to Engine.on_committed instead."""

    def __init__(self) -> None:
        self.sinks: list[Events] = []

    def prepare(self, event: Event, first: bool) -> None:
        """Each sink that prepares (Preparing) makes ready for ``event``."""
        for sink in self.sinks:
            ready = getattr(sink, "prepare", None)
            if ready is not None:
                ready(event, first)

    def allocation_added(self, name: str, values: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.allocation_added(name, values)

    def allocation_removed(self, name: str) -> None:
        for sink in self.sinks:
            sink.allocation_removed(name)

    def allocation_changed(self, name: str, reason: str, changed: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.allocation_changed(name, reason, changed)

    def allocation_moved(self, name: str, old: str, new: str) -> None:
        for sink in self.sinks:
            sink.allocation_moved(name, old, new)

    def pools_changed(self, shared: str, exclusive: str, fragment: str) -> None:
        for sink in self.sinks:
            sink.pools_changed(shared, exclusive, fragment)

    def manager_changed(self, changed: Mapping[str, Any], invalidated: Sequence[str]) -> None:
        for sink in self.sinks:
            sink.manager_changed(changed, invalidated)
