"""VM lab scenario: lending idle exclusive CPUs on a real kernel (issue 26). Prints one JSON
object per check on lines starting with ``RESULT ``.

    python3 lending.py check          # a borrower never runs on a withdrawn core
    python3 lending.py bench ROUNDS   # owner latency unlent/lent, harvest, withdrawal time

An owner of 4 bound CPUs (two whole cores of the lab's 2 x 2 x 2 machine) lends them; a
borrower (unbound, option borrow, as many CPUs as the machine has) runs ``stress-ng --cpu`` with
one worker per online CPU, so that it covers every lent CPU. ``check`` makes the owner busy
(two spinning processes in its slice) and watches, every 10 ms, the borrow slice's
``cpuset.cpus.effective``, the borrower's cgroup's, each borrower task's ``Cpus_allowed_list``
and the CPU it last ran on: from the first instant the withdrawal is seen, no borrower may be on
a withdrawn core again. Then the owner goes idle (lent again), is released while lent, and a new
bound allocation takes the same CPUs: the borrower must never be on them again.

``bench`` runs cyclictest (SCHED_OTHER, a low duty cycle: one wake-up every 10 ms per thread) on
the owner's CPUs with the borrower running, first with lending off, then lent; reads the
borrower's CPU time on the lent cores (/proc/stat of those CPUs less the owner's own usage)
against the owner's idle time there; and times withdrawals: from the owner's spinners starting
to the borrow slice's cgroup no longer having the lent cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from dbus_fast import BusType, Variant
from dbus_fast.aio import MessageBus
from hotplug import ALLOCATION, Client, parse, result

CGROUP = Path("/sys/fs/cgroup")
OWNER_CPUS = os.environ.get("CPUSERVICE_LENDING_OWNER", "4")  # bound CPUs, whole cores
BORROW = CGROUP / "cpuservice.slice/cpuservice-borrow.slice"
SPIN = Path("/run/lending-spin")
# idle (a look every 10 ms, no fork: a shell's sleep would cost the owner's load under TCG)
# until SPIN exists, then busy until it is gone
SPINNER = f"""import os, time
while True:
    if os.path.exists({str(SPIN)!r}):
        while os.path.exists({str(SPIN)!r}):
            pass
    else:
        time.sleep(0.01)
"""


def run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def effective(cgroup: Path) -> set[int]:
    """The cgroup's effective CPUs: those of the nearest cgroup at or above it that has the
    cpuset controller (systemd enables it only where some unit sets AllowedCPUs)."""
    while not (cgroup / "cpuset.cpus.effective").exists() and cgroup != CGROUP:
        cgroup = cgroup.parent
    return parse((cgroup / "cpuset.cpus.effective").read_text().strip())


def group_of(unit: str) -> Path:
    """The unit's cgroup (it must have one: a unit that is gone has none)."""
    group = run("systemctl", "show", unit, "-p", "ControlGroup", "--value").strip()
    if not group:
        state = run("systemctl", "show", unit, "-p", "ActiveState,SubState,Result")
        log = subprocess.run(["journalctl", "-q", "-n", "30", "-u", unit], capture_output=True,
                             text=True).stdout
        raise SystemExit(f"FAILED STEP: {unit} has no cgroup: {state.split()}\n{log}")
    return CGROUP / group.lstrip("/")


def tasks(cgroup: Path) -> list[int]:
    """Every thread in the cgroup and below it."""
    out: list[int] = []
    for threads in cgroup.rglob("cgroup.threads"):
        with contextlib.suppress(OSError):  # gone meanwhile
            out += [int(t) for t in threads.read_text().split()]
    return out


def task_cpus(tid: int) -> tuple[set[int], int] | None:
    """A thread's Cpus_allowed_list and the CPU it last ran on (None: it is gone)."""
    try:
        status = Path(f"/proc/{tid}/status").read_text()
        stat = Path(f"/proc/{tid}/stat").read_text()
    except OSError:
        return None
    allowed = next(parse(line.split(":", 1)[1].strip()) for line in status.splitlines()
                   if line.startswith("Cpus_allowed_list:"))
    return allowed, int(stat.rsplit(")", 1)[1].split()[36])  # field 39: processor


def cpu_busy(cpus: set[int]) -> float:
    """Seconds the CPUs were not idle since boot (/proc/stat: all but idle and iowait)."""
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(f) for f in fields[:8]]
            total += sum(values) - values[3] - values[4]
    return total / hz


def usage(cgroup: Path) -> float:
    """Seconds of CPU time the cgroup used (cpu.stat usage_usec)."""
    for line in (cgroup / "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    raise RuntimeError(f"no usage_usec in {cgroup}")


class Lab:
    def __init__(self, c: Client) -> None:
        self.c = c
        self.cpus: set[int] = set()
        self.owner_unit = ""

    async def setup(self) -> None:
        online = len(parse(Path("/sys/devices/system/cpu/online").read_text().strip()))
        await self.c.call("Allocate", "ssa{sv}", ["owner", OWNER_CPUS, {
            "bind": Variant("b", True), "lend": Variant("b", True),
            "policy": Variant("s", "full-pcpus")}])
        await self.c.call("Allocate", "ssa{sv}", ["borrower", str(online),
                                                  {"borrow": Variant("b", True)}])
        rows = await self.c.allocations()
        self.cpus = parse(rows["owner"][3])
        self.owner_unit = str(await self.c.prop("Unit", rows["owner"][4], ALLOCATION))
        SPIN.unlink(missing_ok=True)
        for i in range(2):  # idle until SPIN exists: then each keeps a CPU busy
            run("systemd-run", f"--slice={self.owner_unit}", f"--unit=lend-spin{i}",
                "python3", "-c", SPINNER)
        # one integer method: the default cycles through methods whose vector instructions
        # QEMU's software CPU claims but does not implement (SIGILL)
        run("systemd-run", "--slice=cpuservice-borrow-borrower.slice", "--unit=lend-borrower",
            "stress-ng", "--cpu", str(online), "--cpu-method", "fibonacci", "--timeout", "3600")

    async def lent(self) -> set[int]:
        path = (await self.c.allocations())["owner"][4]
        return parse(str(await self.c.prop("LentCPUs", path, ALLOCATION)))

    async def wait_lent(self, seconds: float = 30.0) -> float:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if await self.lent() == self.cpus and self.cpus <= effective(BORROW):
                return time.monotonic() - start
            await asyncio.sleep(0.02)
        raise SystemExit(f"FAILED STEP: the owner's CPUs {sorted(self.cpus)} were not lent "
                         f"within {seconds} s")

    def borrower_on(self, cpus: set[int]) -> list[str]:
        """Where the borrower is on ``cpus``: the borrow slice's and its own cgroup's
        effective CPUs, its tasks' masks, the CPU each last ran on."""
        found = []
        own = group_of("lend-borrower")
        for name, group in (("borrow slice", BORROW), ("borrower cgroup", own)):
            if effective(group) & cpus:
                found.append(f"{name} effective {sorted(effective(group) & cpus)}")
        for tid in tasks(own):
            seen = task_cpus(tid)
            if seen is None:
                continue
            allowed, last = seen
            if allowed & cpus:
                found.append(f"task {tid} Cpus_allowed_list {sorted(allowed)}")
            if last in cpus:
                found.append(f"task {tid} last ran on {last}")
        return found

    async def withdraw(self, seconds: float = 20.0) -> float:
        """Start the owner's spinners; ms until the borrow slice has none of its CPUs."""
        start = time.monotonic()
        SPIN.touch()
        while effective(BORROW) & self.cpus:
            if time.monotonic() - start > seconds:
                raise SystemExit("FAILED STEP: the lent cores were not withdrawn within "
                                 f"{seconds} s of the owner getting busy")
            await asyncio.sleep(0.002)
        return (time.monotonic() - start) * 1000

    def idle(self) -> None:
        SPIN.unlink(missing_ok=True)

    def teardown(self) -> None:
        self.idle()
        for unit in ("lend-spin0", "lend-spin1", "lend-borrower", "lend-cyclictest"):
            subprocess.run(["systemctl", "stop", unit], capture_output=True)


async def watch(lab: Lab, cpus: set[int], seconds: float) -> list[str]:
    """Every 10 ms for ``seconds``: where the borrower is on ``cpus`` (should be nowhere)."""
    out: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out += [f"{time.monotonic() - end + seconds:.3f}s: {x}" for x in lab.borrower_on(cpus)]
        await asyncio.sleep(0.01)
    return out


async def ran_on(lab: Lab, seconds: float) -> set[int]:
    """The CPUs the borrower's tasks were seen last running on, every 10 ms for ``seconds``."""
    seen: set[int] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen |= {x[1] for tid in tasks(group_of("lend-borrower"))
                 if (x := task_cpus(tid)) is not None}
        await asyncio.sleep(0.01)
    return seen


# the kernel updates a cgroup's effective CPUs, then its tasks' masks, in one write: a look
# right after the first may catch the second half-way; what counts is from this long after
SETTLE = 0.05


async def check(c: Client) -> None:
    lab = Lab(c)
    await lab.setup()
    try:
        took = await lab.wait_lent()
        ran = sorted(await ran_on(lab, 2.0) & lab.cpus)  # the borrower spreads onto them
        result(check="lent", cpus=sorted(lab.cpus), seconds=took,
               borrow_slice=sorted(effective(BORROW)),
               borrower_cgroup=sorted(effective(group_of("lend-borrower"))), ran_on_lent=ran)
        ms = await lab.withdraw()
        settle = await watch(lab, lab.cpus, SETTLE)
        result(check="withdrawn", ms=ms, settle=settle, after=await watch(lab, lab.cpus, 3.0),
               lent=sorted(await lab.lent()))
        lab.idle()
        again = await lab.wait_lent()
        result(check="lent-again", seconds=again)
        # released while lent; a new owner of the same CPUs: never the borrower's again
        await c.call("Release", "s", ["owner"])
        await c.call("Allocate", "ssa{sv}", ["newowner", str(len(lab.cpus)), {
            "bind": Variant("b", True), "cpuset": Variant("s", ",".join(map(str, lab.cpus)))}])
        settle = await watch(lab, lab.cpus, SETTLE)
        result(check="new-owner", settle=settle, after=await watch(lab, lab.cpus, 2.0),
               borrow_slice=sorted(effective(BORROW)))
        await c.call("Release", "s", ["newowner"])
    finally:
        lab.teardown()
        await c.call("Release", "s", ["borrower"])


def p99(histogram: str) -> tuple[float, float]:
    """p99 and max latency in µs from cyclictest's histogram output (all threads together)."""
    counts: dict[int, int] = {}
    overflow, worst = 0, 0.0
    for line in histogram.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit():
            counts[int(parts[0])] = counts.get(int(parts[0]), 0) + sum(int(x) for x in parts[1:])
        elif line.startswith("# Histogram Overflows:"):
            overflow = sum(int(x) for x in line.split(":")[1].split())
        elif line.startswith("# Max Latencies:"):
            worst = max(float(x) for x in line.split(":")[1].split())
    total = sum(counts.values()) + overflow
    seen = 0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen >= 0.99 * total:
            return float(bucket), worst
    return worst, worst


def cyclictest(lab: Lab, seconds: int) -> tuple[float, float]:
    """cyclictest on the owner's CPUs, in its slice: one thread per CPU, SCHED_OTHER, a
    wake-up every 10 ms."""
    cpus = ",".join(map(str, sorted(lab.cpus)))
    out = run("systemd-run", "--wait", "--pipe", "--quiet", f"--slice={lab.owner_unit}",
              "--unit=lend-cyclictest", "cyclictest", "--mlockall", "--quiet",
              f"--duration={seconds}", "--interval=10000", f"--threads={len(lab.cpus)}",
              f"--affinity={cpus}", "--histogram=20000")
    return p99(out)


class Harvest:
    """The share of the owner's idle time on its CPUs that others used, over a ``with`` block:
    /proc/stat's busy time of those CPUs less the owner's own cgroup usage, over the CPUs'
    time less that usage."""

    def __init__(self, lab: Lab, owner: Path) -> None:
        self.lab, self.owner, self.value = lab, owner, 0.0

    def __enter__(self) -> Harvest:
        self.busy, self.used = cpu_busy(self.lab.cpus), usage(self.owner)
        self.start = time.monotonic()
        return self

    def __exit__(self, *_: object) -> None:
        used = usage(self.owner) - self.used
        idle = len(self.lab.cpus) * (time.monotonic() - self.start) - used
        others = cpu_busy(self.lab.cpus) - self.busy - used
        self.value = others / idle if idle > 0 else 0.0


async def bench(c: Client, rounds: int) -> None:
    lab = Lab(c)
    await lab.setup()
    seconds = int(os.environ.get("CPUSERVICE_LENDING_SECONDS", "30"))
    try:
        await lab.wait_lent()
        owner = group_of(lab.owner_unit)
        await c.call("SetLending", "sb", ["owner", False])
        with Harvest(lab, owner) as unlent_harvest:
            unlent, unlent_max = cyclictest(lab, seconds)
        await c.call("SetLending", "sb", ["owner", True])
        await lab.wait_lent()
        with Harvest(lab, owner) as harvest:
            lent, lent_max = cyclictest(lab, seconds)
        still = await lab.lent() == lab.cpus
        times = []
        for _ in range(rounds):
            times.append(await lab.withdraw())
            lab.idle()
            await lab.wait_lent()
        times.sort()
        result(check="bench", unlent_p99=unlent, lent_p99=lent, unlent_max=unlent_max,
               lent_max=lent_max, harvest=harvest.value, unlent_harvest=unlent_harvest.value,
               lent_throughout=still,
               withdraw_p50=times[len(times) // 2], withdraw_max=times[-1], rounds=rounds,
               seconds=seconds)
    finally:
        lab.teardown()
        await c.call("Release", "s", ["owner"])
        await c.call("Release", "s", ["borrower"])


async def main(argv: list[str]) -> None:
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    c = Client(bus)
    if argv[0] == "check":
        await check(c)
    elif argv[0] == "bench":
        await bench(c, int(argv[1]))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
