"""The request options' vocabulary: the words of each option (StrEnums) and the table of options
(OPTIONS) that the validating model (cpuservice.model.request), the CLI's arguments, the man page
and the completion share. Plain Python, no pydantic: cpuservicectl and cpuservice-run build their
arguments from it without importing the validation (a third of their start under emulation)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Policy(StrEnum):
    """Which CPUs a bound allocation takes (option ``policy``)."""

    PACKED = "packed"
    FULL_PCPUS = "full-pcpus"
    SPREAD_PCPUS = "spread-pcpus"


class Exclusive(StrEnum):
    """What a bound allocation shares with others of the same setting (option ``exclusive``)."""

    NONE = "none"
    PCPU = "pcpu"
    NUMA = "numa"


class NumaStrategy(StrEnum):
    """Which NUMA node(s) come first (option ``numa-strategy``)."""

    MOST_ALLOCATED = "most-allocated"
    LEAST_ALLOCATED = "least-allocated"
    DISTRIBUTE_EVENLY = "distribute-evenly"


class NumaAlignment(StrEnum):
    """How strictly an allocation keeps to few NUMA nodes (option ``numa-alignment``)."""

    NONE = "none"
    BEST_EFFORT = "best-effort"
    RESTRICTED = "restricted"
    SINGLE_NUMA_NODE = "single-numa-node"


# The words placement compares with on every call, as plain module globals: on Python 3.11
# EnumType.__getattr__ makes every read of a member (Policy.FULL_PCPUS) a slow lookup, 45 ns
# against 15 for a global (3.12 and later read members as fast).
FULL_PCPUS, SPREAD_PCPUS = Policy.FULL_PCPUS, Policy.SPREAD_PCPUS
NO_EXCLUSIVE, NUMA_EXCLUSIVE = Exclusive.NONE, Exclusive.NUMA
NO_ALIGNMENT = NumaAlignment.NONE
MOST_ALLOCATED, DISTRIBUTE_EVENLY = NumaStrategy.MOST_ALLOCATED, NumaStrategy.DISTRIBUTE_EVENLY


class Lifetime(StrEnum):
    """How long an allocation lives (option ``lifetime``)."""

    PERSISTENT = "persistent"
    UNIT = "unit"


class Movable(StrEnum):
    """Whether a bound allocation may be moved to other CPUs to make room (option ``movable``):
    not at all, within the NUMA nodes it holds CPUs of, or anywhere (its memory nodes follow its
    CPUs). An allocation with explicit CPUs (``cpuset``) or a cpuset partition is never moved."""

    NO = "no"
    NODE = "node"
    ANYWHERE = "anywhere"


class Partition(StrEnum):
    """The cgroup cpuset partition an allocation asks for (option ``partition``)."""

    NONE = "none"
    ROOT = "root"
    ISOLATED = "isolated"


class NearPolicy(StrEnum):
    """How strictly an allocation keeps to the CPUs next to its devices (option
    ``near-policy``): only there, or there first and elsewhere when they are full."""

    REQUIRED = "required"
    PREFERRED = "preferred"


class OptionKind(StrEnum):
    FLAG = "flag"  # a boolean: --key on the command line
    CHOICE = "choice"  # one word of a vocabulary
    TEXT = "text"  # free text the service checks (a cpu list, a unit name)


@dataclass(frozen=True)
class OptionSpec:
    """One option of Allocate/Plan/Capacity, as everything around the validating model
    (Options) sees it: the CLI's arguments and their help, the record in a slice's Description,
    the man page and the shell completion (their tests check them against this table)."""

    key: str  # the a{sv} key, the CLI's --key, the Description's field
    field: str  # the attribute of Options
    kind: OptionKind
    help: str
    vocabulary: type[StrEnum] | None = None
    shapes_placement: bool = True  # Plan and Capacity take it too (unit, lifetime: Allocate only)
    described: bool = True  # recorded in the Description of the allocation's own slice
    repeat: bool = False  # TEXT given more than once on the command line: comma-separated


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("bind", "bind", OptionKind.FLAG, "bound (exclusive) CPUs"),
    OptionSpec("policy", "policy", OptionKind.CHOICE, "which CPUs a bound allocation takes",
               Policy),
    OptionSpec("exclusive", "exclusive", OptionKind.CHOICE,
               "what a bound allocation shares with others", Exclusive),
    OptionSpec("numa-strategy", "numa_strategy", OptionKind.CHOICE,
               "which NUMA nodes come first", NumaStrategy),
    OptionSpec("numa-alignment", "numa_alignment", OptionKind.CHOICE,
               "how strictly to keep to few NUMA nodes", NumaAlignment),
    OptionSpec("memory-nodes", "memory_nodes", OptionKind.FLAG,
               "also restrict memory to the CPUs' NUMA nodes"),
    OptionSpec("lifetime", "lifetime", OptionKind.CHOICE,
               "how long the allocation lives", Lifetime, shapes_placement=False),
    OptionSpec("partition", "partition", OptionKind.CHOICE,
               "cgroup cpuset partition for a bound allocation", Partition),
    # where the allocation goes now does not depend on it (only whether later requests may
    # move it), so Plan and Capacity do not take it
    OptionSpec("movable", "movable", OptionKind.CHOICE,
               "whether the allocation may be moved to make room", Movable,
               shapes_placement=False),
    # whether idle whole cores are lent, and whether an unbound allocation runs on lent cores
    # too: where the allocation goes does not depend on either (cpuservice.model.lending)
    OptionSpec("lend", "lend", OptionKind.FLAG,
               "lend its idle whole cores to borrowers (bound)", shapes_placement=False),
    OptionSpec("borrow", "borrow", OptionKind.FLAG,
               "also run on cores others lend, at idle priority (unbound)",
               shapes_placement=False),
    OptionSpec("cpuset", "cpuset", OptionKind.TEXT, "explicit CPUs (cpu list); implies --bind"),
    # the devices a workload feeds (cpuservice.model.near): CPUs and memory next to them
    OptionSpec("near", "near", OptionKind.TEXT,
               "CPUs next to this device (PCI address, /dev path, interface, InfiniBand or DRM "
               "name; repeat for more); implies --bind", repeat=True),
    OptionSpec("near-policy", "near_policy", OptionKind.CHOICE,
               "only CPUs next to the devices (required), or there first (preferred)",
               NearPolicy),
    # where the devices' interrupts go (cpuservice.model.device_irqs), not where the CPUs do
    OptionSpec("near-irqs", "near_irqs", OptionKind.FLAG,
               "keep the devices' interrupts on shared CPUs of their node, off the allocation",
               shapes_placement=False),
    OptionSpec("unit", "unit", OptionKind.TEXT,
               "apply to this existing unit instead of a new slice", shapes_placement=False,
               described=False),
)
