"""The bus's reads that anyone may make (issue 37, item 1), without a bus: the fair turns
(cpuservice.bus.fair: one at a time, round robin over callers, bounded, a share of the time) and the
prepared replies (cpuservice.bus.reads: the bytes are those dbus-fast would marshal itself).
The same code against a real dbus-daemon and a caller as nobody: tests/integration/
test_bus_flood.py."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from typing import Any

import pytest
from dbus_fast import Message, MessageType, Variant
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.bus.fair import Refused, Turns
from cpuservice.bus.objects import ALLOCATION_SIGNATURES
from cpuservice.bus.reads import MANAGED, Prepared, body_bytes, entry_bytes, managed_body
from tests.props import examples


async def _read(turns: Turns, sender: str, log: list[str], tag: str,
                hold: float = 0.0, until: asyncio.Event | None = None) -> None:
    async with turns.turn(sender):
        log.append(tag)
        if hold:
            time.sleep(hold)  # a read's work: synchronous, as a reply's build is
        await (until.wait() if until else asyncio.sleep(0))  # then the reply is written


def test_reads_take_turns_round_robin_over_connections() -> None:
    async def body() -> list[str]:
        turns, log, written = Turns(share=1.0), list[str](), asyncio.Event()
        first = asyncio.ensure_future(_read(turns, ":1.1", log, "a0", until=written))
        await asyncio.sleep(0)
        many = [asyncio.ensure_future(_read(turns, ":1.1", log, f"a{i}")) for i in range(1, 5)]
        one = asyncio.ensure_future(_read(turns, ":1.2", log, "b0"))
        await asyncio.sleep(0)  # all of them wait
        written.set()
        await asyncio.gather(first, *many, one)
        return log

    # the second connection's one read goes after the first's current read, not after its five
    assert asyncio.run(body()) == ["a0", "a1", "b0", "a2", "a3", "a4"]


def test_what_is_ready_runs_between_two_reads() -> None:
    async def body() -> list[str]:
        turns, log = Turns(share=1.0), list[str]()
        reads = [asyncio.ensure_future(_read(turns, ":1.1", log, f"r{i}")) for i in range(3)]
        await asyncio.sleep(0)  # r0 runs
        asyncio.get_running_loop().call_soon(log.append, "timer")
        await asyncio.gather(*reads)
        return log

    assert asyncio.run(body()) == ["r0", "timer", "r1", "r2"]


def test_reads_take_at_most_their_share_of_the_loop() -> None:
    async def body() -> float:
        turns, log = Turns(share=0.5), list[str]()
        start = time.monotonic()
        await asyncio.gather(*(_read(turns, ":1.1", log, "r", hold=0.02) for _ in range(5)))
        return time.monotonic() - start

    # five reads of 20 ms with a pause as long after each of the first four: >= 180 ms
    assert asyncio.run(body()) >= 0.17


def test_a_connection_may_have_so_many_reads_waiting() -> None:
    async def body() -> tuple[int, str]:
        turns, log = Turns(per_caller=3, share=1.0), list[str]()
        reads = [asyncio.ensure_future(_read(turns, ":1.1", log, "r")) for _ in range(5)]
        done = await asyncio.gather(*reads, return_exceptions=True)
        refused = [r for r in done if isinstance(r, Refused)]
        return len(refused), str(refused[0])

    refused, why = asyncio.run(body())
    assert refused == 2 and "at most 3" in why


def test_a_connections_first_read_is_never_refused() -> None:
    async def body() -> tuple[list[object], list[str]]:
        turns, log = Turns(total=2, share=1.0), list[str]()
        hog = [asyncio.ensure_future(_read(turns, ":1.1", log, "hog")) for _ in range(5)]
        other = asyncio.ensure_future(_read(turns, ":1.2", log, "other"))
        done = await asyncio.gather(*hog, other, return_exceptions=True)
        return done, log

    done, log = asyncio.run(body())
    assert sum(isinstance(r, Refused) for r in done) == 2  # the hog's 4th and 5th
    assert "other" in log and done[-1] is None


def test_a_cancelled_wait_passes_the_turn_on() -> None:
    async def body() -> tuple[list[str], Turns]:
        turns, log = Turns(share=1.0), list[str]()
        first = asyncio.ensure_future(_read(turns, ":1.1", log, "a", hold=0.01))
        gone = asyncio.ensure_future(_read(turns, ":1.2", log, "gone"))
        last = asyncio.ensure_future(_read(turns, ":1.3", log, "c"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(first, last)
        with pytest.raises(asyncio.CancelledError):
            await gone
        return log, turns

    log, turns = asyncio.run(body())
    assert log == ["a", "c"]
    assert turns.pending(":1.1") == turns.pending(":1.2") == turns.pending(":1.3") == 0


# ---- prepared replies: the bytes dbus-fast would marshal ----

TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
VALUES = st.fixed_dictionaries({
    "Name": TEXT, "CPUs": TEXT, "Bound": st.booleans(), "CPUSet": TEXT,
    "Shares": st.dictionaries(st.integers(0, 4095), st.integers(1, 100), max_size=4),
    "CPUQuotaPerSecUSec": st.integers(0, 2**64 - 1), "Owner": st.integers(0, 2**32 - 1),
    "Aligned": st.booleans(), "HealthReason": TEXT,
})
NAMES = st.lists(st.text("abcdefgh_0123456789", min_size=1, max_size=12), unique=True,
                 max_size=6)


def _variants(values: dict[str, Any]) -> dict[str, Variant]:
    return {k: Variant(ALLOCATION_SIGNATURES[k], v) for k, v in values.items()}


def _call() -> Message:
    return Message(message_type=MessageType.METHOD_CALL, destination="org.cpuservice1",
                   path="/org/cpuservice1", interface="org.freedesktop.DBus.ObjectManager",
                   member="GetManagedObjects", serial=41, sender=":1.7")


@settings(max_examples=examples(60))
@given(names=NAMES, values=st.lists(VALUES, min_size=6, max_size=6))
def test_a_prepared_reply_is_the_reply_dbus_fast_marshals(names: list[str],
                                                          values: list[dict[str, Any]]) -> None:
    objects = {f"/org/cpuservice1/allocation/{n}": {"org.cpuservice1.Allocation": _variants(v)}
               for n, v in zip(names, values[:len(names)], strict=True)}
    call = _call()
    want = Message.new_method_return(call, MANAGED, [objects])
    want.serial = 9
    got = Prepared(call, MANAGED, managed_body(
        entry_bytes(p, ifaces) for p, ifaces in objects.items()))
    got.serial = 9
    assert got._marshall(False) == want._marshall(False)
    one = _variants(values[0])
    want = Message.new_method_return(call, "a{sv}", [one])
    want.serial = 10
    got = Prepared(call, "a{sv}", body_bytes("a{sv}", one))
    got.serial = 10
    assert got._marshall(False) == want._marshall(False)


def test_an_empty_prepared_reply() -> None:
    call = _call()
    want = Message.new_method_return(call, MANAGED, [{}])
    got = Prepared(call, MANAGED, managed_body(()))
    want.serial = got.serial = 3
    assert got._marshall(False) == want._marshall(False)


def test_a_callers_pause_holds_up_no_other_caller() -> None:
    async def body() -> tuple[float, list[str]]:
        turns, log = Turns(share=1.0, rate=1e6), list[str]()

        async def hog(i: int) -> None:  # a megabyte reply each: a second's pause after it
            async with turns.turn("uid 65534") as turn:
                log.append(f"hog{i}")
                turn.sent = 1_000_000
                await asyncio.sleep(0)

        hogs = [asyncio.ensure_future(hog(i)) for i in range(3)]
        await asyncio.sleep(0.01)  # the first hog read is done, the hog rests
        start = time.monotonic()
        await _read(turns, "uid 1000", log, "other")
        waited = time.monotonic() - start
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        return waited, log

    waited, log = asyncio.run(body())
    assert log == ["hog0", "other"] and waited < 0.1


def test_the_bus_finds_an_objects_path_without_a_walk_and_sends_no_object_manager_signals(
        ) -> None:
    """Issue 40: signals and unexport found an interface's path by walking every export; the
    Bus keeps an index instead. Its own InterfacesAdded/Removed (from the object's path) stay
    suppressed: the Manager sends them from /org/cpuservice1."""
    from dbus_fast.service import ServiceInterface, signal

    from cpuservice.bus.objects import Bus

    class Thing(ServiceInterface):
        def __init__(self) -> None:
            super().__init__("org.example.Thing")

        @signal()
        def Poked(self) -> "s":  # noqa: UP037, F821 - a D-Bus signature, not a type
            return "poked"

    async def body() -> None:
        with tempfile.TemporaryDirectory() as tmp:  # a socket to connect to; nobody answers
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(f"{tmp}/bus")
            listener.listen()
            bus = Bus(bus_address=f"unix:path={tmp}/bus")
            listener.close()
        sent: list[Message] = []
        bus.send = sent.append  # type: ignore[method-assign,assignment]
        bus._disconnected = False  # dbus-fast sends its own ObjectManager signals only then
        things = [Thing() for _ in range(3)]
        for i, thing in enumerate(things):
            bus.export(f"/t/{i}", thing)
        bus.unexport("/t/1")
        things[2].Poked()
        things[0].Poked()
        assert [(m.path, m.member) for m in sent] == [("/t/2", "Poked"), ("/t/0", "Poked")]
        assert bus._exported() == {id(things[0]): {"/t/0"}, id(things[2]): {"/t/2"}}
        assert not bus._has_interface(things[1]) and bus._has_interface(things[2])
        things[1].Poked()  # unexported: on no bus any more, sent nowhere
        assert len(sent) == 2

    asyncio.run(body())
