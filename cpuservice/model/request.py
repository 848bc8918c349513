"""Allocation requests: the CPU amount and the option map, validated into typed values."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from functools import cached_property
from typing import Any, Optional

from pydantic import Field, StrictBool, StrictStr

from cpuservice.model import compat, near
from cpuservice.model.cpuset import CPUSet, CPUSetError
from cpuservice.model.errors import InvalidArgument


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


_AMOUNT = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_UNIT = re.compile(r"[A-Za-z0-9:_.@\\-]{1,248}\.(service|scope|slice|socket|mount|swap)")


class Options(compat.StrictModel):
    """The ``a{sv}`` options of Allocate/Plan/Capacity; keys as in the D-Bus contract."""

    bind: StrictBool = False
    policy: Policy = Policy.PACKED
    exclusive: Exclusive = Exclusive.NONE
    numa_strategy: NumaStrategy = Field(NumaStrategy.MOST_ALLOCATED, alias="numa-strategy")
    numa_alignment: NumaAlignment = Field(NumaAlignment.BEST_EFFORT, alias="numa-alignment")
    cpuset: Optional[StrictStr] = None  # noqa: UP045 - pydantic 1.10 needs Optional
    memory_nodes: StrictBool = Field(False, alias="memory-nodes")
    unit: Optional[StrictStr] = None  # noqa: UP045
    lifetime: Lifetime = Lifetime.PERSISTENT
    partition: Partition = Partition.NONE
    movable: Movable = Movable.NO
    lend: StrictBool = False
    borrow: StrictBool = False
    near: Optional[StrictStr] = None  # noqa: UP045
    near_policy: NearPolicy = Field(NearPolicy.REQUIRED, alias="near-policy")


OPTION_KEYS = compat.field_aliases(Options)


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
    OptionSpec("unit", "unit", OptionKind.TEXT,
               "apply to this existing unit instead of a new slice", shapes_placement=False,
               described=False),
)


def validate_name(name: str) -> str:
    """Allocation names: 1-64 of [A-Za-z0-9_.-], starting with a letter or digit."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"allocation name {name!r} must be 1-64 characters of A-Z a-z 0-9 _ . - starting "
            "with a letter or digit"
        )
    return name


def parse_amount(text: str) -> Decimal:
    """A CPU amount as a positive Decimal: plain digits with an optional fraction, no exponent."""
    if not isinstance(text, str) or not _AMOUNT.fullmatch(text):
        raise InvalidArgument(
            f"cpus {text!r} is not a plain decimal number such as '2', '1.2' or '0.25'"
        )
    value = Decimal(text)
    if value <= 0:
        raise InvalidArgument(f"cpus must be greater than 0, got {text!r}")
    return value


def parse_options(options: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> Options:
    """Validate an option map (unknown keys and wrong types are named in the error)."""
    unknown = sorted(set(options) - OPTION_KEYS.keys() - set(OPTION_KEYS.values()))
    if unknown:
        known = ", ".join(sorted(OPTION_KEYS))
        raise InvalidArgument(f"unknown option {unknown[0]!r} (known: {known})")
    try:
        return compat.load(Options, {**(defaults or {}), **options})
    except compat.ValidationError as exc:
        raise InvalidArgument(f"bad option {compat.describe(exc)}") from None


@dataclass(frozen=True)
class Request:
    """A validated request: amount, options, and the explicit cpuset parsed when given."""

    cpus: Decimal
    options: Options
    cpuset: CPUSet | None = None

    @cached_property
    def whole(self) -> int:
        """Whole CPUs (the X of X.Y)."""
        return int(self.cpus)

    @cached_property
    def fraction(self) -> Decimal:
        """The .Y of X.Y."""
        return self.cpus - self.whole

    @classmethod
    def parse(
        cls,
        cpus: str,
        options: Mapping[str, Any] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> Request:
        amount = parse_amount(cpus)
        if "near" in (options or {}) and "memory-nodes" not in (options or {}):
            # memory follows the devices unless the caller says otherwise
            defaults = {**(defaults or {}), "memory-nodes": True}
        if (options or {}).get("lend") is True and "partition" not in (options or {}):
            # asked to lend: a configured default partition, which would refuse it, yields
            defaults = {**(defaults or {}), "partition": str(Partition.NONE)}
        opts = parse_options(options or {}, defaults)
        # a configured default that cannot apply (movable or lend for an unbound allocation,
        # borrow for a bound one, ...) is off, as a configured partition that cannot apply is
        # "none"
        off = {key: value for key, (value, why) in _UNLESS.items()
               if key not in (options or {}) and why(opts)}
        if off:
            opts = parse_options(options or {}, {**(defaults or {}), **off})
        return cls.build(amount, opts)

    @classmethod
    def build(cls, amount: Decimal, opts: Options) -> Request:
        """Cross-field checks on already typed values."""
        explicit = None
        if opts.cpuset is not None:
            try:
                explicit = CPUSet.parse(opts.cpuset)
            except CPUSetError as exc:
                raise InvalidArgument(f"option 'cpuset': {exc}") from None
            if not opts.bind:
                raise InvalidArgument("option 'cpuset' needs 'bind': true")
            if not explicit or amount != len(explicit):
                raise InvalidArgument(
                    f"option 'cpuset' {opts.cpuset!r} names {len(explicit)} CPUs but cpus is "
                    f"{amount}"
                )
        why = _unmovable(opts)
        if why:
            raise InvalidArgument(f"option 'movable' {str(opts.movable)!r}: {why}")
        for key in ("lend", "borrow"):
            why = _UNLESS[key][1](opts)
            if why:
                raise InvalidArgument(f"option '{key}': {why}")
        if opts.unit is not None and not _UNIT.fullmatch(opts.unit):
            raise InvalidArgument(f"option 'unit' {opts.unit!r} is not a unit name")
        if opts.near is not None:
            near.check_resolved(near.parse(opts.near))
            if not opts.bind:
                raise InvalidArgument("option 'near' needs 'bind': true (an unbound allocation "
                                      "runs on the whole shared pool)")
            if opts.cpuset is not None:
                raise InvalidArgument("option 'near' and 'cpuset' exclude each other (explicit "
                                      "CPUs are where the caller put them)")
        return cls(amount, opts, explicit)

    @property
    def devices(self) -> tuple[near.Device, ...]:
        """The devices of option ``near`` (cpuservice.model.near), none without it."""
        return near.parse(self.options.near) if self.options.near is not None else ()


def _unmovable(opts: Options) -> str:
    """Why an allocation of these options cannot be movable ("" when it can, or is not)."""
    if opts.movable == Movable.NO:
        return ""
    if not opts.bind:
        return "an unbound allocation holds no CPUs to move (it runs on the shared pool)"
    if opts.cpuset is not None:
        return "an allocation with explicit CPUs ('cpuset') is never moved"
    if opts.partition != Partition.NONE:
        return f"an allocation in a cpuset partition ({opts.partition}) is never moved"
    return ""


def _no_lend(opts: Options) -> str:
    """Why an allocation of these options cannot lend ("" when it can, or does not)."""
    if not opts.lend:
        return ""
    if not opts.bind:
        return "needs 'bind': true (only bound CPUs are lent)"
    if opts.partition != Partition.NONE:
        return (f"a cpuset partition ({opts.partition}) keeps every other cgroup off its CPUs: "
                "they cannot be lent")
    return ""


def _no_borrow(opts: Options) -> str:
    """Why an allocation of these options cannot borrow ("" when it can, or does not)."""
    if not opts.borrow:
        return ""
    if opts.bind:
        return "only an unbound allocation borrows (a bound one has CPUs of its own)"
    if opts.unit is not None:
        return ("a borrower runs in its own slice under cpuservice-borrow.slice, not in "
                "an existing unit")
    return ""


# options a configured default may set only where they can apply: key -> (off, why not)
_UNLESS: Mapping[str, tuple[Any, Callable[[Options], str]]] = {
    "movable": ("no", _unmovable), "lend": (False, _no_lend), "borrow": (False, _no_borrow)}
