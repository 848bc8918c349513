"""VM lab scenario: real CPU offline/online under cpuserviced, with a real process in a bound
allocation's slice. Prints one JSON object per check on lines starting with ``RESULT ``.

    python3 hotplug.py repair | storm | bench ROUNDS  [--partition root|isolated]

With ``--partition``, the bound allocations of whole CPUs are kernel cpuset partitions (the sid
lab, systemd >= 261); the checks are the same.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

CPU = Path("/sys/devices/system/cpu")
DEST, PATH, IFACE = "org.cpuservice1", "/org/cpuservice1", "org.cpuservice1.Manager"
ALLOCATION = "org.cpuservice1.Allocation"
PARTITION: str | None = None  # --partition


def options(cpus: str) -> dict[str, Variant]:
    """Bound, and a partition when asked for and the amount is whole."""
    opts = {"bind": Variant("b", True)}
    if PARTITION and "." not in cpus:
        opts["partition"] = Variant("s", PARTITION)
    return opts


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def set_online(cpu: int, online: bool) -> None:
    (CPU / f"cpu{cpu}/online").write_text("1" if online else "0")


def online_cpus() -> str:
    return (CPU / "online").read_text().strip()


def parse(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.replace(" ", ",").split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def allowed(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse(line.split(":", 1)[1].strip())
    raise RuntimeError("no Cpus_allowed_list")


def unit_cpus(unit: str) -> set[int]:
    out = subprocess.run(["systemctl", "show", unit, "-p", "AllowedCPUs", "--value"],
                         capture_output=True, text=True, check=True).stdout
    return parse(out.strip())


class Client:
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    async def call(self, member: str, signature: str = "", body: list | None = None,
                   path: str = PATH, interface: str = IFACE) -> list:
        reply = await self.bus.call(Message(destination=DEST, path=path, interface=interface,
                                            member=member, signature=signature, body=body or []))
        if reply.message_type == MessageType.ERROR:
            raise RuntimeError(f"{reply.error_name}: {reply.body}")
        return list(reply.body)

    async def allocations(self) -> dict[str, list]:
        return {row[0]: list(row) for row in (await self.call("ListAllocations"))[0]}

    async def prop(self, name: str, path: str = PATH, iface: str = IFACE) -> object:
        body = await self.call("Get", "ss", [iface, name], path=path,
                               interface="org.freedesktop.DBus.Properties")
        return body[0].value


async def wait_for(check, seconds: float = 20.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if await check():
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise TimeoutError("condition not met")


async def repair(c: Client) -> None:
    await c.call("Allocate", "ssa{sv}", ["h", "2", options("2")])
    held = parse((await c.allocations())["h"][3])
    unit = str(await c.prop("Unit", (await c.allocations())["h"][4], ALLOCATION))
    subprocess.run(["systemd-run", f"--slice={unit}", "--unit=hworker",
                    "sleep", "1000"], check=True)
    pid = int(subprocess.run(["systemctl", "show", "hworker", "-p", "MainPID", "--value"],
                             capture_output=True, text=True, check=True).stdout)
    result(check="start", held=sorted(held), process=sorted(allowed(pid)))
    victim = max(held)  # never cpu0 (no online file on x86)
    set_online(victim, False)

    async def replaced() -> bool:
        now = parse((await c.allocations())["h"][3])
        return victim not in now and len(now) == 2

    took = await wait_for(replaced)
    now = parse((await c.allocations())["h"][3])
    await asyncio.sleep(0.2)
    result(check="offline", victim=victim, online=online_cpus(), held=sorted(now),
           unit=sorted(unit_cpus(unit)), process=sorted(allowed(pid)),
           shared=sorted(unit_cpus("cpuservice-shared.slice")), seconds=took)
    set_online(victim, True)

    async def back() -> bool:
        return victim in parse(str(await c.prop("SharedCPUs")))

    await wait_for(back)
    held = sorted(parse((await c.allocations())["h"][3]))
    result(check="online", online=online_cpus(), held=held,
           shared=sorted(unit_cpus("cpuservice-shared.slice")))
    # leave the machine as found: the next scenarios need its CPUs
    subprocess.run(["systemctl", "stop", "hworker"], check=True)
    await c.call("Release", "s", ["h"])


async def storm(c: Client) -> None:
    rng = random.Random(7)
    stop = asyncio.Event()
    errors: list[str] = []
    partitioned = 0  # allocations made as partitions during the storm

    async def churn() -> None:
        nonlocal partitioned
        i = 0
        while not stop.is_set():
            name = f"s{i}"
            try:
                cpus = rng.choice(["1", "2", "0.5"])
                await c.call("Allocate", "ssa{sv}", [name, cpus, options(cpus)])
                partitioned += "partition" in options(cpus)
                if rng.random() < 0.6:
                    await c.call("Release", "s", [name])
            except RuntimeError as exc:
                if "InsufficientCPUs" not in str(exc):
                    errors.append(str(exc))
            i += 1
            await asyncio.sleep(0.01)

    worker = asyncio.ensure_future(churn())
    for _ in range(50):
        cpu = rng.randint(1, 7)
        online = (CPU / f"cpu{cpu}/online").read_text().strip() == "1"
        await asyncio.get_running_loop().run_in_executor(None, set_online, cpu, not online)
        await asyncio.sleep(rng.uniform(0, 0.05))
    for cpu in range(1, 8):
        set_online(cpu, True)
    stop.set()
    await worker
    await asyncio.sleep(1.0)  # settle
    rows = await c.allocations()
    states, units_agree = {}, True
    exclusive: list[int] = []
    invalid: dict[str, str] = {}  # partitions the kernel does not report as asked
    for name, row in rows.items():
        states[name] = await c.prop("State", row[4], ALLOCATION)
        if row[2]:
            unit = str(await c.prop("Unit", row[4], ALLOCATION))
            units_agree &= unit_cpus(unit) == parse(row[3])
            wanted = str(await c.prop("Partition", row[4], ALLOCATION))
            if wanted != "none":
                kernel = Path(f"/sys/fs/cgroup/{unit}/cpuset.cpus.partition").read_text().strip()
                if kernel != wanted:
                    invalid[name] = kernel
            shares = await c.prop("Shares", row[4], ALLOCATION)
            exclusive += [cpu for cpu, pieces in shares.items() if pieces == 100]
    restarts = subprocess.run(["systemctl", "show", "cpuservice", "-p", "NRestarts", "--value"],
                              capture_output=True, text=True).stdout.strip()
    active = subprocess.run(["systemctl", "is-active", "cpuservice"], capture_output=True,
                            text=True).stdout.strip()
    result(check="storm", online=online_cpus(), allocations=len(rows),
           degraded=[n for n, s in states.items() if s != "active"], units_agree=units_agree,
           double_booked=len(exclusive) != len(set(exclusive)), errors=errors[:5],
           partitions=partitioned,
           invalid_partitions=invalid,
           restarts=restarts, active=active)
    if errors:
        raise SystemExit(f"FAILED STEP: {len(errors)} requests failed during the storm")
    for name in rows:  # leave the machine as found: the next scenarios need its CPUs
        await c.call("Release", "s", [name])
    if await c.allocations():
        raise SystemExit("FAILED STEP: allocations left after releasing every one")


async def shared_slice_cpus(bus: MessageBus) -> set[int]:
    """AllowedCPUs of cpuservice-shared.slice, asked of systemd over D-Bus (no subprocess)."""
    reply = await bus.call(Message(
        destination="org.freedesktop.systemd1",
        path="/org/freedesktop/systemd1/unit/cpuservice_2dshared_2eslice",
        interface="org.freedesktop.DBus.Properties", member="Get", signature="ss",
        body=["org.freedesktop.systemd1.Slice", "AllowedCPUs"]))
    mask = bytes(reply.body[0].value)
    return {i * 8 + b for i, byte in enumerate(mask) for b in range(8) if byte >> b & 1}


async def bench(c: Client, rounds: int) -> None:
    """Time from writing 1 to a CPU's online file to systemd showing it in the shared slice."""
    times, writes = [], []
    for i in range(rounds):
        cpu = 1 + i % 7
        set_online(cpu, False)

        async def gone(cpu: int = cpu) -> bool:
            return cpu not in await shared_slice_cpus(c.bus)

        await wait_for(gone)
        start = time.monotonic()
        set_online(cpu, True)
        writes.append((time.monotonic() - start) * 1000)
        while cpu not in await shared_slice_cpus(c.bus):
            if time.monotonic() - start > 20:
                raise TimeoutError(f"cpu {cpu} did not come back")
        times.append((time.monotonic() - start) * 1000)
    times.sort()
    writes.sort()
    result(check="bench", p50=times[len(times) // 2], max=times[-1], rounds=rounds,
           write_p50=writes[len(writes) // 2])
    log = subprocess.run(["journalctl", "-u", "cpuservice", "-o", "cat", "--no-pager"],
                         capture_output=True, text=True).stdout
    print("\n".join(line for line in log.splitlines() if "CPU hotplug" in line)[-3000:])


async def main(argv: list[str]) -> None:
    global PARTITION
    if "--partition" in argv:
        at = argv.index("--partition")
        PARTITION, argv = argv[at + 1], argv[:at] + argv[at + 2:]
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    c = Client(bus)
    if argv[0] == "repair":
        await repair(c)
    elif argv[0] == "storm":
        await storm(c)
    elif argv[0] == "bench":
        await bench(c, int(argv[1]))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
