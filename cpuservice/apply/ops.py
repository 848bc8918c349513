"""The values a reconcile transaction is made of (cpuservice.apply.reconcile): the units as
cpuservice wants systemd to hold them, and the systemd operations, each with its undo."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.props import Props

CPUS = "AllowedCPUs"
PARTITION = "CPUSetPartition"
NOT_PARTITION = ("", "member")


@dataclass(frozen=True)
class UnitSpec:
    """One unit as cpuservice wants systemd to hold it. ``own``: a transient slice cpuservice
    starts and stops; otherwise an existing unit whose properties it only sets, and sets back to
    ``restore`` when the unit is no longer cpuservice's."""

    props: Props
    own: bool = True
    restore: Props = field(default_factory=dict)
    forget: tuple[str, ...] = ()  # runtime overrides of a foreign unit to remove on restore

    @property
    def cpus(self) -> CPUSet | None:
        """The AllowedCPUs this unit is given (None: not set, it inherits its parent's)."""
        value = self.props.get(CPUS)
        return None if value is None else CPUSet.from_mask(bytes(value[1]))


Units = Mapping[str, UnitSpec]


class Kind(StrEnum):
    START = "start"  # StartTransientUnit with props; undo: stop
    SET = "set"  # SetUnitProperties props; undo: set undo_props
    STOP = "stop"  # StopUnit; undo: start again with undo_props
    RESTORE = "restore"  # SetUnitProperties of a foreign unit's saved values, then remove the
    # runtime overrides cpuservice made where the unit had none (forget); undo: set undo_props


@dataclass(frozen=True)
class Op:
    kind: Kind
    unit: str
    props: Props = field(default_factory=dict)
    undo_props: Props = field(default_factory=dict)
    forget: tuple[str, ...] = ()
    adopt: bool = False  # a SET that makes a foreign unit cpuservice's: undone by a RESTORE
    keep: bool = False  # never undone (an Attach scope: stopping it would kill what it holds)

    def __str__(self) -> str:
        return f"{self.kind.value} {self.unit} {show(self.props)}".rstrip()


@dataclass(frozen=True)
class Transaction:
    ops: tuple[Op, ...]

    def __bool__(self) -> bool:
        return bool(self.ops)


def show(props: Props) -> str:
    return " ".join(f"{name}={CPUSet.from_mask(bytes(value)).format() if sig == 'ay' else value}"
                    for name, (sig, value) in props.items())


def mask(cpus: CPUSet) -> tuple[str, bytes]:
    return ("ay", cpus.to_mask())
