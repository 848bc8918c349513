"""Reads how an allocation fares from its cgroup (issue 39): ``cpu.pressure``, ``cpu.stat`` and,
when asked, ``memory.numa_stat``, parsed by cpuservice.model.figures. Read-only (ProtectControl
Groups= allows it), from the kernel each time (never a cached figure); a path that leaves the
hierarchy is refused unread, and a file that cannot be read makes its figures unknown."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.figures import (
    CPU_STAT_FILE,
    NUMA_STAT_FILE,
    PRESSURE_FILE,
    Figures,
    figures,
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CHUNK = 65536


def monotonic_usec() -> int:
    return time.monotonic_ns() // 1000


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        data = os.read(fd, CHUNK)
        if len(data) == CHUNK:  # (a short read is the end: the kernel's files fill the buffer)
            parts = [data]
            while chunk := os.read(fd, CHUNK):
                parts.append(chunk)
            data = b"".join(parts)
        return data.decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def safe(control_group: str) -> bool:
    """Whether ``control_group`` (a unit's ControlGroup) names a cgroup below the root."""
    return control_group.startswith("/") and ".." not in control_group.split("/") \
        and "\0" not in control_group


def read(control_group: str | None, memory_nodes: CPUSet | None = None,
         root: Path = CGROUP_ROOT, clock: Callable[[], int] = monotonic_usec) -> Figures:
    """The figures of ``control_group`` now; ``memory_nodes``: read memory.numa_stat too, and
    count what lies outside these nodes as remote. None or an unsafe path: all unknown."""
    wanted = (PRESSURE_FILE, CPU_STAT_FILE, *((NUMA_STAT_FILE,) if memory_nodes else ()))
    texts: dict[str, str | None] = dict.fromkeys(wanted)
    if control_group is not None and safe(control_group):
        directory = os.path.join(root, control_group.lstrip("/"))
        for name in wanted:
            texts[name] = _read(os.path.join(directory, name))
    return figures(clock(), texts, memory_nodes or None)
