"""VM lab scenario (sid: systemd >= 261, Linux 7.x): kernel cpuset partitions made through
systemd's CPUSetPartition=. Prints one JSON object per check on lines starting with ``RESULT ``.

    python3 partitions.py capabilities   # Manager.Capabilities
    python3 partitions.py isolated       # the kernel enforces an isolated partition
    python3 partitions.py offline        # every CPU of a partition offline: invalid, repaired
    python3 partitions.py refused        # (Debian 12) an explicit partition: NotSupported
    python3 partitions.py bench ROUNDS   # partition_apply_ms: Allocate until the kernel agrees
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dbus_fast import BusType, Message, Variant
from dbus_fast.aio import MessageBus
from hotplug import ALLOCATION, Client, allowed, parse, set_online, wait_for  # same directory

CGROUP = Path("/sys/fs/cgroup")
ISOLATED = {"bind": Variant("b", True), "partition": Variant("s", "isolated")}


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def kernel_state(unit: str) -> str:
    try:
        return (CGROUP / unit / "cpuset.cpus.partition").read_text().strip()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


def cgroup_file(path: str) -> str:
    return (CGROUP / path).read_text().strip()


def sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True)


async def allocate(c: Client, name: str, cpus: str) -> tuple[str, str, set[int]]:
    """(object path, unit, CPUs) of a new partitioned allocation."""
    (path,) = await c.call("Allocate", "ssa{sv}", [name, cpus, ISOLATED])
    unit = str(await c.prop("Unit", path, ALLOCATION))
    return path, unit, parse(str(await c.prop("CPUSet", path, ALLOCATION)))


async def capabilities(c: Client) -> None:
    caps = await c.prop("Capabilities")
    result(check="capabilities", **{k: v.value for k, v in caps.items()})


async def isolated(c: Client) -> None:
    path, unit, cpus = await allocate(c, "iso", "2")
    victim = max(cpus)
    # a process started in system.slice before: the kernel takes the CPUs away from it
    sh("systemd-run", "--unit=outsider", "sleep", "600")
    outsider = int(sh("systemctl", "show", "outsider", "-p", "MainPID", "--value").stdout)
    pinned = sh("taskset", "-p", "-c", str(victim), str(outsider))
    # a process started in the partition's slice runs on its CPUs
    sh("systemd-run", f"--slice={unit}", "--unit=insider", "sleep", "600")
    insider = int(sh("systemctl", "show", "insider", "-p", "MainPID", "--value").stdout)
    result(check="isolated", unit=unit, cpus=sorted(cpus),
           partition=str(await c.prop("Partition", path, ALLOCATION)),
           partition_state=str(await c.prop("PartitionState", path, ALLOCATION)),
           state=str(await c.prop("State", path, ALLOCATION)),
           kernel=kernel_state(unit),
           root_isolated=sorted(parse(cgroup_file("cpuset.cpus.isolated"))),
           system_effective=sorted(parse(cgroup_file("system.slice/cpuset.cpus.effective"))),
           shared=sorted(parse(str(await c.prop("SharedCPUs")))),
           sys_isolated=Path("/sys/devices/system/cpu/isolated").read_text().strip(),
           isolated_cpus=str(await c.prop("IsolatedCPUs")),
           outsider=sorted(allowed(outsider)), taskset_status=pinned.returncode,
           taskset_error=pinned.stderr.strip()[-200:],
           insider=sorted(allowed(insider)))
    sh("systemctl", "stop", "outsider")
    # a restart of the daemon keeps the partition as it is, and reads the kernel's report again
    restarted = sh("systemctl", "restart", "cpuservice").returncode
    await wait_for(lambda: _answers(c))
    result(check="restarted", status=restarted, kernel=kernel_state(unit),
           partition_state=str(await c.prop("PartitionState", path, ALLOCATION)),
           cpus=sorted(parse(str(await c.prop("CPUSet", path, ALLOCATION)))),
           insider=sorted(allowed(insider)))
    sh("systemctl", "stop", "insider")
    await c.call("Release", "s", ["iso"])
    await asyncio.sleep(0.5)
    result(check="released", unit_active=sh("systemctl", "is-active", unit).stdout.strip(),
           shared=sorted(parse(str(await c.prop("SharedCPUs")))),
           isolated_cpus=str(await c.prop("IsolatedCPUs")),
           root_isolated=cgroup_file("cpuset.cpus.isolated"),
           system_effective=sorted(parse(cgroup_file("system.slice/cpuset.cpus.effective"))),
           online=cgroup_file("cpuset.cpus.effective"))


async def _answers(c: Client) -> bool:
    try:
        await c.allocations()
        return True
    except RuntimeError:  # not (yet) on the bus
        return False


async def offline(c: Client) -> None:
    """A partition of one CPU, with a process in it, whose CPU goes offline while no other CPU
    is free: the daemon announces it degraded and makes it a plain member on the shared pool
    (Linux 7.2 would keep it a "valid" partition with no CPU and the process stranded on the
    offline CPU); once CPUs are free again, Revalidate repairs it onto another CPU and the
    kernel reports it a valid partition again, the process running there."""
    victim = 0
    try:
        # a plain allocation first takes cpu0 (packed takes the lowest), which cannot go offline
        await c.call("Allocate", "ssa{sv}", ["pad", "1", {"bind": Variant("b", True)}])
        path, unit, cpus = await allocate(c, "off", "1")
        (victim,) = cpus
        if victim == 0:
            raise SystemExit("FAILED STEP: the partition got cpu0, which cannot go offline")
        sh("systemd-run", f"--slice={unit}", "--unit=offworker", "sleep", "600")
        worker = int(sh("systemctl", "show", "offworker", "-p", "MainPID", "--value").stdout)
        # every other CPU but the shared pool's last one taken: nothing can replace the victim
        free = len(parse(str(await c.prop("SharedCPUs")))) - 1
        await c.call("Allocate", "ssa{sv}", ["fill", str(free), {"bind": Variant("b", True)}])
        seen: list[dict[str, str]] = []

        def on_message(msg: Message) -> None:
            if msg.member == "PropertiesChanged" and msg.path == path:
                seen.append({k: str(v.value) for k, v in msg.body[1].items()})

        await c.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="AddMatch", signature="s",
            body=[f"type='signal',path='{path}'"]))
        c.bus.add_message_handler(on_message)
        set_online(victim, False)
        kernel_seen = [kernel_state(unit)]  # what the kernel says until the daemon has acted

        async def degraded() -> bool:
            if (now := kernel_state(unit)) != kernel_seen[-1]:
                kernel_seen.append(now)
            return str(await c.prop("State", path, ALLOCATION)) == "degraded"

        await wait_for(degraded)
        await asyncio.sleep(0.5)
        result(check="degraded", victim=victim, kernel=kernel_state(unit),
               kernel_seen=kernel_seen, shared=sorted(parse(str(await c.prop("SharedCPUs")))),
               partition_state=str(await c.prop("PartitionState", path, ALLOCATION)),
               state=str(await c.prop("State", path, ALLOCATION)),
               worker=sorted(allowed(worker)))
        await c.call("Release", "s", ["fill"])
        await c.call("Revalidate")

        async def repaired() -> bool:
            now = parse(str(await c.prop("CPUSet", path, ALLOCATION)))
            return victim not in now and len(now) == 1 and kernel_state(unit) == "isolated" and (
                str(await c.prop("State", path, ALLOCATION)) == "active")

        took = await wait_for(repaired)
        await asyncio.sleep(0.2)  # the last signals
        now = parse(str(await c.prop("CPUSet", path, ALLOCATION)))
        result(check="repaired", victim=victim, seen=seen, cpus=sorted(now),
               kernel=kernel_state(unit), seconds=took,
               partition_state=str(await c.prop("PartitionState", path, ALLOCATION)),
               state=str(await c.prop("State", path, ALLOCATION)),
               worker=sorted(allowed(worker)),
               root_isolated=sorted(parse(cgroup_file("cpuset.cpus.isolated"))))
    finally:  # leave the machine as found: the next scenarios need its CPUs
        sh("systemctl", "stop", "offworker")
        if victim:
            set_online(victim, True)
        for name in ("fill", "off", "pad"):
            with contextlib.suppress(RuntimeError):
                await c.call("Release", "s", [name])
    await asyncio.sleep(0.5)
    result(check="offline-released", root_isolated=cgroup_file("cpuset.cpus.isolated"),
           online=cgroup_file("cpuset.cpus.effective"))


async def refused(c: Client) -> None:
    """Debian 12 (systemd 252): an explicit partition is a named error and changes nothing."""
    before = await c.allocations()
    try:
        await c.call("Allocate", "ssa{sv}", ["nopart", "1", ISOLATED])
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    caps = await c.prop("Capabilities")
    result(check="refused", error=error, unchanged=await c.allocations() == before,
           partitions=list(caps["Partitions"].value),
           why=str(caps["PartitionsUnavailable"].value))


async def bench(c: Client, rounds: int) -> None:
    """partition_apply_ms: from calling Allocate with partition=isolated until the kernel reports
    the slice's partition isolated; partition_isolated_enforced: a system.slice process cannot
    be pinned to the partition's CPUs."""
    times = []
    enforced = True
    for i in range(rounds):
        start = time.monotonic()
        (path,) = await c.call("Allocate", "ssa{sv}", [f"b{i}", "2", ISOLATED])
        unit = str(await c.prop("Unit", path, ALLOCATION))
        while kernel_state(unit) != "isolated":
            if time.monotonic() - start > 20:
                raise TimeoutError(f"{unit}: {kernel_state(unit)}")
            await asyncio.sleep(0.001)
        times.append((time.monotonic() - start) * 1000)
        cpu = max(parse(str(await c.prop("CPUSet", path, ALLOCATION))))
        enforced &= sh("taskset", "-p", "-c", str(cpu), "1").returncode != 0
        await c.call("Release", "s", [f"b{i}"])
    result(check="bench", p50=statistics.median(times), max=max(times), rounds=rounds,
           enforced=enforced)


async def main(argv: list[str]) -> None:
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    c = Client(bus)
    if argv[0] == "capabilities":
        await capabilities(c)
    elif argv[0] == "isolated":
        await isolated(c)
    elif argv[0] == "offline":
        await offline(c)
    elif argv[0] == "refused":
        await refused(c)
    elif argv[0] == "bench":
        await bench(c, int(argv[1]))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
