"""Service benchmark: cpuserviced in the container host, driven over the same system bus.

Prints, last:
    allocate_bound_p50_us <float> floor_p50_us <float> ratio <float>
    allocate_bound_p50_us borrowers=1 <float> floor_p50_us <float> ratio <float>
    shared_update_ratio n=1000 <float>
    checkpoint_scale allocations=3000 ratio <float>
    systemd_shared_slice_set_us children=0 <float> children=3000 <float>
    idle_cpu_percent allocations=3000 <float> rss_mb <float>
    worst_call_ms cpus=1024 allocations=1000 <float> (<the slowest call>)
    burst_allocate n=32 serial_s=<float> concurrent_s=<float> floor_ms=<float> ratio=<float>
    burst_systemd n=32 concurrent_s=<float> burst_ratio=<float>
    daemon_cpu_us_per_allocate allocations=0 <float> allocations=1000 <float> ratio <float>
        allocations=3000 <float> ratio <float>
    daemon_cpu_us_per_allocate statistics=off allocations=0 <float> allocations=3000 <float>
        ratio <float>
    daemon_cpu_us_per_allocate statistics=off metrics=on allocations=0 <float>
        allocations=3000 <float> ratio <float>
    daemon_cpu_us_per_allocate systemd=in-memory statistics=off allocations=0 <float>
        allocations=3000 <float> ratio <float>

floor = StartTransientUnit of an equivalent slice (until its job is done) + one
SetUnitProperties, measured by the same client on the same bus, interleaved with the Allocate
calls. shared_update_ratio = bound Allocate latency with 1,000 unbound allocations present /
with none; checkpoint_scale the same with 3,000 (daemon_cpu_us_per_allocate: the daemon's own
CPU time per bound Allocate, utime + stime over 3 x 120 of them, with none and with those
3,000; the rest of checkpoint_scale is systemd's; statistics=off: the same in a daemon whose
statistics sampler is off, so that only the Allocates' own work is counted, not a reading of
every allocation's figures that falls into the window; metrics=on: that daemon writing its
metrics file, as on a host with the node exporter; systemd=in-memory: the daemon's own part
alone, the service in a process of its own on a private dbus-daemon with the unit tests'
in-memory systemd, 5 x 120 Allocates: in the container it shares two CPUs with systemd, whose
work per call grows with the slice's children). systemd_shared_slice_set_us: what systemd
alone takes to set cpuservice-shared.slice's AllowedCPUs (to the value it has) with no unbound
allocation and with 3,000 of them below it (systemd walks the slice's subtree).
burst_allocate: 32 bound 1-CPU Allocates issued one after another, then 32 issued at once (all
answered), the median of 3 rounds each; ratio = concurrent_s / (32 x floor);
burst_systemd: what systemd alone takes to start 32 such slices issued at once by one client (3
rounds), the part of a burst no daemon can avoid; burst_ratio = concurrent_s / that.
borrowers=1: the same Allocate while one borrower exists (the borrow slice, one more holder of
the shared pool; without a borrower it does not exist, issue 40).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dbus_fast import Variant
from dbus_fast.aio import MessageBus

from cpuservice.host.systemd import Systemd
from cpuservice.model.config import METRICS_EXAMPLE
from tests.envs.container import ContainerHost
from tests.envs.privbus import PrivateSystemBus
from tests.integration import client
from tests.integration.service_env import ServiceHost

ROUNDS = int(os.environ.get("CPUSERVICE_BENCH_ROUNDS", "200"))


async def _allocate_once(bus: MessageBus, name: str) -> float:
    start = time.perf_counter()
    await client.call(bus, "Allocate", "ssa{sv}", [name, "1", {"bind": Variant("b", True)}])
    elapsed = time.perf_counter() - start
    await client.call(bus, "Release", "s", [name])
    return elapsed


async def burst(address: str, n: int = 32, rounds: int = 3) -> tuple[float, float]:
    """Seconds for ``n`` bound Allocates one after another, and for ``n`` issued at once."""
    bus = await client.connect(address)
    bind = {"bind": Variant("b", True)}
    serial, together = [], []

    async def allocate(name: str) -> None:
        await client.call(bus, "Allocate", "ssa{sv}", [name, "1", bind])

    async def release(names: list[str]) -> None:
        for name in names:
            await client.call(bus, "Release", "s", [name])

    try:
        for r in range(rounds):
            names = [f"serial{r}-{i}" for i in range(n)]
            start = time.perf_counter()
            for name in names:
                await allocate(name)
            serial.append(time.perf_counter() - start)
            await release(names)
            names = [f"burst{r}-{i}" for i in range(n)]
            start = time.perf_counter()
            await asyncio.gather(*(allocate(name) for name in names))
            together.append(time.perf_counter() - start)
            await release(names)
    finally:
        bus.disconnect()
    return statistics.median(serial), statistics.median(together)


async def systemd_burst(address: str, n: int = 32, rounds: int = 3) -> float:
    """Seconds systemd takes to start ``n`` transient slices like the floor's, issued at once."""
    bus = await client.connect(address)
    systemd = Systemd(bus)
    await systemd.setup()
    props = {"AllowedCPUs": ("ay", b"\x01"), "CPUWeight": ("t", 100),
             "Description": ("s", "floor")}
    times = []
    try:
        for r in range(rounds):
            units = [f"floor-burst{r}-{i}.slice" for i in range(n)]
            start = time.perf_counter()
            await asyncio.gather(*(systemd.start_transient(u, props) for u in units))
            times.append(time.perf_counter() - start)
            for unit in units:
                await systemd.stop(unit)
    finally:
        bus.disconnect()
    return statistics.median(times)


async def daemon_cpu(address: str, cpu_seconds: Callable[[], float], n: int = 120,
                     rounds: int = 3) -> float:
    """The daemon's CPU time per bound Allocate (µs): ``rounds`` times ``n`` Allocates (their
    Releases are not counted)."""
    bus = await client.connect(address)
    bind = {"bind": Variant("b", True)}
    used = 0.0
    try:
        for _ in range(rounds):
            before = cpu_seconds()
            for i in range(n):
                await client.call(bus, "Allocate", "ssa{sv}", [f"cpu{i}", "1", bind])
            used += cpu_seconds() - before
            for i in range(n):
                await client.call(bus, "Release", "s", [f"cpu{i}"])
    finally:
        bus.disconnect()
    return used / (n * rounds) * 1e6


async def _floor_once(systemd: Systemd, i: int) -> float:
    unit = f"floor-{i}.slice"
    start = time.perf_counter()
    await systemd.start_transient(unit, {"AllowedCPUs": ("ay", b"\x01"),
                                         "CPUWeight": ("t", 100),
                                         "Description": ("s", "floor")})
    await systemd.set_properties("floor-shared.slice", {"AllowedCPUs": ("ay", b"\xfe")})
    elapsed = time.perf_counter() - start
    await systemd.stop(unit)
    return elapsed


async def measure(address: str, rounds: int, floor: bool) -> tuple[float, float]:
    bus = await client.connect(address)
    systemd = Systemd(bus)
    await systemd.setup()
    allocs, floors = [], []
    try:
        for i in range(rounds):
            allocs.append(await _allocate_once(bus, f"bench{i}"))
            if floor:
                floors.append(await _floor_once(systemd, i))
    finally:
        bus.disconnect()
    return statistics.median(allocs) * 1e6, statistics.median(floors or [0]) * 1e6


async def shared_slice_set(address: str, rounds: int = 40) -> float:
    bus = await client.connect(address)
    systemd = Systemd(bus)
    unit = "cpuservice-shared.slice"
    try:
        have = await systemd.get(unit, "org.freedesktop.systemd1.Slice", ["AllowedCPUs"])
        if not have:
            raise RuntimeError(f"{unit} is not loaded")
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            await systemd.set_properties(unit, {"AllowedCPUs": ("ay", bytes(have["AllowedCPUs"]))})
            times.append(time.perf_counter() - start)
    finally:
        bus.disconnect()
    return statistics.median(times) * 1e6


async def populate(address: str, start: int, n: int) -> None:
    bus = await client.connect(address)
    try:
        for i in range(start, n):
            await client.call(bus, "Allocate", "ssa{sv}", [f"u{i}", "0.5", {}])
    finally:
        bus.disconnect()


def _hostile_calls() -> list[tuple[str, str, list[object]]]:
    bind = {"bind": Variant("b", True)}
    calls: list[tuple[str, str, list[object]]] = []
    for amount in ("0.01", "0.99", "1", "1.01", "2", "7.5", "64", "1000"):
        for extra in ({}, {"policy": Variant("s", "full-pcpus")},
                      {"policy": Variant("s", "spread-pcpus")},
                      {"exclusive": Variant("s", "pcpu")}, {"exclusive": Variant("s", "numa")},
                      {"numa-alignment": Variant("s", "single-numa-node")},
                      {"numa-alignment": Variant("s", "restricted")},
                      {"numa-strategy": Variant("s", "distribute-evenly")}):
            calls.append(("Capacity", "sa{sv}", [amount, {**bind, **extra}]))
            calls.append(("Plan", "sa{sv}", [amount, {**bind, **extra}]))
    for text in (",".join(["0-8191"] * 14000), "0-1023", ",".join(map(str, range(0, 1024, 2))),
                 "0-" + "9" * 5000):
        calls.append(("Plan", "sa{sv}", ["2", {**bind, "cpuset": Variant("s", text)}]))
    calls.append(("Capacity", "sa{sv}", ["0.01", {}]))
    calls.append(("ListAllocations", "", []))
    calls.append(("Allocate", "ssa{sv}", ["x" * 100_000, "1", bind]))
    calls.append(("Allocate", "ssa{sv}", ["a" + "-" * 63, "1", bind]))
    calls.append(("Attach", "sau", ["b0", list(range(4_000_000, 4_000_000 + 300))]))
    calls.append(("Resize", "ss", ["b0", "999999.999999"]))
    return calls


# the bulk reads anyone may make (issue 37): (member, signature, body, path, interface)
READS: list[tuple[str, str, list[object], str, str]] = [
    ("GetManagedObjects", "", [], "/org/cpuservice1", "org.freedesktop.DBus.ObjectManager"),
    ("GetManagedObjects", "", [], "/", "org.freedesktop.DBus.ObjectManager"),
    ("GetAll", "s", ["org.cpuservice1.Manager"], "/org/cpuservice1",
     "org.freedesktop.DBus.Properties"),
    ("GetAll", "s", ["org.cpuservice1.Allocation"], "/org/cpuservice1/allocation/b0",
     "org.freedesktop.DBus.Properties"),
    ("Introspect", "", [], "/org/cpuservice1/allocation", "org.freedesktop.DBus.Introspectable"),
]


async def worst_call(address: str) -> tuple[float, str]:
    bus = await client.connect(address)
    worst, what = 0.0, ""
    try:
        calls = [(m, sig, body, client.PATH, client.IFACE) for m, sig, body in _hostile_calls()]
        for member, signature, body, path, interface in [*calls, *READS]:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                with contextlib.suppress(client.CallError):
                    await client.call(bus, member, signature, body, path, interface)
                times.append(time.perf_counter() - start)
            took = statistics.median(times) * 1000
            if took > worst:
                worst, what = took, f"{member} {path} {str(body)[:60]}"
    finally:
        bus.disconnect()
    return worst, what


async def populate_mixed(address: str, n: int) -> None:
    """n allocations on a big machine: a third bound whole, a third fractional, a third not."""
    bus = await client.connect(address)
    bind = {"bind": Variant("b", True)}
    try:
        for i in range(n):
            name, kind = f"b{i}", i % 3
            cpus, opts = (("1", bind), ("0.3", bind), ("0.5", {}))[kind]
            await client.call(bus, "Allocate", "ssa{sv}", [name, cpus, opts])
    finally:
        bus.disconnect()


def _cpu_seconds(pid: int, root: Path) -> float:
    fields = (root / f"proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_part(rounds: int = 9) -> tuple[float, float]:
    """The daemon's CPU per bound Allocate with no other allocation and with 3,000 unbound
    ones, systemd left out: two daemons, each the service in a process of its own on a private
    dbus-daemon with the in-memory systemd (tests.envs.privbus), statistics sampler and metrics
    file off, one of them holding the 3,000; measured in turn, 120 Allocates at a time, the
    medians of ``rounds`` (this host's CPU time per call drifts by a third within minutes)."""
    with contextlib.ExitStack() as stack:
        buses = []
        for _ in range(2):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cpuservice-")))
            bus = PrivateSystemBus(tmp, "c", statistics_seconds=0, max_allocations_per_user=0,
                                   metrics_file="")
            stack.callback(bus.stop)
            buses.append(bus)
        asyncio.run(populate(buses[1].address, 0, 3000))

        def cpu(bus: PrivateSystemBus) -> Callable[[], float]:
            tasks = Path(f"/proc/{bus.daemon.pid}/task")
            # to the nanosecond: the scheduler's run time of its threads
            return lambda: sum(int((t / "schedstat").read_text().split()[0])
                               for t in tasks.iterdir()) / 1e9

        times: list[list[float]] = [[], []]
        for r in range(rounds + 1):
            for i, bus in enumerate(buses):
                used = asyncio.run(daemon_cpu(bus.address, cpu(bus), rounds=1))
                if r:  # the first: warm-up
                    times[i].append(used)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> int:
    fake_empty_us, fake_full_us = own_part()
    with ContainerHost("cpuservice-bench") as container:
        daemon = ServiceHost(container)
        daemon.configure("c")
        address = container.bus_address
        asyncio.run(measure(address, 20, True))  # warm-up
        alloc_us, floor_us = asyncio.run(measure(address, ROUNDS, True))
        serial_s, burst_s = asyncio.run(burst(address))
        systemd_burst_s = asyncio.run(systemd_burst(address))
        # what one borrower costs: the borrow slice exists, one more holder of the shared pool
        daemon.call("Allocate", "ssa{sv}", "borrower", "0.1", "1", "borrow", "b", "true")
        borrow_us, borrow_floor_us = asyncio.run(measure(address, ROUNDS // 2, True))
        daemon.call("Release", "s", "borrower")
        pid = int(daemon.show("cpuservice.service", "MainPID")["MainPID"])
        proc = Path(f"/proc/{container.pid1}/root")
        cpu_empty_us = asyncio.run(daemon_cpu(address, lambda: _cpu_seconds(pid, proc)))
        empty_set_us = asyncio.run(shared_slice_set(address))
        asyncio.run(populate(address, 0, 1000))
        crowded_us, _ = asyncio.run(measure(address, ROUNDS // 2, False))
        cpu_crowded_us = asyncio.run(daemon_cpu(address, lambda: _cpu_seconds(pid, proc)))
        asyncio.run(populate(address, 1000, 3000))
        scale_us, _ = asyncio.run(measure(address, ROUNDS // 2, False))
        cpu_full_us = asyncio.run(daemon_cpu(address, lambda: _cpu_seconds(pid, proc)))
        crowded_set_us = asyncio.run(shared_slice_set(address))
        time.sleep(2)
        before, t0 = _cpu_seconds(pid, proc), time.monotonic()
        time.sleep(10)
        idle = (_cpu_seconds(pid, proc) - before) / (time.monotonic() - t0) * 100
        rss_kb = next(int(line.split()[1]) for line in
                      (proc / f"proc/{pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
        # the same, with the statistics sampler off (statistics_seconds = 0): what an Allocate
        # itself costs the daemon as allocations grow, without the reading of every
        # allocation's figures every 10 s that falls into the window (idle_cpu_percent above
        # has the sampler's cost)
        daemon.configure("c", statistics_seconds=0)
        pid = int(daemon.show("cpuservice.service", "MainPID")["MainPID"])
        own_empty_us = asyncio.run(daemon_cpu(address, lambda: _cpu_seconds(pid, proc)))
        asyncio.run(populate(address, 0, 3000))
        own_full_us = asyncio.run(daemon_cpu(address, lambda: _cpu_seconds(pid, proc)))
        daemon.configure("e", max_allocations_per_user=0)
        asyncio.run(populate_mixed(address, 1000))
        worst_ms, worst_what = asyncio.run(worst_call(address))
        # the same as statistics=off, with the metrics file written: the container host lacks
        # the node exporter's directory, which a real host has (ReadWritePaths=- takes it
        # when it exists at start)
        metrics_file = container.root / METRICS_EXAMPLE.lstrip("/")  # the default
        metrics_dir = metrics_file.parent
        made = not metrics_dir.exists()
        metrics_dir.mkdir(parents=True, exist_ok=True)
        try:
            daemon.configure("c", statistics_seconds=0)
            pid = int(daemon.show("cpuservice.service", "MainPID")["MainPID"])
            prom_empty_us = asyncio.run(daemon_cpu(address, lambda: _cpu_seconds(pid, proc)))
            asyncio.run(populate(address, 0, 3000))
            prom_full_us = asyncio.run(daemon_cpu(address, lambda: _cpu_seconds(pid, proc)))
            written = metrics_file.exists()
        finally:
            daemon.stop(wipe=True)
            metrics_file.unlink(missing_ok=True)
            if made:
                metrics_dir.rmdir()
        if not written:
            raise RuntimeError(f"the daemon wrote no metrics file {METRICS_EXAMPLE}")
    print(f"allocate_bound_p50_us {alloc_us:.1f} floor_p50_us {floor_us:.1f} "
          f"ratio {alloc_us / floor_us:.2f}")
    print(f"allocate_bound_p50_us borrowers=1 {borrow_us:.1f} floor_p50_us {borrow_floor_us:.1f} "
          f"ratio {borrow_us / borrow_floor_us:.2f}")
    print(f"shared_update_ratio n=1000 {crowded_us / alloc_us:.2f}")
    print(f"checkpoint_scale allocations=3000 ratio {scale_us / alloc_us:.2f}")
    print(f"systemd_shared_slice_set_us children=0 {empty_set_us:.1f} "
          f"children=3000 {crowded_set_us:.1f}")
    print(f"idle_cpu_percent allocations=3000 {idle:.2f} rss_mb {rss_kb / 1024:.1f}")
    print(f"worst_call_ms cpus=1024 allocations=1000 {worst_ms:.1f} ({worst_what})")
    print(f"burst_allocate n=32 serial_s={serial_s:.3f} concurrent_s={burst_s:.3f} "
          f"floor_ms={floor_us / 1000:.2f} ratio={burst_s / (32 * floor_us / 1e6):.2f}")
    print(f"burst_systemd n=32 concurrent_s={systemd_burst_s:.3f} "
          f"burst_ratio={burst_s / systemd_burst_s:.2f}")
    print(f"daemon_cpu_us_per_allocate allocations=0 {cpu_empty_us:.0f} allocations=1000 "
          f"{cpu_crowded_us:.0f} ratio {cpu_crowded_us / cpu_empty_us:.2f} allocations=3000 "
          f"{cpu_full_us:.0f} ratio {cpu_full_us / cpu_empty_us:.2f}")
    print(f"daemon_cpu_us_per_allocate statistics=off allocations=0 {own_empty_us:.0f} "
          f"allocations=3000 {own_full_us:.0f} ratio {own_full_us / own_empty_us:.2f}")
    print(f"daemon_cpu_us_per_allocate statistics=off metrics=on allocations=0 "
          f"{prom_empty_us:.0f} allocations=3000 {prom_full_us:.0f} "
          f"ratio {prom_full_us / prom_empty_us:.2f}")
    print(f"daemon_cpu_us_per_allocate systemd=in-memory statistics=off allocations=0 "
          f"{fake_empty_us:.0f} allocations=3000 {fake_full_us:.0f} "
          f"ratio {fake_full_us / fake_empty_us:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
