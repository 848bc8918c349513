"""Startup: the checkpoint (or, when it is corrupt, the allocations recorded in our slices'
Descriptions), the current topology and the units systemd has are brought into agreement before
the service answers anyone. A restart changes no unit that is already right."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import MappingProxyType

from . import units
from .checkpoint import CheckpointError, Record, State, from_payload
from .engine import OWN_PATTERNS, UNIT_IFACE, Engine, SystemdAPI, empty_ledger
from .errors import CPUServiceError
from .lifetime import ended
from .pools import Allocation, Ledger, check_invariants
from .repair import repair

log = logging.getLogger(__name__)


async def start(engine: Engine) -> None:
    """Recover the state and make systemd hold it."""
    async with engine.lock:
        base = empty_ledger(engine.config, engine.topology)
        try:
            payload = engine.store.load()
            state = from_payload(payload, base) if payload else State(base, {})
        except CheckpointError as exc:
            aside = engine.store.set_aside()
            log.error("%s; kept it as %s and rebuilt the state from systemd's units", exc, aside)
            state = await from_units(engine.systemd, base)
        if state.ledger.granularity != base.granularity:
            log.warning("checkpoint uses granularity %d, config says %d: keeping %d until "
                        "every allocation is released", state.ledger.granularity,
                        base.granularity, state.ledger.granularity)
        state = await drop_ended(engine.systemd, state)
        ledger, changes = repair(engine.topology, state.ledger)
        for change in changes:
            log.info("startup repair: %s: %s", change.name, change.reason)
        new = State(ledger, state.records)
        check_invariants(ledger)
        engine.store.save(new)
        await engine.sync(new)
        engine.state = new


async def from_units(systemd: SystemdAPI, base: Ledger) -> State:
    """Rebuild allocations from the Descriptions of our slices (checkpoint lost)."""
    allocations: dict[str, Allocation] = {}
    records: dict[str, Record] = {}
    for unit, _ in await systemd.list_units(OWN_PATTERNS):
        text = (await systemd.get(unit, UNIT_IFACE, ["Description"])).get("Description", "")
        try:
            allocation, record = units.from_description(units.parse_description(text) or {}, unit)
        except (CPUServiceError, KeyError, ValueError) as exc:
            log.error("cannot rebuild allocation from %s: %s", unit, exc)
            continue
        allocations[allocation.name] = allocation
        records[allocation.name] = record
    return State(replace(base, allocations=MappingProxyType(allocations)), records)


async def drop_ended(systemd: SystemdAPI, state: State) -> State:
    """Forget lifetime=unit allocations whose unit is gone (or empty after having run)."""
    ledger, records = state.ledger, dict(state.records)
    for name, a in list(ledger.allocations.items()):
        if a.request.options.lifetime != "unit":
            continue
        record = records.get(name, Record())
        if await ended(systemd, record):
            log.info("allocation %s ended with its unit %s", name, record.unit)
            ledger = ledger.without(name)
            records.pop(name, None)
    return State(ledger, records)
