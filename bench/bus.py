"""What any local user's reads cost everybody else (issue 37, item 1): `make bench-bus`.

A private dbus-daemon with the system bus's limits, cpuservice (the real bus API and service,
in-memory systemd) in a process of its own on fixture e (1,024 CPUs) with 1,000 allocations, and
uid 65534 keeping 128 GetManagedObjects, GetAll and Introspect calls pending on each of 5
connections. Prints:

    bus_flood ping_p99_ms idle=<f> loaded=<f> allocate_ms idle=<f> loaded=<f> ratio=<f>
    bus_flood read_p99_ms idle=<f> loaded=<f> (another user's GetAllocation)
    bus_flood loop_late_ms p50=<f> p99=<f> max=<f> replies=<n> refused=<n>
    bus_read_ms GetManagedObjects cold=<f> warm=<f> GetAll=<f> Introspect=<f>

Goals: ping p99 <= 100 ms and allocate ratio <= 2 under the flood; the daemon's 50 ms timer (the
lending loop's sample) late by <= 100 ms at p99 (a withdrawal waits for it); the slowest read
(GetManagedObjects just after a change: "cold") <= 50 ms.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dbus_fast import Variant
from dbus_fast.aio import MessageBus

from tests.envs.privbus import PrivateSystemBus, call, flood_as_nobody, measure, populate

ALLOCATIONS, CONNECTIONS, DEPTH = 1000, 5, 128
READS = {
    "GetManagedObjects": ("/org/cpuservice1", "org.freedesktop.DBus.ObjectManager", "", []),
    "GetAll": ("/org/cpuservice1/allocation/a1", "org.freedesktop.DBus.Properties", "s",
               ["org.cpuservice1.Allocation"]),
    "Introspect": ("/org/cpuservice1/allocation", "org.freedesktop.DBus.Introspectable", "", []),
}


async def reads(address: str, rounds: int = 7) -> dict[str, float]:
    """Median time of each read; GetManagedObjects also just after a change (cold)."""
    bus = await MessageBus(bus_address=address).connect()
    times: dict[str, list[float]] = {"cold": []}
    for i in range(rounds):
        await call(bus, "Allocate", "ssa{sv}", [f"r{i}", "1", {"bind": Variant("b", True)}])
        for member, (path, interface, signature, body) in READS.items():
            for key in (("cold", member) if member == "GetManagedObjects" else (member,)):
                start = time.perf_counter()
                await call(bus, member, signature, body, path=path, interface=interface)
                times.setdefault(key, []).append(time.perf_counter() - start)
        await call(bus, "Release", "s", [f"r{i}"])
    bus.disconnect()
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        bus = PrivateSystemBus(Path(tmp), "e", max_allocations_per_user=0)
        try:
            asyncio.run(populate(bus.address, ALLOCATIONS))
            read_ms = asyncio.run(reads(bus.address))
            idle = asyncio.run(measure(bus.address, 3))
            with flood_as_nobody(bus.address, 14, CONNECTIONS, DEPTH) as result:
                time.sleep(2)
                start = time.monotonic()
                loaded = asyncio.run(measure(bus.address, 6))
            served = result()
        finally:
            probe = bus.stop()
    late = sorted(x * 1000 for when, x in probe if start <= when <= start + 6)
    print(f"bus_flood ping_p99_ms idle={idle['ping_p99'] * 1000:.1f} "
          f"loaded={loaded['ping_p99'] * 1000:.1f} allocate_ms idle={idle['allocate'] * 1000:.1f} "
          f"loaded={loaded['allocate'] * 1000:.1f} "
          f"ratio={loaded['allocate'] / idle['allocate']:.2f}")
    print(f"bus_flood read_p99_ms idle={idle['read_p99'] * 1000:.1f} "
          f"loaded={loaded['read_p99'] * 1000:.1f} (another user's GetAllocation)")
    print(f"bus_flood loop_late_ms p50={statistics.median(late):.1f} "
          f"p99={late[int(len(late) * 0.99)]:.1f} max={late[-1]:.1f} "
          f"replies={served['replies']} refused={sum(served['errors'].values())}")
    print(f"bus_read_ms GetManagedObjects cold={read_ms['cold']:.1f} "
          f"warm={read_ms['GetManagedObjects']:.1f} GetAll={read_ms['GetAll']:.2f} "
          f"Introspect={read_ms['Introspect']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
