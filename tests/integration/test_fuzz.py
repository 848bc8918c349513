"""Hostile input: 10,000 generated calls; every reply is a success or a named error, never a
traceback, and comes quickly (tiny fractions, huge ranges and long lists included); the service
never restarts and the pools stay consistent."""

from __future__ import annotations

import asyncio
import random
import re
import time

from dbus_fast import Message, MessageType, Variant

from tests.integration import client
from tests.integration.service_env import ServiceHost
from tests.integration.test_service import _check_consistent

CALLS = 10_000
# any one call: what the gate catches is a hostile call that holds the daemon for seconds (the
# bug this guards took 66 s); the goal, 50 ms, is bench-service's worst_call_ms. A Revalidate
# took 1.3 s on this 2-core machine at a load average of 15 (five test runs beside it)
SLOWEST_SECONDS = 5.0
NAMED = re.compile(r"org\.(cpuservice1\.Error|freedesktop\.DBus\.Error)\.[A-Za-z]+")
WORDS = ["", "-", ".", "..", "../x", "a.service", "x\n", "ü", "名前", "a" * 64, "a" * 65,
         "b" * 100_000, "web", "db", "x y", "$(id)", "'", "\\x2d", "0", "x" * 5, "A-b_c.d"]
AMOUNTS = ["0", "-0", "1", "2", "0.5", "1.2", "0.01", "0.001", "1e9", "1E2", "0x10", "NaN",
           "inf", "-1", "1.000", "99999999999999999999", " 1", "1 ", "\uff11", "", "1.", ".5", "8",
           "16", "1.25", "3.33", "0.01", "0.02", "1.01", "15.99"]
OPTION_KEYS = ["bind", "policy", "exclusive", "numa-strategy", "numa-alignment", "cpuset",
               "memory-nodes", "unit", "lifetime", "colour", "", "BIND"]
VALUES = [Variant("b", True), Variant("b", False), Variant("s", "packed"),
          Variant("s", "full-pcpus"), Variant("s", "spread-pcpus"), Variant("s", "pcpu"),
          Variant("s", "numa"), Variant("s", "single-numa-node"), Variant("s", "unit"),
          Variant("s", "0-3"), Variant("s", "3-1"), Variant("s", "x.service"), Variant("i", -1),
          Variant("u", 2**32 - 1), Variant("d", 1.5), Variant("as", ["a"]), Variant("ay", b"\x01"),
          Variant("s", "ü" * 10), Variant("t", 2**64 - 1), Variant("a{sv}", {}),
          Variant("s", ",".join(["0-8191"] * 3000)), Variant("s", "0-8191"),
          Variant("s", ",".join(str(c) for c in range(0, 8192, 2))),
          Variant("s", "0-" + "9" * 5000), Variant("s", "restricted"),
          Variant("s", "distribute-evenly")]


def _options(rng: random.Random) -> dict[str, Variant]:
    return {rng.choice(OPTION_KEYS): rng.choice(VALUES) for _ in range(rng.randint(0, 4))}


def _call(rng: random.Random, names: list[str]) -> tuple[str, str, str, list[object]]:
    """(path, member, signature, body): right or wrong on purpose."""
    name = rng.choice(names + WORDS) if names and rng.random() < 0.3 else rng.choice(WORDS)
    amount = rng.choice(AMOUNTS)
    path = "/org/cpuservice1"
    choices = [
        ("Allocate", "ssa{sv}", [name, amount, _options(rng)]),
        ("Allocate", "ssa{sv}", [f"ok{rng.randint(0, 50)}", rng.choice(["1", "0.5", "2"]),
                                 {"bind": Variant("b", rng.random() < 0.5)}]),
        ("Allocate", "sss", [name, amount, "x"]),
        ("Allocate", "s", [name]),
        ("Release", "s", [name]),
        ("Release", "i", [3]),
        ("Resize", "ss", [name, amount]),
        ("Plan", "sa{sv}", [amount, _options(rng)]),
        ("Capacity", "sa{sv}", [amount, _options(rng)]),
        ("ListAllocations", "", []),
        ("GetAllocation", "s", [name]),
        ("Attach", "sau", [name, [rng.choice([0, 1, 2**31 - 1, 999_999])]]),
        ("Revalidate", "", []),
        ("NoSuchMethod", "", []),
    ]
    member, signature, body = rng.choice(choices)
    if rng.random() < 0.05:
        path = "/org/cpuservice1/allocation/" + rng.choice(["x", "ok1", "_2e_2e"])
        member, signature, body = "Release", "", []
    return path, member, signature, body


async def _fuzz(address: str, seed: int, calls: int) -> list[str]:
    bus = await client.connect(address)
    rng = random.Random(seed)
    problems: list[str] = []
    names: list[str] = []
    try:
        for _ in range(calls):
            path, member, signature, body = _call(rng, names)
            began = time.monotonic()
            reply = await bus.call(Message(
                destination="org.cpuservice1", path=path, interface="org.cpuservice1.Manager"
                if path == "/org/cpuservice1" else "org.cpuservice1.Allocation",
                member=member, signature=signature, body=body))
            took = time.monotonic() - began
            if took > SLOWEST_SECONDS:
                problems.append(f"{member}{body!r:.120}: {took:.2f} s")
            assert reply is not None
            text = " ".join(str(x) for x in reply.body)
            if "Traceback" in text or 'File "' in text:
                problems.append(f"{member}{body!r:.80}: traceback in reply")
            if reply.message_type == MessageType.ERROR:
                if not NAMED.fullmatch(reply.error_name or ""):
                    problems.append(f"{member}: unnamed error {reply.error_name}")
            elif member == "Allocate":
                names.append(str(body[0]))
            if len(names) > 20:
                try:
                    await client.call(bus, "Release", "s", [names.pop(0)])
                except client.CallError as exc:
                    assert exc.name == "org.cpuservice1.Error.NoSuchAllocation", exc
    finally:
        bus.disconnect()
    return problems


def test_ten_thousand_hostile_calls(daemon: ServiceHost) -> None:
    daemon.configure("b")
    pid = daemon.show("cpuservice.service", "MainPID")["MainPID"]
    problems: list[str] = []
    for seed in range(10):
        problems += asyncio.run(_fuzz(daemon.c.bus_address, seed, CALLS // 10))
        state = daemon.show("cpuservice.service", "MainPID", "NRestarts", "ActiveState")
        assert state == {"MainPID": pid, "NRestarts": "0", "ActiveState": "active"}, state
        _check_consistent(daemon)
    assert problems == []
    assert "Traceback" not in daemon.journal()
