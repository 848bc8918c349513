"""A change's events are derived, and its signals made, while systemd applies it (issue 40):
delivered as made when nothing they depend on changed meanwhile, derived again when something
did, never when the change fails; and a signal made ahead goes out byte for byte as dbus-fast
would have marshalled it."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from dbus_fast import Message, Variant

from cpuservice.bus import signals
from cpuservice.bus.objects import ALLOCATION_SIGNATURES, PATH, path_of
from cpuservice.model.errors import SystemdFailure
from cpuservice.shell.ports import Event, Kind
from tests.unit.test_service_fake import Host

BIND = {"bind": True}
MANAGER_SIGNATURES = {"SharedCPUs": "s", "FreeCPUs": "d", "Topology": "s"}


class Preparer:
    """A Preparing sink that keeps what it is handed ahead and what it is delivered."""

    def __init__(self) -> None:
        self.prepared: list[list[Event]] = []
        self.delivered: list[Event] = []

    def prepare(self, event: Event, first: bool) -> None:
        if first:
            self.prepared.append([])
        self.prepared[-1].append(event)

    def __getattr__(self, kind: str) -> Any:
        if kind not in set(Kind):
            raise AttributeError(kind)
        return lambda *args: self.delivered.append(Event(Kind(kind), args))


class Gate:
    """Holds the fake systemd's StartTransientUnit until opened (systemd applying a change)."""

    def __init__(self, host: Host) -> None:
        self.reached, self.open = asyncio.Event(), asyncio.Event()
        start = host.fake.start_transient

        async def held(unit: str, props: Any) -> None:
            self.reached.set()
            await self.open.wait()
            await start(unit, props)

        host.fake.start_transient = held  # type: ignore[method-assign]


async def held(tmp_path: Path, fail_at: int = 0
               ) -> tuple[Any, Preparer, Gate, asyncio.Future[Any]]:
    """A bound Allocate whose new slice's start systemd holds (Gate), a Preparer its one sink,
    once its events had their turns; ``fail_at``: the fake's mutating call that fails."""
    host = Host(tmp_path)
    svc = await host.service()
    svc.events = sink = Preparer()
    gate = Gate(host)
    if fail_at:
        host.fake.fail_at(fail_at)
    call = asyncio.ensure_future(svc.allocate("b1", "1", BIND, 0))
    await gate.reached.wait()
    for _ in range(8):  # one event a turn of the loop
        await asyncio.sleep(0)
    return svc, sink, gate, call


def test_the_events_are_prepared_while_systemd_applies_the_change(tmp_path: Path) -> None:
    async def body() -> None:
        _, sink, gate, call = await held(tmp_path)
        assert [e.kind for e in sink.prepared[-1]] == [Kind.ADDED, Kind.POOLS, Kind.MANAGER]
        assert sink.delivered == []  # nothing is seen before the change is applied
        gate.open.set()
        await call
        assert sink.delivered == sink.prepared[-1]
        assert all(x is y for a, b in zip(sink.delivered, sink.prepared[-1], strict=True)
                   for x, y in zip(a.args, b.args, strict=True))  # these very values
    asyncio.run(body())


def test_events_are_derived_again_when_the_strain_changed_meanwhile(tmp_path: Path) -> None:
    async def body() -> None:
        svc, sink, gate, call = await held(tmp_path)
        (prepared,) = [e for e in sink.prepared[-1] if e.kind is Kind.ADDED]
        assert prepared.args[1]["HealthReason"] == ""
        svc.engine.strain = MappingProxyType({"b1": ("pressured",)})  # the figures, meanwhile
        gate.open.set()
        await call
        (added,) = [e for e in sink.delivered if e.kind is Kind.ADDED]
        assert added.args[1]["HealthReason"].startswith("pressured")
    asyncio.run(body())


def test_a_failed_change_delivers_nothing_it_prepared(tmp_path: Path) -> None:
    async def body() -> None:
        # the shared slice shrinks, the new slice is refused
        svc, sink, gate, call = await held(tmp_path, fail_at=2)
        assert [e.kind for e in sink.prepared[-1]] == [Kind.ADDED, Kind.POOLS, Kind.MANAGER]
        gate.open.set()
        with pytest.raises(SystemdFailure):
            await call
        assert sink.delivered == []
        assert "b1" not in svc.ledger.allocations
    asyncio.run(body())


def test_nothing_is_prepared_before_the_last_calls_are_sent(tmp_path: Path) -> None:
    """The steps wait for the transaction's last group (the new slice's start): the write of
    the shared slice before it is not held up by them."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        svc.events = sink = Preparer()
        seen: list[int] = []
        set_properties = host.fake.set_properties

        async def counted(unit: str, props: Any, missing_ok: bool = False) -> None:
            seen.append(len(sink.prepared))
            for _ in range(8):  # systemd working on it: turns of the loop go by
                await asyncio.sleep(0)
            seen.append(len(sink.prepared))
            await set_properties(unit, props, missing_ok)

        host.fake.set_properties = counted  # type: ignore[method-assign]
        gate = Gate(host)
        call = asyncio.ensure_future(svc.allocate("b1", "1", BIND, 0))
        await gate.reached.wait()
        for _ in range(8):
            await asyncio.sleep(0)
        gate.open.set()
        await call
        assert seen == [0, 0] and len(sink.prepared) == 1
    asyncio.run(body())


EVENTS = [
    Event(Kind.ADDED, ("b1", {"Name": "b1", "CPUs": "1", "Bound": True, "Shares": {3: 1000},
                              "NearDevices": [["gpu0", 0, "gpu", "pci", ""]]})),
    Event(Kind.REMOVED, ("b1",)),
    Event(Kind.CHANGED, ("b1", "moved", {"CPUSet": "3", "Shares": {3: 1000}})),
    Event(Kind.CHANGED, ("b1", "health", {})),
    Event(Kind.MOVED, ("b1", "2", "3")),
    Event(Kind.POOLS, ("0-1,4-7", "2-3", "")),
    Event(Kind.MANAGER, ({"SharedCPUs": "0-1", "FreeCPUs": 2.5}, ["Topology"])),
]


def plain(event: Event) -> list[Message]:
    """What the bus layer sent for ``event`` before signals were made ahead (dbus-fast's own
    signal and PropertiesChanged marshalling)."""
    kind, args = event
    name = args[0]

    def manager(member: str, sig: str, body: list[Any]) -> Message:
        return Message.new_signal(PATH, signals.MANAGER_IFACE, member, sig, body)

    def props(path: str, iface: str, sigs: dict[str, str], changed: dict[str, Any],
              invalidated: list[str]) -> Message:
        return Message.new_signal(path, signals.PROPERTIES, "PropertiesChanged", "sa{sv}as", [
            iface, {k: Variant(sigs[k], changed[k]) for k in sorted(changed)}, invalidated])

    if kind is Kind.ADDED:
        body = {k: Variant(ALLOCATION_SIGNATURES[k], v) for k, v in args[1].items()}
        return [manager("AllocationAdded", "so", [name, path_of(name)]),
                Message.new_signal(PATH, signals.OBJECT_MANAGER, "InterfacesAdded",
                                   "oa{sa{sv}}", [path_of(name), {signals.ALLOCATION_IFACE: body}])]
    if kind is Kind.REMOVED:
        return [manager("AllocationRemoved", "so", [name, path_of(name)]),
                Message.new_signal(PATH, signals.OBJECT_MANAGER, "InterfacesRemoved", "oas",
                                   [path_of(name), [signals.ALLOCATION_IFACE]])]
    if kind is Kind.CHANGED:
        out = [props(path_of(name), signals.ALLOCATION_IFACE, ALLOCATION_SIGNATURES, args[2],
                     [])] if args[2] else []
        return [*out, manager("AllocationChanged", "sos", [name, path_of(name), args[1]])]
    if kind is Kind.MOVED:
        return [manager("AllocationMoved", "soss", [name, path_of(name), args[1], args[2]])]
    if kind is Kind.POOLS:
        return [manager("PoolsChanged", "sss", list(args))]
    return [props(PATH, signals.MANAGER_IFACE, MANAGER_SIGNATURES, args[0], list(args[1]))]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: f"{e.kind}-{len(e.args[-1])}")
def test_a_signal_made_ahead_is_sent_as_dbus_fast_marshals_it(event: Event) -> None:
    made, want = signals.messages(event, MANAGER_SIGNATURES), plain(event)
    assert len(made) == len(want)
    for serial, (a, b) in enumerate(zip(made, want, strict=True), start=70000):
        a.serial = b.serial = serial  # what sending does
        assert bytes(a._marshall(False)) == bytes(b._marshall(False))


def test_the_outbox_sends_what_it_made_only_for_the_very_values() -> None:
    made: list[str] = []

    def new_object(name: str) -> Any:
        made.append(name)
        return object()

    outbox = signals.Outbox(new_object, lambda: pytest.fail("no MANAGER event here"))
    values = {"Name": "b1"}
    outbox.prepare(Event(Kind.ADDED, ("b0", {})), True)  # an earlier change's: it goes
    outbox.prepare(Event(Kind.ADDED, ("b1", values)), True)
    outbox.prepare(Event(Kind.POOLS, ("0-1", "2", "")), False)
    assert made == ["b0", "b1"] and (Kind.ADDED, "b0") not in outbox._ready
    ahead = outbox._ready[(Kind.ADDED, "b1")][1]
    pools = outbox._ready[(Kind.POOLS, "")][1][1]
    assert outbox.take(Kind.ADDED, "b1", values) is ahead and made == ["b0", "b1"]
    assert outbox.take(Kind.ADDED, "b1", values) is not ahead  # taken once: made again
    assert made == ["b0", "b1", "b1"]
    _, other = outbox.take(Kind.POOLS, "0-3", "", "")  # other values: made for them
    assert other is not pools and bytes(other[0].body[0], "ascii") == b"0-3"
    assert outbox._ready == {}


def test_the_manager_sends_what_dbus_fast_itself_sends(tmp_path: Path) -> None:
    """Side by side on one Bus (not connected: what it would send is kept): the signals the
    Manager made ahead for an Allocate and a Resize, and the ones dbus-fast's own @signal and
    emit_properties_changed send for the same values, byte for byte."""
    from cpuservice.bus.api import Bus, Manager
    from cpuservice.host.authz import Authority

    async def body() -> None:
        host = Host(tmp_path, "c")
        svc = await host.service()
        listening = socket.socket(socket.AF_UNIX)  # dbus-fast 1.84 connects when made
        listening.bind(str(tmp_path / "bus"))
        listening.listen()
        bus = Bus(bus_address=f"unix:path={tmp_path / 'bus'}")
        sent: list[Message] = []
        bus.send = sent.append  # type: ignore[method-assign,assignment]
        manager = Manager(svc, bus, Authority(bus))
        manager.export_all()
        svc.subscribe(events := Preparer())
        await svc.allocate("b1", "1", BIND, 0)
        await svc.resize("b1", "2")
        ours, sent[:] = list(sent), []
        for event in events.delivered:  # dbus-fast's own, for the same values
            kind, args = event
            if kind is Kind.ADDED:
                manager.AllocationAdded(args[0], path_of(args[0]))
            elif kind is Kind.CHANGED:
                manager.objects[args[0]].emit_properties_changed(dict(args[2]))
                manager.AllocationChanged(args[0], path_of(args[0]), args[1])
            elif kind is Kind.POOLS:
                manager.PoolsChanged(*args)
            elif kind is Kind.MANAGER:
                manager.emit_properties_changed(dict(args[0]), list(args[1]))
        theirs = list(sent)
        ours = [m for m in ours if m.member != "InterfacesAdded"]  # (never dbus-fast's)
        assert [m.member for m in ours] == [m.member for m in theirs]
        assert "PropertiesChanged" in [m.member for m in ours if m.path != PATH]
        for serial, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
            a.serial = b.serial = serial
            assert bytes(a._marshall(False)) == bytes(b._marshall(False)), a.member
        listening.close()
    asyncio.run(body())


def test_an_unexported_allocation_object_is_made_over_for_the_next(tmp_path: Path) -> None:
    """Made over, not made again (dbus-fast walks the class's members for each one made): the
    object of a released allocation serves the next one, at its own path, with its values."""
    from cpuservice.bus.api import Bus, Manager
    from cpuservice.host.authz import Authority

    async def body() -> None:
        host = Host(tmp_path, "c")
        svc = await host.service()
        listening = socket.socket(socket.AF_UNIX)
        listening.bind(str(tmp_path / "bus"))
        listening.listen()
        bus = Bus(bus_address=f"unix:path={tmp_path / 'bus'}")
        bus.send = lambda message: None  # type: ignore[method-assign,assignment,return-value]
        manager = Manager(svc, bus, Authority(bus))
        manager.export_all()
        await svc.allocate("b1", "1", BIND, 0)
        first = manager.objects["b1"]
        await svc.release("b1")
        assert "b1" not in manager.objects and path_of("b1") not in bus._path_exports
        await svc.allocate("b2", "2", BIND, 0)
        assert manager.objects["b2"] is first and first.allocation == "b2"
        assert first.values()["CPUs"] == "2" and first.values()["Name"] == "b2"
        assert path_of("b2") in bus._path_exports
        listening.close()
    asyncio.run(body())
