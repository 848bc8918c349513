"""What the kernel says of a unit's cgroup, for the lending controller (cpuservice.shell.lending):
the CPU time its processes used (cpu.stat), and its threads' run times and the CPUs they ran on
last (cgroup.threads, /proc/TID/schedstat and /proc/TID/stat); whether this host can lend at
all. Read-only: ProtectControlGroups= and ProcSubset=pid allow all of it (no /proc/stat)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
# an owner's threads read per sample: more, and its load is its cgroup's total alone (the loop
# must stay quick whatever an owner runs); cgroups walked below its unit, likewise
MAX_THREADS = 256
MAX_GROUPS = 64
_TID_BYTES = 8  # a thread id and its newline (pid_max is at most 2**22: 7 digits)


def _inside(control_group: str) -> bool:
    return control_group.startswith("/") and ".." not in control_group.split("/")


def read_usage(control_group: str, root: Path = CGROUP_ROOT) -> int | None:
    """``usage_usec`` of the cgroup's cpu.stat (the unit's ControlGroup property): microseconds
    of CPU time used by every process in it since it was made; None when it cannot be read (no
    cgroup, cgroup v1, a path that leaves the hierarchy)."""
    if not _inside(control_group):
        return None
    try:
        text = (root / control_group.lstrip("/") / "cpu.stat").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec" and value.strip().isdigit():
            return int(value)
    return None


def thread_ids(control_group: str, root: Path = CGROUP_ROOT, limit: int = MAX_THREADS
               ) -> list[int] | None:
    """The threads in the cgroup and the cgroups below it; None when it cannot be read or
    holds more than ``limit`` threads or ``MAX_GROUPS`` cgroups (each cgroup.threads is read
    no further than ``limit`` ids)."""
    if not _inside(control_group):
        return None
    base = root / control_group.lstrip("/")
    out: list[int] = []
    groups = [base]
    seen = 0
    while groups:
        group = groups.pop()
        seen += 1
        if seen > MAX_GROUPS:
            return None
        try:
            groups += [Path(e.path) for e in os.scandir(group) if e.is_dir(follow_symlinks=False)]
            with open(group / "cgroup.threads", "rb") as f:
                text = f.read((limit + 1) * _TID_BYTES)
        except OSError:
            if group == base:
                return None
            continue  # removed meanwhile
        out += [int(t) for t in text.split()]
        if len(out) > limit:
            return None
    return out


def read_threads(control_group: str, known: Mapping[int, int], root: Path = CGROUP_ROOT,
                 proc: Path = PROC, limit: int = MAX_THREADS
                 ) -> dict[int, tuple[int, int]] | None:
    """Each thread of the cgroup (thread_ids) -> its run time in ns (``/proc/TID/schedstat``)
    and the CPU it ran on last (``/proc/TID/stat`` field 39), read only when its run time
    differs from ``known`` (-1 otherwise: it did not run). A thread gone meanwhile is left
    out. None as thread_ids."""
    tids = thread_ids(control_group, root, limit)
    if tids is None:
        return None
    out: dict[int, tuple[int, int]] = {}
    base = str(proc)
    for tid in tids:
        try:
            runtime = int(_read(f"{base}/{tid}/schedstat", 128).split()[0])
            cpu = -1
            if known.get(tid) != runtime:
                cpu = int(_read(f"{base}/{tid}/stat", 2048).rsplit(b")", 1)[1].split()[36])
        except (OSError, ValueError, IndexError):
            continue
        out[tid] = (runtime, cpu)
    return out


def _read(path: str, size: int) -> bytes:
    """A small procfs file in one read (the loop reads hundreds: no buffered file object)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def detect_lending(root: Path = CGROUP_ROOT, proc: Path = PROC) -> tuple[bool, str]:
    """Whether this host can lend (option lend), and why not: the owner's load is read from the
    unified cgroup v2 hierarchy at ``root`` (cpu.stat, cgroup.threads), the borrow slice's
    CPUWeight=idle needs its cpu controller, and where threads run is read from
    /proc/TID/schedstat (CONFIG_SCHED_INFO)."""
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError:
        kind = "a hybrid cgroup hierarchy (v1 controllers)" if (root / "unified").is_dir() \
            else "no cgroup v2 hierarchy"
        return False, (f"{kind} at {root}: lending reads the owners' load from the unified "
                       "cgroup v2 hierarchy (boot with systemd.unified_cgroup_hierarchy=1)")
    if "cpu" not in controllers:
        return False, f"the cpu controller is not available at {root} (CPUWeight=idle)"
    try:
        with open(proc / "self" / "schedstat", "rb") as f:
            int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return False, (f"{proc}/PID/schedstat cannot be read (a kernel without "
                       "CONFIG_SCHED_INFO): where an owner's threads run is unknown")
    return True, ""
