"""VM lab scenario: lending idle exclusive CPUs on a real kernel (issue 26). Prints one JSON
object per check on lines starting with ``RESULT ``.

    python3 lending.py check          # a borrower never runs on a withdrawn core
    python3 lending.py bench ROUNDS   # owner latency unlent/lent, harvest, withdrawal time

An owner of bound CPUs (CPUSERVICE_LENDING_OWNER, 4: two whole cores of the lab's 2 x 2 x 2
machine) lends them; a borrower (unbound, option borrow, as many CPUs as the machine has) runs
``stress-ng --cpu`` with one worker per online CPU, so that it covers every lent CPU. ``check``
makes the owner busy (two spinning processes in its slice) and watches, every 10 ms, the borrow
slice's ``cpuset.cpus.effective``, the borrower's cgroup's, each borrower task's
``Cpus_allowed_list`` and the CPU it ran on (if it ran since the look before: one asleep keeps
the CPU it last ran on, even one no longer in its mask): from the first instant the withdrawal
is seen, no borrower may be on a withdrawn core again. Then the owner goes idle (lent again),
and one of its threads, pinned to one of its CPUs, spins for a while (issue 37: lending is per
core): every 10 ms the CPU each owner thread that ran since the last look ran on last, and
where the borrower is; from the withdrawal of that core on, no borrower may be on a core, or
its sibling, that an owner thread ran on in the previous 50 ms (a sample of the daemon), while
the owner's other core stays lent. Then the owner is released while lent, and a new bound
allocation takes the same CPUs: the borrower must never be on them again.

``bench`` runs one cyclictest (SCHED_OTHER, a low duty cycle: one wake-up every 10 ms per
thread) on the owner's CPUs, with the borrower running, and measures two windows of it: lent,
then with lending off. In each: the owner's wake-up latencies, and the harvest (the borrower's
user time on the owner's CPUs over the owner's idle time there). Then it times withdrawals:
from the owner's spinners being woken to the borrow slice's cgroup no longer having its cores.
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
WAKE = Path("/run/lending-wake")  # a FIFO: the spinners sleep in open() until it is opened
PIN = Path("/run/lending-pin")  # the same for the spinner pinned to one CPU
PIN_WAKE = Path("/run/lending-pin-wake")
# no CPU time at all while idle (a look every few ms would be a load of its own under TCG):
# blocked until the FIFO is opened for writing, then busy while the flag file exists; it
# creates its ready file first, once Python has started (seconds of a busy CPU under TCG,
# and longer when the host is loaded: the time until the owner is lent starts after that)
SPINNER = """import os
open({ready!r}, "a").close()
while True:
    os.close(os.open({wake!r}, os.O_RDONLY))
    while os.path.exists({flag!r}):
        pass
"""


def ready(name: str) -> Path:
    """The file a spinner creates once its Python has started."""
    return Path(f"/run/lending-ready-{name}")


async def started(*names: str, seconds: float = 120.0) -> None:
    """Until the spinners ``names`` have started and are about to sleep."""
    end = time.monotonic() + seconds
    while not all(ready(n).exists() for n in names):
        if time.monotonic() > end:
            raise SystemExit(f"FAILED STEP: the spinners {', '.join(names)} did not start "
                             f"within {seconds:.0f} s")
        await asyncio.sleep(0.1)


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


def task_allowed(tid: int) -> set[int] | None:
    """A thread's Cpus_allowed_list (None: it is gone)."""
    try:
        status = Path(f"/proc/{tid}/status").read_text()
    except OSError:
        return None
    return next(parse(line.split(":", 1)[1].strip()) for line in status.splitlines()
                if line.startswith("Cpus_allowed_list:"))


def cpu_user(cpus: set[int]) -> float:
    """Seconds the CPUs ran user code since boot (/proc/stat: user and nice). The borrower's
    stress-ng is all user time; the kernel's own work there (interrupts, softirqs, kernel
    threads) is not, and is no one's harvest."""
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            total += int(fields[0]) + int(fields[1])
    return total / hz


def usage(cgroup: Path, key: str = "usage_usec") -> float:
    """Seconds of CPU time the cgroup used (cpu.stat ``key``: usage_usec, user_usec)."""
    for line in (cgroup / "cpu.stat").read_text().splitlines():
        if line.startswith(f"{key} "):
            return int(line.split()[1]) / 1e6
    raise RuntimeError(f"no {key} in {cgroup}")


class Lab:
    def __init__(self, c: Client) -> None:
        self.c = c
        self.cpus: set[int] = set()
        self.owner_unit = ""

    async def setup(self) -> None:
        online = len(parse(Path("/sys/devices/system/cpu/online").read_text().strip()))
        for name in await self.c.allocations():  # earlier scenarios of the boot may leave some
            await self.c.call("Release", "s", [name])
        await self.c.call("Allocate", "ssa{sv}", ["owner", OWNER_CPUS, {
            "bind": Variant("b", True), "lend": Variant("b", True),
            "policy": Variant("s", "full-pcpus")}])
        await self.c.call("Allocate", "ssa{sv}", ["borrower", str(online),
                                                  {"borrow": Variant("b", True)}])
        rows = await self.c.allocations()
        self.cpus = parse(rows["owner"][3])
        self.owner_unit = str(await self.c.prop("Unit", rows["owner"][4], ALLOCATION))
        for path in (SPIN, WAKE, PIN, PIN_WAKE):
            path.unlink(missing_ok=True)
        os.mkfifo(WAKE)
        os.mkfifo(PIN_WAKE)
        for i in range(2):  # asleep until woken: then each keeps a CPU busy while SPIN is
            ready(f"spin{i}").unlink(missing_ok=True)
            run("systemd-run", f"--slice={self.owner_unit}", f"--unit=lend-spin{i}",
                "python3", "-c", SPINNER.format(wake=str(WAKE), flag=str(SPIN),
                                                ready=str(ready(f"spin{i}"))))
        await started("spin0", "spin1")
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
                         f"within {seconds} s; {await self.owner_load()}")

    async def owner_load(self, seconds: float = 2.0) -> str:
        """What the daemon sees of the owner, for a failure's message: its cgroup's usage in
        50 ms windows (the share of them at or above lend_idle_percent, 5 %, and the largest)
        and each of its threads' share over ``seconds``."""
        group = group_of(self.owner_unit)
        files = thread_files(group)
        before = {t: runtime(t) or 0 for t in threads_of(files)}
        windows, last, start = [], usage(group), time.monotonic()
        while time.monotonic() - start < seconds:
            t0 = time.monotonic()
            await asyncio.sleep(0.05)
            now = usage(group)
            windows.append((now - last) / (time.monotonic() - t0) * 100)
            last = now
        took = time.monotonic() - start
        shares = []
        for tid in threads_of(files):
            comm = "?"
            with contextlib.suppress(OSError):
                comm = Path(f"/proc/{tid}/comm").read_text().strip()
            ran = (runtime(tid) or 0) - before.get(tid, 0)
            shares.append(f"{tid} {comm} {ran / 1e7 / took:.1f}%")
        busy = sum(w >= 5 for w in windows)
        return (f"owner load in 50 ms windows: {busy} of {len(windows)} at 5 % or more, max "
                f"{max(windows, default=0):.1f} %, mean {sum(windows) / max(1, len(windows)):.1f} "
                f"%; threads: {', '.join(shares)}")

    def borrower_on(self, cpus: set[int], ran: Ran) -> list[str]:
        """Where the borrower is on ``cpus``: the borrow slice's and its own cgroup's
        effective CPUs, its tasks' masks, the CPU each ran on last if it ran since the look
        before (``ran``: a thread asleep keeps the CPU it last ran on, even one its mask no
        longer has)."""
        found = []
        own = group_of("lend-borrower")
        for name, group in (("borrow slice", BORROW), ("borrower cgroup", own)):
            if effective(group) & cpus:
                found.append(f"{name} effective {sorted(effective(group) & cpus)}")
        for tid in tasks(own):
            allowed = task_allowed(tid)
            if allowed is None:
                continue
            if allowed & cpus:
                found.append(f"task {tid} Cpus_allowed_list {sorted(allowed)}")
            last = ran.last(tid)
            if last in cpus:
                found.append(f"task {tid} ({ran.what(tid)}) ran on {last}")
        return found

    async def withdraw(self, seconds: float = 20.0) -> float:
        """Start the owner's spinners; ms until the borrow slice has none of its CPUs."""
        start = time.monotonic()
        SPIN.touch()
        self.wake()
        while effective(BORROW) & self.cpus:
            if time.monotonic() - start > seconds:
                raise SystemExit("FAILED STEP: the lent cores were not withdrawn within "
                                 f"{seconds} s of the owner getting busy")
            await asyncio.sleep(0.002)
        return (time.monotonic() - start) * 1000

    def wake(self) -> None:
        """Open WAKE for writing: every spinner blocked in its open() returns."""
        try:
            os.close(os.open(WAKE, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:  # ENXIO: no spinner is waiting
            raise SystemExit(f"FAILED STEP: no spinner to wake: {exc}") from None

    async def pinned(self, cpu: int) -> None:
        """One more spinner of the owner, pinned to ``cpu``, asleep until pin() wakes it."""
        ready("pinned").unlink(missing_ok=True)
        run("systemd-run", f"--slice={self.owner_unit}", "--unit=lend-pinned", "taskset", "-c",
            str(cpu), "python3", "-c", SPINNER.format(wake=str(PIN_WAKE), flag=str(PIN),
                                                      ready=str(ready("pinned"))))
        await started("pinned")

    def pin(self) -> None:
        PIN.touch()
        try:
            os.close(os.open(PIN_WAKE, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            raise SystemExit(f"FAILED STEP: the pinned spinner is not waiting: {exc}") from None

    def idle(self) -> None:
        SPIN.unlink(missing_ok=True)
        PIN.unlink(missing_ok=True)

    def teardown(self) -> None:
        self.idle()
        for unit in ("lend-spin0", "lend-spin1", "lend-pinned", "lend-borrower",
                     "lend-cyclictest"):
            subprocess.run(["systemctl", "stop", unit], capture_output=True)


async def watch(lab: Lab, cpus: set[int], seconds: float, ran: Ran) -> list[str]:
    """Every 10 ms for ``seconds``: where the borrower is on ``cpus`` (should be nowhere)."""
    out: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out += [f"{time.monotonic() - end + seconds:.3f}s: {x}"
                for x in lab.borrower_on(cpus, ran)]
        await asyncio.sleep(0.01)
    return out


async def ran_on(lab: Lab, seconds: float, enough: set[int] | None = None) -> set[int]:
    """The CPUs the borrower's tasks ran on, looked at every 10 ms for ``seconds``, or until
    one of them was one of ``enough``."""
    seen: set[int] = set()
    ran = Ran()
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (enough and seen & enough):
        seen |= {cpu for tid in tasks(group_of("lend-borrower"))
                 if (cpu := ran.last(tid)) is not None}
        await asyncio.sleep(0.01)
    return seen


class Ran:
    """The CPU a thread ran on last, if it ran since the look before. A thread that sleeps
    keeps, in /proc/TID/stat, the CPU it last ran on, even once its mask no longer has that
    CPU: only its run time growing says it ran (there or where it is now). A thread seen for
    the first time counts as having run."""

    def __init__(self) -> None:
        self.runtimes: dict[int, int] = {}

    def last(self, tid: int) -> int | None:
        seen, before, cpu = runtime(tid), self.runtimes.get(tid), last_cpu(tid)
        if seen is None or cpu is None:
            return None
        self.runtimes[tid] = seen
        return cpu if before is None or seen > before else None

    @staticmethod
    def what(tid: int) -> str:
        """The thread's name and state, for a report."""
        try:
            stat = Path(f"/proc/{tid}/stat").read_text()
        except OSError:
            return "gone"
        return f"{stat[stat.index('(') + 1:stat.rindex(')')]} {stat.rsplit(')', 1)[1].split()[0]}"


# the kernel updates a cgroup's effective CPUs, then its tasks' masks, in one write: a look
# right after the first may catch the second half-way; what counts is from this long after
SETTLE = 0.05
WINDOW = 0.05  # the daemon's sample (lend_sample_ms): "the previous sample window"


def runtime(tid: int) -> int | None:
    """A thread's run time in ns (/proc/TID/schedstat; None: it is gone)."""
    try:
        return int(Path(f"/proc/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def last_cpu(tid: int) -> int | None:
    """The CPU a thread ran on last (/proc/TID/stat field 39; None: it is gone)."""
    try:
        return int(Path(f"/proc/{tid}/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def thread_files(cgroup: Path) -> list[Path]:
    """The cgroup.threads files of the cgroup and those below it (found once: a look every
    10 ms reads only these)."""
    return list(cgroup.rglob("cgroup.threads"))


def threads_of(files: list[Path]) -> list[int]:
    out: list[int] = []
    for f in files:
        with contextlib.suppress(OSError):
            out += [int(t) for t in f.read_text().split()]
    return out


def core_of(cpu: int) -> set[int]:
    """``cpu`` and its SMT siblings."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return parse(path.read_text().strip())


async def per_core(lab: Lab, seconds: float) -> dict[str, object]:
    """Issue 37: the pinned spinner runs on one core of the owner for ``seconds``. Every
    10 ms: the cores the owner's threads ran on since the last look (the CPU each last ran
    on, if its run time grew), where the borrower is (its tasks' last CPUs and the borrow
    slice's effective CPUs), and whether the owner's other cores are lent. From the look that
    finds the spinner's core withdrawn (and SETTLE after it), a borrower on a core an owner
    thread ran on in the previous WINDOW (or since the look before) is a violation."""
    owner = thread_files(group_of(lab.owner_unit))
    own = thread_files(group_of("lend-borrower"))
    borrower = Ran()
    spinner_core = core_of(min(lab.cpus))
    others = lab.cpus - spinner_core
    cores = {cpu: core_of(cpu) for cpu in lab.cpus}
    last: dict[int, int] = {}
    history: list[tuple[float, set[int]]] = []  # (time, CPUs the owner ran on since the last)
    violations: list[str] = []
    withdrawn_at: float | None = None
    looks = others_lent = 0
    borrower_on_others: set[int] = set()
    changes: list[str] = []  # when the other core came and went
    lent_before = True
    epoch = time.time()
    start = time.monotonic()
    lab.pin()
    while (now := time.monotonic()) - start < seconds:
        ran: set[int] = set()
        for tid in threads_of(owner):
            seen, before, cpu = runtime(tid), last.get(tid), last_cpu(tid)
            if seen is None or cpu is None:
                continue
            last[tid] = seen
            if before is not None and seen > before:
                ran |= cores.get(cpu) or core_of(cpu)
        history.append((now, ran))
        borrow = effective(BORROW)
        on = {cpu for tid in threads_of(own) if (cpu := borrower.last(tid)) is not None}
        if withdrawn_at is None and not borrow & spinner_core:
            withdrawn_at = now
        if (others <= borrow) != lent_before:
            lent_before = not lent_before
            changes.append(f"{now - start:.3f}s: other core {'lent' if lent_before else 'gone'}")
        if withdrawn_at is not None and now - withdrawn_at >= SETTLE:
            looks += 1
            others_lent += others <= borrow
            borrower_on_others |= on & others
            # the owner's cores in the previous WINDOW, and since the look before (under
            # TCG a look may take longer than a window)
            recent = set().union(*(cpus for t, cpus in history if now - t <= WINDOW + 0.01),
                                 *(cpus for _, cpus in history[-2:]))
            for cpu in sorted(on & recent):
                violations.append(f"{now - start:.3f}s: a borrower on {cpu}, where the owner "
                                  f"ran in the previous {WINDOW * 1000:.0f} ms")
            if borrow & recent:
                violations.append(f"{now - start:.3f}s: borrow slice has "
                                  f"{sorted(borrow & recent)}")
        await asyncio.sleep(0.01)
    PIN.unlink(missing_ok=True)
    journal = subprocess.run(["journalctl", "-q", "-o", "cat", "-u", "cpuservice",
                              f"--since=@{epoch:.0f}"], capture_output=True, text=True).stdout
    return {"spinner_core": sorted(spinner_core), "others": sorted(others),
            "others_changes": changes[:20], "journal": journal.splitlines()[-20:],
            "withdrawn_ms": None if withdrawn_at is None else (withdrawn_at - start) * 1000,
            "owner_ran_on": sorted(set().union(*(c for _, c in history))),
            "violations": violations[:20], "violation_count": len(violations),
            "looks": looks, "others_lent_looks": others_lent,
            "others_lent_at_end": others <= effective(BORROW),
            "borrower_on_others": sorted(borrower_on_others)}


async def check(c: Client) -> None:
    lab = Lab(c)
    await lab.setup()
    await lab.pinned(min(lab.cpus))
    try:
        took = await lab.wait_lent()
        # the borrower spreads onto them: seen within 2 s on a quiet host, but its workers may
        # take longer to start or move on a loaded one (the gate runs the lab beside other tiers)
        ran = sorted(await ran_on(lab, 20.0, lab.cpus) & lab.cpus)
        result(check="lent", cpus=sorted(lab.cpus), seconds=took,
               borrow_slice=sorted(effective(BORROW)),
               borrower_cgroup=sorted(effective(group_of("lend-borrower"))), ran_on_lent=ran)
        ms = await lab.withdraw()
        ran = Ran()  # the looks while it settles are the first: each thread counts there
        settle = await watch(lab, lab.cpus, SETTLE, ran)
        result(check="withdrawn", ms=ms, settle=settle,
               after=await watch(lab, lab.cpus, 3.0, ran),
               lent=sorted(await lab.lent()))
        lab.idle()
        again = await lab.wait_lent()
        result(check="lent-again", seconds=again)
        result(check="per-core", **await per_core(lab, 8.0))
        lab.idle()
        await lab.wait_lent()  # the pinned core is lent again once its thread is idle
        # released while lent; a new owner of the same CPUs: never the borrower's again
        await c.call("Release", "s", ["owner"])
        await c.call("Allocate", "ssa{sv}", ["newowner", str(len(lab.cpus)), {
            "bind": Variant("b", True), "cpuset": Variant("s", ",".join(map(str, lab.cpus)))}])
        ran = Ran()
        settle = await watch(lab, lab.cpus, SETTLE, ran)
        result(check="new-owner", settle=settle, after=await watch(lab, lab.cpus, 2.0, ran),
               borrow_slice=sorted(effective(BORROW)))
        await c.call("Release", "s", ["newowner"])
    finally:
        lab.teardown()
        await c.call("Release", "s", ["borrower"])


INTERVAL_US = 10_000  # cyclictest's period: one wake-up every 10 ms per thread
CYCLICTEST_OUT = Path("/run/lending-cyclictest.out")


def p99(latencies: list[int]) -> tuple[float, float]:
    """p99 and max of wake-up latencies in µs."""
    if not latencies:
        raise SystemExit("FAILED STEP: cyclictest measured nothing in a phase")
    ordered = sorted(latencies)
    return float(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]), float(ordered[-1])


class Cyclictest:
    """cyclictest on the owner's CPUs, in its slice, for the whole benchmark: one thread per
    CPU, SCHED_OTHER, a wake-up every 10 ms, every latency printed (-v). One run for both
    phases: its start (exec, memory locking) is a burst of the owner's load that withdraws
    what is lent, so the phases are time windows of one run, chosen once lending is back.
    Cycle k of a thread happens no earlier than the unit's start + k periods, so a window
    [a, b] keeps the cycles nominally in [a, b - margin]."""

    MARGIN = 1.0  # s: cyclictest's own start-up delay (exec, mlock) is less than this

    def __init__(self, lab: Lab) -> None:
        cpus = ",".join(map(str, sorted(lab.cpus)))
        CYCLICTEST_OUT.unlink(missing_ok=True)
        run("systemd-run", "--quiet", f"--slice={lab.owner_unit}", "--unit=lend-cyclictest",
            f"--property=StandardOutput=file:{CYCLICTEST_OUT}", "cyclictest", "--mlockall",
            "--verbose", f"--interval={INTERVAL_US}", f"--threads={len(lab.cpus)}",
            f"--affinity={cpus}")
        started = run("systemctl", "show", "lend-cyclictest", "-p",
                      "ExecMainStartTimestampMonotonic", "--value").strip()
        self.start = int(started) / 1e6  # CLOCK_MONOTONIC, as time.monotonic()

    def stop(self) -> dict[int, list[int]]:
        """End it; the latencies (µs) by cycle number, all threads together."""
        run("systemctl", "stop", "lend-cyclictest")
        cycles: dict[int, list[int]] = {}
        for line in CYCLICTEST_OUT.read_text().splitlines():
            parts = line.replace(" ", "").split(":")
            if len(parts) == 3 and all(p.isdigit() for p in parts):
                cycles.setdefault(int(parts[1]), []).append(int(parts[2]))
        return cycles

    def window(self, cycles: dict[int, list[int]], a: float, b: float) -> list[int]:
        first = (a - self.start) * 1e6 / INTERVAL_US
        last = (b - self.MARGIN - self.start) * 1e6 / INTERVAL_US
        return [x for k, values in cycles.items() if first <= k <= last for x in values]


class Harvest:
    """The share of the owner's idle time on its CPUs that others' user code used, over a
    ``with`` block: the user time of those CPUs (/proc/stat) less the owner's own (cpu.stat
    user_usec), over the CPUs' time less all the owner used. ``start``, ``end``: the block's
    monotonic times."""

    def __init__(self, lab: Lab, owner: Path) -> None:
        self.lab, self.owner, self.value = lab, owner, 0.0
        self.start = self.end = 0.0

    def _read(self) -> tuple[float, float, float]:
        return (cpu_user(self.lab.cpus), usage(self.owner),
                usage(self.owner, "user_usec"))

    def __enter__(self) -> Harvest:
        self.before = self._read()
        self.start = time.monotonic()
        return self

    def __exit__(self, *_: object) -> None:
        self.end = time.monotonic()
        user, used, owner_user = (b - a for a, b in zip(self.before, self._read(), strict=True))
        idle = len(self.lab.cpus) * (self.end - self.start) - used
        self.value = (user - owner_user) / idle if idle > 0 else 0.0


async def phase(lab: Lab, owner: Path, seconds: float) -> tuple[Harvest, bool]:
    """One measured phase: the harvest over ``seconds``, and whether what was lent at its
    start stayed lent throughout (looked at every 100 ms)."""
    before = await lab.lent()
    steady = True
    with Harvest(lab, owner) as harvest:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            steady = steady and await lab.lent() == before
    return harvest, steady


async def bench(c: Client, rounds: int) -> None:
    lab = Lab(c)
    await lab.setup()
    seconds = int(os.environ.get("CPUSERVICE_LENDING_SECONDS", "30"))
    try:
        await lab.wait_lent()
        owner = group_of(lab.owner_unit)
        test = Cyclictest(lab)
        relent = await lab.wait_lent()  # after the withdrawal cyclictest's start caused
        lent, lent_steady = await phase(lab, owner, seconds)
        await c.call("SetLending", "sb", ["owner", False])
        unlent, unlent_steady = await phase(lab, owner, seconds)
        cycles = test.stop()
        unlent_p99, unlent_max = p99(test.window(cycles, unlent.start, unlent.end))
        lent_p99, lent_max = p99(test.window(cycles, lent.start, lent.end))
        await c.call("SetLending", "sb", ["owner", True])
        await lab.wait_lent()
        times = []
        for _ in range(rounds):
            times.append(await lab.withdraw())
            lab.idle()
            await lab.wait_lent()
        times.sort()
        result(check="bench", unlent_p99=unlent_p99, lent_p99=lent_p99, unlent_max=unlent_max,
               lent_max=lent_max, harvest=lent.value, unlent_harvest=unlent.value,
               lent_throughout=lent_steady and unlent_steady, relent_seconds=relent,
               samples=len(test.window(cycles, lent.start, lent.end)),
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
