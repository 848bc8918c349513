"""How an allocation fares, as the kernel counts it in its cgroup (issue 39), pure: the parsers
of ``cpu.pressure``, ``cpu.stat`` and ``memory.numa_stat``, the figures they make, their names
on the bus (FIGURES, the one home of them), the rates between two readings (for
``cpuservicectl top``) and the cgroup of one of cpuservice's own slices. cpuservice.host.figures
reads the files; a file that cannot be read (a cgroup v1 or hybrid host, a unit not yet
realised, a controller not enabled) makes its figures unknown: they are left out, never
guessed.

Pressure (PSI): ``some`` is the share of wall time in which at least one runnable task of the
cgroup waited for a CPU, ``full`` the share in which all of them did (avg10/avg60: percent over
the last 10/60 s; total: microseconds since the cgroup was made). ``cpu.stat``: CPU time used
(user and system), the quota's enforcement periods, how many of them throttled the cgroup and
for how long. ``memory.numa_stat``: the cgroup's anonymous and file memory on each NUMA node;
for an allocation with option memory-nodes, the share of it outside its memory nodes is its
remote memory."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cpuservice.model.cpuset import CPUSet

PRESSURE_FILE, CPU_STAT_FILE, NUMA_STAT_FILE = "cpu.pressure", "cpu.stat", "memory.numa_stat"

# (key, D-Bus signature, what it is): the figures of GetStatistics, in the order shown
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("monotonic-usec", "t", "when they were read (CLOCK_MONOTONIC, microseconds)"),
    ("cpu-usage-usec", "t", "CPU time used since the cgroup was made (cpu.stat usage_usec)"),
    ("cpu-user-usec", "t", "of it in user mode (user_usec)"),
    ("cpu-system-usec", "t", "of it in the kernel (system_usec)"),
    ("cpu-periods", "t", "enforcement periods of its CPU quota (nr_periods)"),
    ("cpu-throttled-periods", "t", "periods in which the quota throttled it (nr_throttled)"),
    ("cpu-throttled-usec", "t", "time it spent throttled (throttled_usec)"),
    ("cpu-pressure-some-avg10", "d", "percent of the last 10 s in which some of its runnable "
     "tasks waited for a CPU (cpu.pressure)"),
    ("cpu-pressure-some-avg60", "d", "the same over the last 60 s"),
    ("cpu-pressure-some-total-usec", "t", "all such waiting time since the cgroup was made"),
    ("cpu-pressure-full-avg10", "d", "percent of the last 10 s in which all of its runnable "
     "tasks waited"),
    ("cpu-pressure-full-avg60", "d", "the same over the last 60 s"),
    ("cpu-pressure-full-total-usec", "t", "all such waiting time since the cgroup was made"),
    ("memory-local-bytes", "t", "anonymous and file memory on its memory nodes "
     "(memory.numa_stat; allocations with option memory-nodes)"),
    ("memory-remote-bytes", "t", "anonymous and file memory on other nodes"),
    ("memory-remote-percent", "d", "the remote share of both (0 when there is none)"),
    ("unreadable", "as", "the files that could not be read (their figures are left out)"),
)
SIGNATURES = {key: sig for key, sig, _ in FIGURES}
MAX_NAMES = 512  # allocations one GetStatistics call may name (ask in batches)


class Pressure(NamedTuple):
    """One line of a pressure file: percent over 10 and 60 s, microseconds in total."""

    avg10: float
    avg60: float
    total_usec: int


class CPUStat(NamedTuple):
    """The counters of cpu.stat (None: not in the file; the nr_* need the cpu controller)."""

    usage_usec: int | None = None
    user_usec: int | None = None
    system_usec: int | None = None
    nr_periods: int | None = None
    nr_throttled: int | None = None
    throttled_usec: int | None = None


@dataclass(frozen=True)
class Figures:
    """What was read of one cgroup at ``at_usec`` (monotonic). ``numa``: bytes of anonymous
    and file memory per node; ``memory_nodes``: the allocation's own nodes (None: it has none,
    so nothing is remote). ``unreadable``: the files that could not be read or parsed."""

    at_usec: int
    some: Pressure | None = None
    full: Pressure | None = None
    cpu: CPUStat | None = None
    numa: Mapping[int, int] | None = None
    memory_nodes: CPUSet | None = None
    unreadable: tuple[str, ...] = field(default=())

    @property
    def local_bytes(self) -> int | None:
        if self.numa is None or self.memory_nodes is None:
            return None
        return sum(b for node, b in self.numa.items() if node in self.memory_nodes)

    @property
    def remote_bytes(self) -> int | None:
        if self.numa is None or self.memory_nodes is None:
            return None
        return sum(b for node, b in self.numa.items() if node not in self.memory_nodes)

    @property
    def remote_percent(self) -> float | None:
        local, remote = self.local_bytes, self.remote_bytes
        if local is None or remote is None:
            return None
        return 100.0 * remote / (local + remote) if local + remote else 0.0

    def values(self) -> dict[str, Any]:
        """The known figures by their FIGURES key (the unknown ones left out)."""
        out: dict[str, Any] = {"monotonic-usec": self.at_usec}
        if self.cpu is not None:
            for key, value in (("cpu-usage-usec", self.cpu.usage_usec),
                               ("cpu-user-usec", self.cpu.user_usec),
                               ("cpu-system-usec", self.cpu.system_usec),
                               ("cpu-periods", self.cpu.nr_periods),
                               ("cpu-throttled-periods", self.cpu.nr_throttled),
                               ("cpu-throttled-usec", self.cpu.throttled_usec)):
                if value is not None:
                    out[key] = value
        for kind, p in (("some", self.some), ("full", self.full)):
            if p is not None:
                out[f"cpu-pressure-{kind}-avg10"] = p.avg10
                out[f"cpu-pressure-{kind}-avg60"] = p.avg60
                out[f"cpu-pressure-{kind}-total-usec"] = p.total_usec
        if self.remote_percent is not None:
            out["memory-local-bytes"] = self.local_bytes
            out["memory-remote-bytes"] = self.remote_bytes
            out["memory-remote-percent"] = self.remote_percent
        out["unreadable"] = list(self.unreadable)
        return out


_PRESSURE = re.compile(r"^(some|full) avg10=([0-9]+\.[0-9]+) avg60=([0-9]+\.[0-9]+) "
                       r"avg300=[0-9]+\.[0-9]+ total=([0-9]+)$", re.M | re.A)


def parse_pressure(text: str) -> tuple[Pressure | None, Pressure | None]:
    """(some, full) of a pressure file; a line that is missing or malformed is None (the
    cgroup's ``full`` line of CPU pressure came with Linux 5.13)."""
    found: dict[str, Pressure] = {}
    for kind, avg10, avg60, total in _PRESSURE.findall(text):
        p = Pressure(float(avg10), float(avg60), int(total))
        if kind not in found and p.avg10 <= 100.0 and p.avg60 <= 100.0:
            found[kind] = p
    return found.get("some"), found.get("full")


_CPU_STAT = re.compile(r"^(usage_usec|user_usec|system_usec|nr_periods|nr_throttled|"
                       r"throttled_usec) ([0-9]+)$", re.M | re.A)


def parse_cpu_stat(text: str) -> CPUStat | None:
    """The counters of a cpu.stat file (cgroup v2); None when it has none of them."""
    found: dict[str, int] = {}
    for key, value in _CPU_STAT.findall(text):
        found.setdefault(key, int(value))
    return CPUStat(**found) if found else None


_NUMA_LINE = re.compile(r"(?: N[0-9]+=[0-9]+)+ *", re.A)
_NUMA_NODE = re.compile(r"N([0-9]+)=([0-9]+)", re.A)


def parse_numa_stat(text: str) -> dict[int, int] | None:
    """Bytes of anonymous and file memory on each node (``anon`` and ``file`` lines of
    memory.numa_stat: ``anon N0=4096 N1=0``); None unless the file has both lines, well
    formed (the kernel writes them first)."""
    out: dict[int, int] = {}
    seen = set()
    for line in text.split("\n"):
        key = line[:4]
        if key not in ("anon", "file") or key in seen or not _NUMA_LINE.fullmatch(line, 4):
            continue
        seen.add(key)
        for node, value in _NUMA_NODE.findall(line, 4):
            out[int(node)] = out.get(int(node), 0) + int(value)
        if len(seen) == 2:
            return out
    return None


def figures(at_usec: int, texts: Mapping[str, str | None],
            memory_nodes: CPUSet | None = None) -> Figures:
    """The figures of the files' ``texts`` (None: could not be read). ``memory_nodes``: the
    allocation's own nodes when memory.numa_stat was asked for."""
    unreadable: list[str] = []
    pressure = texts.get(PRESSURE_FILE)
    some, full = parse_pressure(pressure) if pressure is not None else (None, None)
    if some is None:
        unreadable.append(PRESSURE_FILE)
    stat = texts.get(CPU_STAT_FILE)
    cpu = parse_cpu_stat(stat) if stat is not None else None
    if cpu is None:
        unreadable.append(CPU_STAT_FILE)
    numa = None
    if NUMA_STAT_FILE in texts:
        numa_text = texts[NUMA_STAT_FILE]
        numa = parse_numa_stat(numa_text) if numa_text is not None else None
        if numa is None:
            unreadable.append(NUMA_STAT_FILE)
    return Figures(at_usec, some, full, cpu, numa, memory_nodes if numa is not None else None,
                   tuple(unreadable))


@functools.lru_cache(maxsize=16384)
def slice_cgroup(unit: str) -> str | None:
    """The cgroup systemd gives a slice (systemd.slice(5): each ``-`` of its name goes one
    level down: ``a-b-c.slice`` is ``/a.slice/a-b.slice/a-b-c.slice``); None for another kind
    of unit or a name systemd would not accept as a slice. cpuservice's slices start with
    ``cpuservice``, so systemd's cgroup escaping (names that look like the kernel's files) never
    applies to them."""
    if not unit.endswith(".slice") or unit == "-.slice":
        return None
    parts = unit[:-len(".slice")].split("-")
    if not all(parts) or "/" in unit:
        return None
    return "/" + "/".join("-".join(parts[:i + 1]) + ".slice" for i in range(len(parts)))


@dataclass(frozen=True)
class Rates:
    """Between two readings of one allocation: CPUs used (1.0: one CPU's time; None: unknown),
    the share of the quota's periods that throttled it (None also when no period passed: it
    has no quota) and the time throttled per second."""

    cpus_used: float | None
    throttled_percent: float | None
    throttled_per_second: float | None


def rates(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> Rates:
    """The rates between two readings (GetStatistics values of the same allocation); None
    where a counter is missing, went back (the cgroup was made again) or no time passed."""
    if before is None:
        return Rates(None, None, None)

    def delta(key: str) -> int | None:
        a, b = before.get(key), after.get(key)
        return None if a is None or b is None or b < a else int(b) - int(a)

    span = delta("monotonic-usec")
    if not span:
        return Rates(None, None, None)
    used = delta("cpu-usage-usec")
    periods, throttled = delta("cpu-periods"), delta("cpu-throttled-periods")
    share = None if not periods or throttled is None or throttled > periods else \
        100.0 * throttled / periods  # (no period passed: no quota, nothing to throttle)
    time_throttled = delta("cpu-throttled-usec")
    return Rates(None if used is None else used / span, share,
                 None if time_throttled is None else time_throttled / span)


def show_name(key: str) -> str:
    """A figure's name as ``cpuservicectl show`` prints it, in systemd's manner (as its
    CPUUsageNSec): ``cpu-throttled-usec`` is CPUThrottledUSec."""
    words = {"cpu": "CPU", "usec": "USec"}
    return "".join(words.get(w, w.capitalize()) for w in key.split("-"))
