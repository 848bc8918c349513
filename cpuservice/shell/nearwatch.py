"""Whether the devices of option near are still there (issue 38): looked for at startup and at
each Revalidate; one that is gone becomes a health reason of its allocation (Record.gone, its
HealthReason), never a failure: the allocation keeps the node recorded when it was made."""

from __future__ import annotations

import logging
from dataclasses import replace

from cpuservice.apply.change import Change, Durability
from cpuservice.host.devices import Resolver
from cpuservice.model.errors import CPUServiceError
from cpuservice.model.state import Record, State, copy_records
from cpuservice.shell.engine import Engine

log = logging.getLogger(__name__)


def looked_for(resolver: Resolver, state: State) -> Change | None:
    """The change that records which devices are gone (or back); None when nothing changed."""
    records = copy_records(state.records)
    reasons: dict[str, str] = {}
    for name, a in state.ledger.allocations.items():
        devices = a.request.devices
        record = records.get(name, Record())
        gone = tuple(d.name for d in devices if not resolver.present(d))
        if gone != record.gone:
            records[name] = replace(record, gone=gone)
            reasons[name] = f"device {', '.join(gone)} gone" if gone else "devices back"
    if not reasons:
        return None
    return Change(State(state.ledger, records), frozenset(reasons), reasons,
                  durability=Durability.AFTER)


async def check(engine: Engine, resolver: Resolver) -> None:
    """Look for every allocation's devices; record what changed (a failure is logged: the
    next look tries again)."""
    change = looked_for(resolver, engine.state)
    if change is None:
        return
    for name, reason in change.reasons.items():
        log.warning("allocation %s: %s", name, reason)
    try:
        await engine.apply(change)
    except CPUServiceError as exc:
        log.error("cannot record the devices of option near: %s", exc)
