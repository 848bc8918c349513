"""What the kernel says of a unit's cgroup: the CPU time its processes used (cpu.stat), for the
lending controller (cpuservice.shell.lending). Read-only; ProtectControlGroups= allows it."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def read_usage(control_group: str, root: Path = CGROUP_ROOT) -> int | None:
    """``usage_usec`` of the cgroup's cpu.stat (the unit's ControlGroup property): microseconds
    of CPU time used by every process in it since it was made; None when it cannot be read (no
    cgroup, cgroup v1, a path that leaves the hierarchy)."""
    if not control_group.startswith("/") or ".." in control_group.split("/"):
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
