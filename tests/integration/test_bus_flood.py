"""Any local user's bulk reads do not hold up the daemon (issue 37, item 1): a real dbus-daemon
with the system bus's limits, the real bus API and service (in-memory systemd) in a process of
its own with 1,000 allocations on 1,024 CPUs, and uid 65534 (nobody) keeping 128
GetManagedObjects, GetAll and Introspect calls pending on each of 5 connections. Meanwhile
another caller's Ping, an Allocate and the daemon's own timers are measured against the same
daemon idle.

On the code before the fix, a Ping waited 12.6-39.9 s behind such a flood."""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Variant
from dbus_fast.aio import MessageBus

from tests.envs.privbus import PrivateSystemBus, call, flood_as_nobody, measure, populate
from tests.integration.test_cli_private_bus import PrivateService

NOBODY = 65534
ALLOCATIONS = 1000
CONNECTIONS, DEPTH = 5, 128


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[PrivateSystemBus]:
    if os.geteuid() != 0:
        pytest.skip("needs root, to call as nobody")
    env = PrivateSystemBus(tmp_path, "e", max_allocations_per_user=0)
    try:
        yield env
    finally:
        env.stop()


@pytest.mark.parametrize("reading", [True, False], ids=["reading", "never-reading"])
def test_nobodys_bulk_reads_hold_up_no_one(bus: PrivateSystemBus, reading: bool) -> None:
    asyncio.run(populate(bus.address, ALLOCATIONS))
    idle = asyncio.run(measure(bus.address, 2))
    with flood_as_nobody(bus.address, 12, CONNECTIONS, DEPTH, reading) as result:
        time.sleep(2)  # every connection has its calls pending
        start = time.monotonic()
        loaded = asyncio.run(measure(bus.address, 5))
        end = time.monotonic()
    served = result()
    # how late the daemon's 50 ms timer ran while nobody's reads and the pings went on
    late = sorted(x for when, x in bus.stop() if start <= when <= start + 5)
    loop = {"p50": statistics.median(late), "p99": late[int(len(late) * 0.99)], "max": late[-1]}
    print(f"idle {idle}\nloaded {loaded} (until {end - start:.1f} s)\nflood {served}\n"
          f"loop {loop}")
    assert served["replies"] > 0 or not reading, served  # answered, not dropped
    assert set(served["errors"]) <= {"org.cpuservice1.Error.LimitExceeded"}, served
    # The goals (Ping p99 <= 100 ms, Allocate <= 2x idle, the timer <= 100 ms late) are checked
    # by `make bench-bus` on a quiet machine. This test runs beside other tiers on a 2-core
    # machine (four busy processes of its own, the VM lab's boots beside it: `make test` runs
    # the lab beside the other tiers), so it keeps a margin of 10-20x that such load does not
    # reach and the old code's failure cannot pass: there
    # a Ping waited 12.6-39.9 s behind one such connection, and this flood made the daemon drop
    # off the bus.
    assert loaded["ping_p99"] <= 2.0, (idle, loaded)
    assert loaded["read_p99"] <= 2.0, (idle, loaded)  # another user's reads take their turns
    assert loaded["allocate"] <= max(5 * idle["allocate"], idle["allocate"] + 0.5), (idle, loaded)
    assert loop["p99"] <= 1.0, loop  # the lending loop's timer: withdrawals are not held up


def test_the_reads_answer_what_dbus_fast_would(tmp_path: Path) -> None:
    """GetManagedObjects (at the ObjectManager and above it), GetAll, Get and Introspect,
    answered by cpuservice.bus.reads, equal dbus-fast's own answers on the same objects."""
    svc = PrivateService(tmp_path)
    try:
        for name, cpus, bind in (("web", "2", True), ("db", "1.5", True), ("batch", "0.5", False)):
            assert svc.ctl("allocate", name, cpus, *(["--bind"] if bind else [])).returncode == 0
        calls = [
            ("/org/cpuservice1", "org.freedesktop.DBus.ObjectManager", "GetManagedObjects", "", []),
            ("/", "org.freedesktop.DBus.ObjectManager", "GetManagedObjects", "", []),
            ("/org/cpuservice1/allocation/web", "org.freedesktop.DBus.ObjectManager",
             "GetManagedObjects", "", []),
            ("/org/cpuservice1/allocation/db", "org.freedesktop.DBus.Properties", "GetAll", "s",
             ["org.cpuservice1.Allocation"]),
            ("/org/cpuservice1", "org.freedesktop.DBus.Properties", "GetAll", "s",
             ["org.cpuservice1.Manager"]),
            ("/org/cpuservice1/allocation/db", "org.freedesktop.DBus.Properties", "Get", "ss",
             ["org.cpuservice1.Allocation", "CPUSet"]),
            ("/org/cpuservice1", "org.freedesktop.DBus.Properties", "Get", "ss",
             ["org.cpuservice1.Manager", "SharedCPUs"]),
            ("/org/cpuservice1/allocation/db", "org.freedesktop.DBus.Properties", "Get", "ss",
             ["org.cpuservice1.Allocation", "NoSuchProperty"]),
            *((path, "org.freedesktop.DBus.Introspectable", "Introspect", "", [])
              for path in ("/", "/org", "/org/cpuservice1", "/org/cpuservice1/allocation",
                           "/org/cpuservice1/allocation/web", "/org/cpuservice1/nothing")),
        ]

        async def answers() -> list[Any]:
            bus = await MessageBus(bus_address=svc.address).connect()
            out = []
            for path, interface, member, signature, body in calls:
                reply = await call(bus, member, signature, body, path=path, interface=interface)
                out.append(reply.error_name or _plain(reply.body[0], member))
            bus.disconnect()
            return out

        ours = asyncio.run(answers())
        done = threading.Event()
        svc.loop.call_soon_threadsafe(
            lambda: (svc.bus.remove_message_handler(svc.manager.reads.handler), done.set()))
        assert done.wait(10)
        theirs = asyncio.run(answers())
    finally:
        svc.stop()
    assert ours == theirs
    assert ours[0]  # not empty


def _plain(value: Any, member: str) -> Any:
    """A reply's value to compare: Variants as (signature, value), introspection XML as its
    interfaces and sorted child nodes (dbus-fast lists children in no order)."""
    if member == "Introspect":
        root = ET.fromstring(value)
        return ([ET.tostring(i) for i in root.findall("interface")],
                sorted(n.get("name", "") for n in root.findall("node")))
    if isinstance(value, Variant):
        return (value.signature, _plain(value.value, member))
    if isinstance(value, dict):
        return {k: _plain(v, member) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, member) for v in value]
    return value
