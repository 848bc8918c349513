"""Allocation requests: the CPU amount and the option map, validated into typed values."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Generic, Optional, TypeVar, overload

from pydantic import Field, StrictBool, StrictStr

from cpuservice.model import compat, near
from cpuservice.model.cpuset import CPUSet, CPUSetError
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.vocab import (
    OPTIONS,
    Exclusive,
    Lifetime,
    Movable,
    NearPolicy,
    NumaAlignment,
    NumaStrategy,
    OptionKind,
    OptionSpec,
    Partition,
    Policy,
)

# the vocabulary (cpuservice.model.vocab) is part of this module's face too
__all__ = [
    "OPTIONS",
    "OPTION_KEYS",
    "Exclusive",
    "Lifetime",
    "Movable",
    "NearPolicy",
    "NumaAlignment",
    "NumaStrategy",
    "OptionKind",
    "OptionSpec",
    "Options",
    "Partition",
    "Policy",
    "Request",
    "parse_amount",
    "parse_options",
    "validate_name",
]

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
    near_irqs: StrictBool = Field(False, alias="near-irqs")


OPTION_KEYS = compat.field_aliases(Options)


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


# option maps validated lately -> their Options (immutable, so shared): most requests repeat
# a few maps, and validating one costs pydantic 1.10 (Debian 12) ~25 us; at most _PARSED_MAX
_parsed: dict[tuple[tuple[str, type, Any], ...], Options] = {}
_PARSED_MAX = 256
_KEY_TEXT_MAX = 256


def parse_options(options: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> Options:
    """Validate an option map (unknown keys and wrong types are named in the error)."""
    unknown = sorted(set(options) - OPTION_KEYS.keys() - set(OPTION_KEYS.values()))
    if unknown:
        known = ", ".join(sorted(OPTION_KEYS))
        raise InvalidArgument(f"unknown option {unknown[0]!r} (known: {known})")
    merged = {**(defaults or {}), **options}
    # (the type is part of the key: True and 1 are equal, and only one is a valid bool; a long
    # text, a caller's cpuset list say, is validated each time rather than kept)
    key: tuple[tuple[str, type, Any], ...] | None = None
    if all(isinstance(v, bool | int | str) and len(str(v)) <= _KEY_TEXT_MAX
           for v in merged.values()):
        key = tuple(sorted((k, type(v), v) for k, v in merged.items()))
    if key is not None and (known_options := _parsed.get(key)) is not None:
        return known_options
    try:
        opts = compat.load(Options, merged)
    except compat.ValidationError as exc:
        raise InvalidArgument(f"bad option {compat.describe(exc)}") from None
    if key is not None:
        if len(_parsed) >= _PARSED_MAX:
            _parsed.clear()
        _parsed[key] = opts
    return opts


T = TypeVar("T")


class _Derived(Generic[T]):
    """functools.cached_property without its lock (Python 3.11 takes an RLock on every first
    read, a third of what reading a new request's amount costs): the value, derived from a
    frozen instance's fields, is kept in its __dict__; two threads reading it first at once
    would derive the same value twice."""

    def __init__(self, derive: Callable[[Any], T]) -> None:
        self.derive = derive
        self.name = derive.__name__
        self.__doc__ = derive.__doc__

    @overload
    def __get__(self, instance: None, owner: type) -> _Derived[T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...

    def __get__(self, instance: object | None, owner: type) -> _Derived[T] | T:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.derive(instance)
        return value


@dataclass(frozen=True)
class Request:
    """A validated request: amount, options, and the explicit cpuset parsed when given."""

    cpus: Decimal
    options: Options
    cpuset: CPUSet | None = None

    @_Derived
    def whole(self) -> int:
        """Whole CPUs (the X of X.Y)."""
        return int(self.cpus)

    @_Derived
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
        for key in ("lend", "borrow", "near-irqs"):
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


def _no_near_irqs(opts: Options) -> str:
    """Why an allocation of these options has no device interrupts to keep ("" when it has, or
    does not ask)."""
    if opts.near_irqs and opts.near is None:
        return "needs 'near' (the devices whose interrupts to keep off the allocation)"
    return ""


# options a configured default may set only where they can apply: key -> (off, why not)
_UNLESS: Mapping[str, tuple[Any, Callable[[Options], str]]] = {
    "movable": ("no", _unmovable), "lend": (False, _no_lend), "borrow": (False, _no_borrow),
    "near-irqs": (False, _no_near_irqs)}
