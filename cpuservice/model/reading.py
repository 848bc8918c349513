"""What was read of a machine's CPU topology, as data (files of sysfs by name, CPU by CPU and
node by node): cpuservice.host.sysfs reads one, cpuservice.model.fixtures builds them in memory,
cpuservice.model.discovery resolves one into a Topology."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cpuservice.model.cpuset import EMPTY, CPUSet


@dataclass(frozen=True)
class CPUFacts:
    """What sysfs says of one CPU; None where a file is missing or unreadable.

    ``topology``: its ``topology`` directory could be read (False for an offline CPU, or one
    whose files the kernel refuses while it changes state). ``l3_cpus`` None with
    ``caches`` True: it has cache entries but no level-3 one. ``files``: which file each field
    came from (for warnings), relative to the sysfs root."""

    topology: bool = False
    package_id: int | None = None
    die_id: int | None = None
    core_id: int | None = None
    core_cpus: CPUSet | None = None
    package_cpus: CPUSet | None = None
    die_cpus: CPUSet | None = None
    l3_cpus: CPUSet | None = None
    caches: bool = False
    node_link: int | None = None
    files: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeFacts:
    """What sysfs says of one NUMA node directory."""

    cpus: CPUSet | None = None
    memory_kb: int | None = None
    distances: tuple[int, ...] | None = None
    files: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Reading:
    """One reading of the machine. ``nodes`` empty: a kernel without NUMA (every CPU on node
    0). ``has_memory``: the ``node/has_memory`` mask when there is one. ``warnings``: files the
    reader could not parse."""

    cpus: Mapping[int, CPUFacts]
    online: CPUSet
    nodes: Mapping[int, NodeFacts] = field(default_factory=dict)
    isolated: CPUSet = EMPTY
    has_memory: CPUSet | None = None
    warnings: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# The rules
