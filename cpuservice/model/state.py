"""The service's state: the ledger (who holds which CPUs) and, per allocation, what the service
knows beyond it (owner, unit, a foreign unit's saved values, what it lends). Immutable values;
the checkpoint (cpuservice.host.checkpoint) writes and reads them."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.layered import layered
from cpuservice.model.pools import Ledger


@dataclass(frozen=True)
class Record:
    """What the service knows of an allocation beyond the ledger."""

    owner: int = 0
    unit: str = ""
    saved: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    populated: bool = False
    # a foreign unit's properties that had no runtime override before cpuservice set them: the
    # restore removes cpuservice's override instead of leaving the old value frozen in one
    fresh: tuple[str, ...] = ()
    # the CPUs it lent to borrowers when lending last changed (option lend); what is lent now
    # is this within what it may lend now (cpuservice.model.lending.lent): a value a Resize,
    # a move or a repair made stale is ignored
    lent: CPUSet = EMPTY
    # the devices of option near not found when last looked for (at start, Revalidate): a
    # health reason; the allocation keeps the node recorded when it was made
    gone: tuple[str, ...] = ()


@dataclass(frozen=True)
class State:
    ledger: Ledger
    records: Mapping[str, Record]


def copy_records(records: Mapping[str, Record]) -> MutableMapping[str, Record]:
    """A copy of ``records`` to change for a new state (cpuservice.model.layered.layered: the
    records are copied on every change; dict.copy clones the table, and past a thousand
    records a copy costs what changed since its base)."""
    return layered(records)


def with_record(records: Mapping[str, Record], name: str,
                record: Record) -> MutableMapping[str, Record]:
    """``records`` with ``name``'s record set to ``record`` (copy_records)."""
    out = copy_records(records)
    out[name] = record
    return out
