"""A change, as a value: what the engine's one ``apply`` is handed. Every way cpuservice changes
systemd or the kernel is one of these: a caller's request, startup recovery, Revalidate, a
hotplug repair, a partition heal, giving confined units back, an Attach scope, the stop of a
releasing slice. The value says what the state becomes, how durable it must be, what to plan
from, which steps of its own come before the planned transaction, and what the audit trail
records once it is committed. Pure: no I/O here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from cpuservice.apply.audit import Event, Kind
from cpuservice.apply.reconcile import Op
from cpuservice.model.state import State
from cpuservice.model.topology import Topology


class Durability(StrEnum):
    """When the checkpoint is written."""

    FIRST = "first"  # before systemd is touched: a caller's request (a crash replays it)
    AFTER = "after"  # once systemd has it: a foreign unit's saved values leave the checkpoint
    # only then; a repair a restart would derive again from the old checkpoint
    SERVE_READ_ONLY = "serve-read-only"  # first if it can be written; if not, applied anyway
    # and the service refuses changes until a write succeeds (startup)
    NONE = "none"  # no state of its own to write (effects only)


class Basis(StrEnum):
    """What the transaction is planned from."""

    RECORDED = "recorded"  # the state cpuservice holds (systemd holds it too)
    OBSERVED = "observed"  # what systemd reports now (startup, Revalidate, a retried undo)


@dataclass(frozen=True)
class Note:
    """An audit event, written once the change is committed: allocation ``name`` as the new
    state holds it (``before``: as the old state held it, for a release)."""

    kind: Kind
    name: str
    reason: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    before: bool = False


@dataclass(frozen=True)
class Change:
    """``state``: the state after the change (None: effects only, the state stays);
    ``touched``: the allocations it is about (None: all of them); ``reasons``: why each
    changed, for its PropertiesChanged/AllocationChanged; ``topology``: the machine as it is
    now, when it changed; ``steps``: operations of its own that run first, in the same
    transaction (undone with it unless an operation says otherwise)."""

    state: State | None
    touched: frozenset[str] | None = frozenset()
    reasons: Mapping[str, str] = field(default_factory=dict)
    durability: Durability = Durability.FIRST
    basis: Basis = Basis.RECORDED
    topology: Topology | None = None
    steps: tuple[Op, ...] = ()
    notes: tuple[Note, ...] = ()
    events: tuple[Event, ...] = ()  # audit events made beforehand (startup's)


def effects(*steps: Op) -> Change:
    """A change of systemd alone: the state stays."""
    return Change(None, durability=Durability.NONE, steps=steps)
