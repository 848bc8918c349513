"""The audit trail, as data (cpuservice.host.journal sends it to journald): every change of an
allocation (allocated, resized, released, attached, repaired, restored) is one journal entry
with structured fields and a stable ``MESSAGE_ID`` per kind, so that ``journalctl
MESSAGE_ID=<id>`` or ``journalctl CPUSERVICE_UID=1000`` tells who took which CPUs. Events are
data (Event, built by the pure ``event()``); the engine hands them to a sink once the change is
committed (Engine.audit).

Fields of every entry (documented in cpuserviced(8)): MESSAGE, MESSAGE_ID, PRIORITY,
SYSLOG_IDENTIFIER=cpuserviced, CPUSERVICE_EVENT (the kind), CPUSERVICE_ALLOCATION,
CPUSERVICE_UID (the owner), CPUSERVICE_CPUS (the CPUs its unit may run on: its own for a bound
allocation, the shared pool for an unbound one), CPUSERVICE_AMOUNT (as requested), CPUSERVICE_BOUND,
CPUSERVICE_UNIT, CPUSERVICE_STATE, CPUSERVICE_REASON, CPUSERVICE_CALLER_UID (who asked, for a
change a D-Bus caller asked for), and OBJECT_SYSTEMD_UNIT (so that
``journalctl -u cpuservice-bound-NAME.slice`` shows them too: journalctl matches that field
from root's processes). Kind-specific: CPUSERVICE_SCOPE and CPUSERVICE_PIDS (attached),
CPUSERVICE_LOST and CPUSERVICE_GAINED (repaired), CPUSERVICE_SOURCE (restored), CPUSERVICE_OLD
and CPUSERVICE_NEW (moved), CPUSERVICE_LENT (lent), CPUSERVICE_WITHDRAWN (withdrawn),
CPUSERVICE_HEALTH (health: the reasons its figures raise now, cpuservice.model.health).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

from cpuservice.apply import partitions, views
from cpuservice.model.state import State
from cpuservice.model.topology import Topology

# the uid of the D-Bus caller whose request is being handled (set once polkit allowed it; each
# method call runs in its own task, so it never leaks into another request or a hotplug repair)
CALLER: ContextVar[int | None] = ContextVar("caller", default=None)
IDENTIFIER = "cpuserviced"
NOTICE, WARNING = 5, 4


class Kind(StrEnum):
    ALLOCATED = "allocated"
    RESIZED = "resized"
    RELEASED = "released"
    ATTACHED = "attached"
    REPAIRED = "repaired"
    RESTORED = "restored"
    MOVED = "moved"
    LENT = "lent"
    WITHDRAWN = "withdrawn"
    HEALTH = "health"


# One 128-bit id per kind, never to change (journalctl MESSAGE_ID=...); listed in cpuserviced(8).
MESSAGE_IDS: Mapping[Kind, str] = MappingProxyType({
    Kind.ALLOCATED: "66fa0a17ebfb49dcb80720961772aa19",
    Kind.RESIZED: "727d487a479e44d68992c146bd4e335c",
    Kind.RELEASED: "c0086d11fdb849a9af972930650243e1",
    Kind.ATTACHED: "c86a141579014c81add76dc6cdfea14b",
    Kind.REPAIRED: "dcd00964a443408b9885251f81f2bf2c",
    Kind.RESTORED: "67893f84c0134d46aa3ce5b4b271542d",
    Kind.MOVED: "1c704dcf36414be9b04ca45da7747761",
    Kind.LENT: "4ee815ce83674ed694a5eb7e64f06d41",
    Kind.WITHDRAWN: "e1994a7e6c7c49a2930314a0e5974293",
    Kind.HEALTH: "d92d6fdb91b946a5905a3e2fae7b2dab",
})


@dataclass(frozen=True)
class Event:
    """One committed change of one allocation, with the values it has after the change (for
    ``released``: the ones it had)."""

    kind: Kind
    allocation: str
    uid: int
    cpus: str
    amount: str
    bound: bool
    unit: str
    state: str = "active"
    reason: str = ""
    extra: tuple[tuple[str, str], ...] = ()  # kind-specific fields, without the prefix

    @property
    def priority(self) -> int:
        return WARNING if self.state == "degraded" else NOTICE

    @property
    def message(self) -> str:
        """One line: "allocation web allocated: uid 1000, 2 bound CPUs on CPUs 4-5, unit
        cpuservice-bound-web.slice"."""
        noun = "CPU" if self.amount == "1" else "CPUs"
        where = f"on CPUs {self.cpus or '-'}" if self.bound else f"on shared CPUs {self.cpus}"
        text = (f"allocation {self.allocation} {self.kind}: uid {self.uid}, {self.amount} "
                f"{'bound' if self.bound else 'unbound'} {noun} {where}, unit {self.unit}")
        if self.state != "active":
            text += f", {self.state}"
        details = dict(self.extra)
        if details.get("CALLER_UID", str(self.uid)) != str(self.uid):
            text += f", by uid {details['CALLER_UID']}"
        if self.kind == Kind.ATTACHED:
            text += f", PIDs {details.get('PIDS', '')} in {details.get('SCOPE', '')}"
        if self.kind == Kind.MOVED:
            text += f", from CPUs {details.get('OLD', '')}"
        if self.kind == Kind.LENT:
            text += f", lends CPUs {details.get('LENT', '')} to borrowers"
        if self.kind == Kind.WITHDRAWN:
            text += f", took CPUs {details.get('WITHDRAWN', '')} back from borrowers"
        if self.kind == Kind.HEALTH:
            text += f", {details.get('HEALTH') or 'no'} health reasons from its figures"
        return f"{text} ({self.reason})" if self.reason else text

    def fields(self) -> dict[str, str]:
        """The journal entry."""
        out = {
            "MESSAGE": self.message,
            "MESSAGE_ID": MESSAGE_IDS[self.kind],
            "PRIORITY": str(self.priority),
            "SYSLOG_IDENTIFIER": IDENTIFIER,
            "CPUSERVICE_EVENT": str(self.kind),
            "CPUSERVICE_ALLOCATION": self.allocation,
            "CPUSERVICE_UID": str(self.uid),
            "CPUSERVICE_CPUS": self.cpus,
            "CPUSERVICE_AMOUNT": self.amount,
            "CPUSERVICE_BOUND": "yes" if self.bound else "no",
            "CPUSERVICE_UNIT": self.unit,
            "CPUSERVICE_STATE": self.state,
            "OBJECT_SYSTEMD_UNIT": self.unit,
        }
        if self.reason:
            out["CPUSERVICE_REASON"] = self.reason
        out.update((f"CPUSERVICE_{key}", value) for key, value in self.extra)
        return out


def event(kind: Kind, topology: Topology, state: State, name: str, reason: str = "",
          partition: partitions.State | None = None, **extra: str) -> Event:
    """The event for allocation ``name`` as ``state`` holds it (pure; ``partition``: what the
    kernel reports of its partition, when it has one)."""
    values = views.allocation(topology, state, name, partition)
    return Event(kind, name, values["Owner"], values["CPUSet"], values["CPUs"], values["Bound"],
                 values["Unit"], values["State"], reason,
                 tuple((key.upper(), value) for key, value in extra.items()))


class Audit(Protocol):
    """Where committed changes go (the journal; a list in tests)."""

    def send(self, event: Event) -> None: ...

class Recorder:
    """An Audit that keeps the events (tests)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def send(self, event: Event) -> None:
        self.events.append(event)
