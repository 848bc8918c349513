"""Startup: the checkpoint (or, when it is corrupt, the allocations recorded in our slices'
Descriptions), the current topology and the units systemd has are brought into agreement before
the service answers anyone. A restart changes no unit that is already right."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from cpuservice.apply import units
from cpuservice.apply.change import Basis, Change, Durability, Note, effects
from cpuservice.apply.reconcile import Kind as OpKind
from cpuservice.apply.reconcile import NoSafeOrder, Op
from cpuservice.apply.targets import own_slice
from cpuservice.host import journal
from cpuservice.host.checkpoint import (
    CheckpointError,
    Record,
    State,
    from_payload,
    fsync_dir,
)
from cpuservice.host.irqs import KERNEL_HOLDERS
from cpuservice.host.sysfs import discover, refresh
from cpuservice.model.cpuset import EMPTY
from cpuservice.model.errors import CPUServiceError
from cpuservice.model.pools import Allocation, InvariantError, Ledger, check_invariants
from cpuservice.model.state import copy_records
from cpuservice.model.topology import Topology
from cpuservice.placement.repair import Change as Repaired
from cpuservice.placement.repair import repair
from cpuservice.shell.engine import Engine, empty_ledger, kernel_holders
from cpuservice.shell.lifetime import ended as unit_ended
from cpuservice.shell.observe import OWN_PATTERNS
from cpuservice.shell.ports import UNIT_IFACE, SystemdAPI

log = logging.getLogger(__name__)


async def start(engine: Engine) -> None:
    """Recover the state and make systemd hold it."""
    began = time.monotonic()
    async with engine.lock:
        base = empty_ledger(engine.config, engine.topology, engine.keep)
        state, source = await recorded(engine, base)
        try:
            steps, events, new, changes = await derive(engine, state)
        except InvariantError as exc:
            if source != "checkpoint":
                raise  # rebuilt from the units, which from_units keeps consistent: a bug
            # the checkpoint read well, but what the repair made of it breaks the invariants:
            # the file is at fault, as a corrupt one would be
            aside = engine.store.set_aside()
            log.error("the checkpoint's allocations break the ledger's invariants (%s); kept it "
                      "as %s and rebuilt the state from systemd's units", exc, aside)
            state, source = await from_units(engine.systemd, base), "units"
            steps, events, new, changes = await derive(engine, state)
        mark_confinement(engine)  # before systemd confines anything: a crash cannot hide it
        # serve even when the state cannot be written: what this start derived (repair,
        # releases of vanished units) follows from the checkpoint and systemd again at the next
        # start; changes that need a write are refused until one succeeds (the status says so)
        engine.adopt(new)
        await through_pool(engine, Change(
            new, None, durability=Durability.SERVE_READ_ONLY, basis=Basis.OBSERVED,
            steps=steps,
            events=tuple(events + restored(engine.topology, new, changes, source))),
            adopt=True)
        engine.counters.repair("startup", time.monotonic() - began, len(changes))
        await confinement(engine)
        # foreign units whose lifetime=unit allocation ended while the daemon was down get
        # their saved values back, and only then is the allocation forgotten
        for name in await ended(engine.systemd, engine.state):
            try:
                await release(engine, name, "its unit ended")
            except CPUServiceError as exc:
                log.error("cannot release %s, whose unit ended: %s", name, exc)


async def recorded(engine: Engine, base: Ledger) -> tuple[State, str]:
    """The state as recorded, and where from: the checkpoint, or when there is none or it is
    bad (unreadable, failing its checksum, allocations that contradict each other: set aside
    as state.json.corrupt-TIME), the Descriptions of our slices."""
    try:
        payload = engine.store.load()
        if payload is not None:
            state = from_payload(payload, base)
            if state.ledger.granularity != base.granularity:
                log.warning("checkpoint uses granularity %d, config says %d: keeping %d until "
                            "every allocation is released", state.ledger.granularity,
                            base.granularity, state.ledger.granularity)
            return state, "checkpoint"
    except CheckpointError as exc:
        aside = engine.store.set_aside()
        log.error("%s; kept it as %s and rebuilt the state from systemd's units", exc, aside)
    # no checkpoint (lost, never written, or set aside): our slices say what runs
    state = await from_units(engine.systemd, base)
    if state.ledger.allocations:
        log.warning("no checkpoint: rebuilt %d allocation(s) from their slices",
                    len(state.ledger.allocations))
    return state, "units"


async def derive(engine: Engine, state: State
                 ) -> tuple[tuple[Op, ...], list[journal.Event], State, list[Repaired]]:
    """What the recorded ``state`` becomes on this machine now: foreign units gone and
    lifetime=unit allocations ended are released (the steps that forget them, their journal
    events), the rest repaired onto the topology (InvariantError when that breaks the
    ledger's invariants). Reads systemd, changes nothing."""
    gone = await vanished(engine.systemd, state)
    ended_now = [n for n in await ended(engine.systemd, state)
                 if own_slice(state.records[n])]
    events = [journal.event(journal.Kind.RELEASED, engine.topology, state, name, reason)
              for names, reason in ((gone, "its unit is gone"), (ended_now, "its unit ended"))
              for name in names]
    steps = forget(state, gone)
    state = without(state, gone + ended_now)
    ledger, changes = repair(engine.topology, state.ledger)
    check_invariants(ledger)
    return steps, events, State(ledger, state.records), changes


def restored(topology: Topology, state: State, changes: list[Repaired],
             source: str) -> list[journal.Event]:
    """The audit trail of a start: each allocation kept (from the checkpoint or the units),
    and what the startup repair changed (pure)."""
    repaired = {c.name: c for c in changes}
    events = []
    for name in sorted(state.ledger.allocations):
        events.append(journal.event(journal.Kind.RESTORED, topology, state, name,
                                    f"from the {source}", source=source))
        if (c := repaired.get(name)) is not None:
            events.append(journal.event(journal.Kind.REPAIRED, topology, state, name, c.reason,
                                        lost=c.lost.format(), gained=c.gained.format()))
    return events


CONFINED_MARK = "host-confined"  # beside the checkpoint: the host units have the shared pool


def _marks(engine: Engine) -> dict[str, Path]:
    state_dir = Path(engine.config.state_file).parent
    return {"host": state_dir / CONFINED_MARK,
            **{h: state_dir / f"isolated-{h.split(':')[1]}" for h in KERNEL_HOLDERS}}


def mark_confinement(engine: Engine) -> None:
    """Remember what this configuration confines (confine_host, isolate_*)."""
    marks = _marks(engine)
    on = {"host": engine.config.confine_host,
          **{h: h in kernel_holders(engine.config) for h in KERNEL_HOLDERS}}
    for key, path in marks.items():
        if on[key] and not path.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
                fsync_dir(path.parent)
            except OSError as exc:
                log.error("cannot write %s (%s): a crash now would not remember what this "
                          "configuration confines", path, exc.strerror)


async def confinement(engine: Engine) -> None:
    """Give every CPU back to what an earlier run (or configuration) confined and this one
    does not: the host's units (confine_host), interrupts and workqueues (isolate_*). The
    Debian package's prerm does the same on removal, also when the daemon is down."""
    marks = _marks(engine)
    if not engine.config.confine_host and marks["host"].exists():
        every = {"AllowedCPUs": ("ay", b"")}  # empty: no restriction
        await engine.apply(effects(*(Op(OpKind.RESTORE, unit, every)
                                     for unit in units.CONFINED)))
        marks["host"].unlink()
        log.info("confine_host is off: %s have every CPU again", ", ".join(units.CONFINED))
    for holder in KERNEL_HOLDERS:
        if (holder not in kernel_holders(engine.config) and marks[holder].exists()
                and engine.kernel is not None):
            online = {"AllowedCPUs": ("ay", engine.topology.online.to_mask())}
            await engine.apply(effects(Op(OpKind.SET, holder, online)))
            await engine.settle()  # written before the mark that says it must be goes
            marks[holder].unlink()
            log.info("%s: isolation is off, every online CPU again", holder)


async def release(engine: Engine, name: str, reason: str) -> None:
    """Forget an allocation (under the engine's lock). A foreign unit's saved values stay in
    the checkpoint until systemd has taken them back."""
    state = engine.state
    records = copy_records(state.records)
    record = records.pop(name, Record())
    await engine.apply(Change(
        State(state.ledger.without(name), records), frozenset({name}),
        durability=Durability.FIRST if own_slice(record) else Durability.AFTER,
        notes=(Note(journal.Kind.RELEASED, name, reason, before=True),)))


async def from_units(systemd: SystemdAPI, base: Ledger) -> State:
    """Rebuild allocations from the Descriptions of our slices (checkpoint lost)."""
    allocations: dict[str, Allocation] = {}
    records: dict[str, Record] = {}
    for unit, _ in await systemd.list_units(OWN_PATTERNS):
        text = (await systemd.get(unit, UNIT_IFACE, ["Description"])).get("Description", "")
        if not units.made_by_us(unit, text):
            continue
        try:
            allocation, record = units.from_description(units.parse_description(text) or {}, unit)
        except (CPUServiceError, KeyError, ValueError) as exc:
            log.error("cannot rebuild allocation from %s: %s", unit, exc)
            continue
        allocations[allocation.name] = allocation
        records[allocation.name] = record
    ledger = replace(base, allocations=MappingProxyType(allocations))
    try:
        check_invariants(ledger)
    except InvariantError as exc:  # two slices claim one CPU: keep neither's claim
        log.error("rebuilt allocations conflict (%s): keeping the first of each", exc)
        ledger = base
        for a in allocations.values():
            try:
                check_invariants(ledger.with_allocation(a))
                ledger = ledger.with_allocation(a)
            except InvariantError:
                log.error("dropped rebuilt allocation %s: its CPUs are taken", a.name)
                records.pop(a.name, None)
    return State(ledger, records)


async def vanished(systemd: SystemdAPI, state: State) -> list[str]:
    """Allocations on foreign units that no longer exist (not found, masked, broken): nothing
    to apply to or restore. They are logged and forgotten (``forget``: the runtime drop-ins
    cpuservice wrote for them go); they never stop the daemon from starting. (A unit that is
    merely stopped, and unloaded by systemd, still exists: it keeps its allocation.)"""
    gone = []
    for name, record in state.records.items():
        if own_slice(record) or name not in state.ledger.allocations:
            continue
        try:
            load = await systemd.load_state(record.unit)
        except CPUServiceError as exc:  # systemd could not say: keep it, ask again later
            log.warning("allocation %s: cannot tell whether %s exists: %s", name, record.unit,
                        exc)
            continue
        if load != "loaded":
            log.warning("allocation %s: its unit %s is %s; forgetting it", name, record.unit,
                        load)
            gone.append(name)
    return gone


def forget(state: State, names: list[str]) -> tuple[Op, ...]:
    """The steps that remove the runtime drop-ins cpuservice wrote for the vanished foreign
    units ``names`` (nothing is set: there is nothing to set it on)."""
    return tuple(Op(OpKind.RESTORE, state.records[n].unit, forget=state.records[n].fresh,
                    keep=True) for n in names if state.records[n].fresh)


async def ended(systemd: SystemdAPI, state: State) -> list[str]:
    """lifetime=unit allocations whose unit is gone (or empty after having run)."""
    return [name for name, a in state.ledger.allocations.items()
            if a.request.options.lifetime == "unit"
            and await unit_ended(systemd, state.records.get(name, Record()))]


def without(state: State, names: list[str]) -> State:
    ledger, records = state.ledger, copy_records(state.records)
    for name in names:
        ledger = ledger.without(name)
        records.pop(name, None)
    return State(ledger, records)


async def revalidate(engine: Engine, full: bool, began: float) -> None:
    """Under the lock: re-read the topology and repair (the same repair runs at startup).
    ``full`` also re-checks every unit against systemd; CPU hotplug applies just the
    differences. A failure is rolled back, counted and raised."""
    try:
        await _revalidate(engine, full, began)
    except Exception:  # systemd, the checkpoint or sysfs: rolled back, counted, raised
        engine.counters.repair_failed("revalidate" if full else "hotplug")
        raise


async def _revalidate(engine: Engine, full: bool, began: float) -> None:
    old_topology = engine.topology
    if full:
        topology = discover(engine.config.sysfs_root, previous=old_topology)
    else:
        topology = refresh(engine.config.sysfs_root, old_topology)
    state = before = engine.state
    await engine.check_partitions("hotplug")  # what the event did to partitions
    gone: list[str] = []
    if full:  # a foreign unit that vanished: nothing to apply to, nothing to restore
        gone = await vanished(engine.systemd, state)
        state = without(state, gone)
    ledger, changes = repair(topology, state.ledger)
    reasons = {c.name: c.reason for c in changes}
    if topology == old_topology and not reasons and not full:
        return
    # Not a caller's request: systemd first, then the checkpoint, which a restart would
    # repair the same way from the old one.
    dropped = [journal.event(journal.Kind.RELEASED, old_topology, before, name,
                             "its unit is gone") for name in gone]
    notes = tuple(Note(journal.Kind.REPAIRED, c.name, c.reason, {
        "lost": c.lost.format(), "gained": c.gained.format()}) for c in changes)
    await through_pool(engine, Change(
        State(ledger, state.records), None, reasons,
        durability=Durability.FIRST if full else Durability.AFTER,
        basis=Basis.OBSERVED if full else Basis.RECORDED, topology=topology,
        steps=forget(before, gone), notes=notes, events=tuple(dropped)))
    seconds = time.monotonic() - began
    engine.counters.repair("revalidate" if full else "hotplug", seconds, len(changes))
    log.info("%s: online %s; %d allocation(s) repaired (%.0f ms)",
             "revalidate" if full else "CPU hotplug", topology.online, len(changes),
             seconds * 1000)


async def through_pool(engine: Engine, change: Change, adopt: bool = False) -> None:
    """Apply a change a restart, Revalidate or hotplug derived (it cannot be refused: systemd
    must come to hold the state). When no order of it keeps every exclusive CPU in one unit
    (reconcile.NoSafeOrder: say a CPU that became reserved and an allocation that must move
    onto the shared pool's last CPU, swapping with it), the allocations of the units that wait
    for each other pass through the shared pool instead: degraded, holding no CPU of their own,
    their slices run on the pool (so they share their old CPUs with it, as the pool's holders
    do, and wait for nobody); then the repair places them again, in a change of its own
    (refused too when it has no safe order: they stay on the pool until a Revalidate).
    ``adopt``: the engine's state becomes each state first (a start's)."""
    try:
        await engine.apply(change)
        return
    except NoSafeOrder as exc:
        if change.state is None:
            raise
        mid, names = on_pool(change.state, exc.units)
        if not names:
            raise
        log.warning("%s: no order of the change keeps every exclusive CPU in one unit; they run "
                    "on the shared pool for a moment and are placed again", ", ".join(names))
    if adopt:
        engine.adopt(mid)
    reasons = {**change.reasons, **dict.fromkeys(names, "degraded")}
    await engine.apply(replace(change, state=mid, reasons=reasons, steps=()))
    ledger, changes = repair(engine.topology, mid.ledger)
    notes = tuple(Note(journal.Kind.REPAIRED, c.name, c.reason, {
        "lost": c.lost.format(), "gained": c.gained.format()}) for c in changes)
    try:
        await engine.apply(Change(State(ledger, mid.records), frozenset(c.name for c in changes),
                                  {c.name: c.reason for c in changes},
                                  durability=change.durability, notes=notes))
    except NoSafeOrder as exc:
        log.error("%s stay on the shared pool until a Revalidate places them: %s",
                  ", ".join(names), exc)


def on_pool(state: State, stuck: Iterable[str]) -> tuple[State, list[str]]:
    """``state`` with the bound allocations of the units ``stuck`` degraded onto the shared
    pool (no whole CPU of their own; a fragment stays), and their names."""
    units_ = set(stuck)
    names = sorted(n for n, a in state.ledger.bound.items()
                   if a.whole and n in state.records and state.records[n].unit in units_)
    ledger = state.ledger
    for name in names:
        a = ledger.allocations[name]
        ledger = ledger.without(name).with_allocation(replace(a, whole=EMPTY, degraded=True))
    return State(ledger, state.records), names
