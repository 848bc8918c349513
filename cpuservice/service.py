"""The service: ledger + topology + checkpoint + systemd, one request at a time.

Every change is plan (pure) -> commit (checkpoint) -> apply (systemd); when systemd fails, both
are rolled back. Startup and Revalidate() reconcile: the checkpoint (or, when it is corrupt, the
units systemd has), the current topology and systemd's units are brought into agreement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from decimal import Decimal
from types import MappingProxyType
from typing import Any, Protocol

from . import placement, reconcile, units
from .checkpoint import CheckpointError, Record, State, Store, from_payload
from .config import Config
from .cpuset import CPUSet
from .errors import (
    AllocationExists,
    CPUServiceError,
    InvalidArgument,
    NoSuchAllocation,
    SystemdFailure,
)
from .placement import Placement
from .pools import Allocation, Fragment, Ledger, check_invariants
from .reconcile import UnitSpec
from .repair import repair
from .request import Request, parse_amount, parse_options, validate_name
from .systemd import Systemd
from .topology import Topology, discover, refresh

log = logging.getLogger(__name__)
OWN_PATTERNS = ("cpuservice-bound-*.slice", "cpuservice-shared-*.slice")
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
_TYPE_IFACE = {"slice": "Slice", "scope": "Scope", "service": "Service", "socket": "Socket",
               "mount": "Mount", "swap": "Swap"}


def cgroup_iface(unit: str) -> str:
    return f"org.freedesktop.systemd1.{_TYPE_IFACE[unit.rsplit('.', 1)[1]]}"


class Events(Protocol):
    """What the bus layer is told after each committed change."""

    def pools_changed(self, ledger: Ledger) -> None: ...
    def allocation_added(self, name: str) -> None: ...
    def allocation_removed(self, name: str) -> None: ...
    def allocation_changed(self, name: str, reason: str) -> None: ...


class _NoEvents:
    def pools_changed(self, ledger: Ledger) -> None:
        pass

    def allocation_added(self, name: str) -> None:
        pass

    def allocation_removed(self, name: str) -> None:
        pass

    def allocation_changed(self, name: str, reason: str) -> None:
        pass


class Service:
    def __init__(self, config: Config, systemd: Systemd, store: Store) -> None:
        self.config = config
        self.systemd = systemd
        self.store = store
        self.events: Events = _NoEvents()
        self.topology = discover(config.sysfs_root)
        self.state = State(self._empty_ledger(self.topology), MappingProxyType({}))
        self.lock = asyncio.Lock()
        self._attached = 0
        self._lifetime_task: asyncio.Task[None] | None = None
        self._watched: dict[str, str] = {}  # unit object path -> allocation name
        self._target_cache: dict[str, tuple[Allocation, Record, CPUSet | None, units.Target]] = {}
        self._followers: set[str] = set()  # allocations whose unit follows the shared pool
        systemd.on_unit_removed = self._on_unit_removed
        systemd.on_unit_new = self._on_unit_new
        systemd.on_unit_state = self._on_unit_state

    # ---- reads ---------------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    def allocation(self, name: str) -> Allocation:
        try:
            return self.ledger.allocations[name]
        except KeyError:
            raise NoSuchAllocation(f"no allocation named {name!r}") from None

    def record(self, name: str) -> Record:
        return self.state.records.get(name, Record())

    def placement_of(self, name: str) -> Placement:
        return placement.describe(self.topology, self.ledger, self.allocation(name))

    def request(self, cpus: str, options: Mapping[str, Any]) -> Request:
        return Request.parse(cpus, options, self.config.defaults)

    def plan(self, cpus: str, options: Mapping[str, Any]) -> Placement:
        return placement.place(self.topology, self.ledger, self.request(cpus, options))

    def capacity(self, cpus: str, options: Mapping[str, Any]) -> int:
        return placement.capacity(self.topology, self.ledger, self.request(cpus, options))

    # ---- changes -------------------------------------------------------------------------

    async def allocate(
        self, name: str, cpus: str, options: Mapping[str, Any], owner: int
    ) -> Allocation:
        validate_name(name)
        request = self.request(cpus, options)
        async with self.lock:
            if name in self.ledger.allocations:
                raise AllocationExists(f"allocation {name!r} already exists")
            unit, saved = await self._target_unit(name, request)
            ledger, allocation = placement.allocate(self.topology, self.ledger, name, request)
            record = Record(owner, unit, saved)
            await self._commit(State(ledger, {**self.state.records, name: record}), {name})
            if request.options.lifetime == "unit" and not _own_slice(record):
                await self._watch(name, unit)
            return allocation

    async def _target_unit(self, name: str, request: Request) -> tuple[str, units.Props]:
        unit = request.options.unit
        if unit is None:
            return units.slice_name(name, request.options.bind), {}
        for other, rec in self.state.records.items():
            if rec.unit == unit:
                raise InvalidArgument(f"unit {unit!r} already carries allocation {other!r}")
        if unit.startswith("cpuservice"):
            raise InvalidArgument(f"unit {unit!r} belongs to cpuservice itself")
        current = await self.systemd.get(unit, cgroup_iface(unit), units.CPU_PROPERTIES)
        if not current:
            raise InvalidArgument(f"unit {unit!r} is not loaded")
        return unit, units.saved_props(current, units.CPU_PROPERTIES)

    async def release(self, name: str, reason: str = "released") -> None:
        async with self.lock:
            self.allocation(name)
            ledger = placement.release(self.ledger, name)
            records = {k: v for k, v in self.state.records.items() if k != name}
            await self._commit(State(ledger, records), {name})
            for path, watched in list(self._watched.items()):
                if watched == name:
                    del self._watched[path]
                    await self.systemd.unwatch_unit(path)
            log.info("allocation %s released (%s)", name, reason)

    async def resize(self, name: str, cpus: str) -> Allocation:
        amount = parse_amount(cpus)
        async with self.lock:
            self.allocation(name)
            ledger, allocation = placement.resize(self.topology, self.ledger, name, amount)
            await self._commit(State(ledger, self.state.records), {name},
                               {name: f"resized to {amount}"})
            return allocation

    async def attach(self, name: str, pids: Sequence[int]) -> str:
        """Move running processes into a new transient scope in the allocation's slice."""
        async with self.lock:
            allocation = self.allocation(name)
            record = self.record(name)
            own = units.slice_name(name, allocation.bound)
            if record.unit != own:
                raise InvalidArgument(
                    f"allocation {name!r} applies to unit {record.unit!r}: start processes there"
                )
            if not pids:
                raise InvalidArgument("no PIDs to attach")
            self._attached += 1
            scope = f"cpuservice-{units.escape(name)}-{self._attached}.scope"
            props: units.Props = {"PIDs": ("au", list(pids)), "Slice": ("s", own),
                                  "Description": ("s", f"processes attached to {name}")}
            try:
                await self.systemd.start_transient(scope, props)
            except SystemdFailure as exc:
                raise InvalidArgument(f"cannot attach PIDs {list(pids)}: {exc}") from None
            if not record.populated:
                records = {**self.state.records, name: replace(record, populated=True)}
                await self._commit(State(self.ledger, records), {name})
            return scope

    async def revalidate(self, full: bool = True) -> None:
        """Re-read the topology and repair (the same repair runs at startup). ``full`` also
        re-checks every unit against systemd; CPU hotplug applies just the differences."""
        began = time.monotonic()
        async with self.lock:
            old_topology = self.topology
            if full:
                topology = discover(self.config.sysfs_root, previous=old_topology)
            else:
                topology = refresh(self.config.sysfs_root, old_topology)
            ledger, changes = repair(topology, self.ledger)
            reasons = {c.name: c.reason for c in changes}
            if topology == old_topology and not reasons and not full:
                return
            self.topology = topology
            try:
                # Not a caller's request: systemd first, then the checkpoint, which a restart
                # would repair the same way from the old one.
                await self._commit(State(ledger, self.state.records), None, reasons, sync=full,
                                   checkpoint_first=full)
            except BaseException:
                self.topology = old_topology
                raise
            log.info("%s: online %s; %s (%.0f ms)", "revalidate" if full else "CPU hotplug",
                     topology.online, reasons or "nothing to repair",
                     (time.monotonic() - began) * 1000)

    # ---- commit / apply ------------------------------------------------------------------

    async def _commit(
        self,
        new: State,
        touched: set[str] | None,
        reasons: Mapping[str, str] | None = None,
        sync: bool = False,
        checkpoint_first: bool = True,
    ) -> None:
        """Checkpoint, apply to systemd, publish; on failure roll back both and raise.
        ``touched``: the allocations the change is about (None: look at all of them)."""
        check_invariants(new.ledger)
        old = self.state
        changed = self._changed(old, new, touched)
        if checkpoint_first:
            self.store.save(new, changed)
        try:
            if sync:
                await self._sync(new)
            else:
                await self._apply(old, new, changed)
            if not checkpoint_first:
                self.store.save(new, changed)
        except Exception as exc:
            log.error("applying a change failed, rolling back: %s", exc)
            if sync or not (isinstance(exc, reconcile.Failed) and exc.clean):
                try:
                    await self._sync(old)
                except Exception as again:
                    log.error("rollback incomplete: %s", again)
            self.store.save(old, changed)
            cause = exc.cause if isinstance(exc, reconcile.Failed) else exc
            if isinstance(cause, CPUServiceError):
                raise cause from None
            raise SystemdFailure(f"systemd failed: {cause}") from None
        self.state = new
        self._publish(old, new, changed, reasons or {})

    def _target(self, state: State, name: str) -> units.Target:
        """What systemd should hold for one allocation (memoized: unchanged allocations keep
        their Allocation and Record objects)."""
        a = state.ledger.allocations[name]
        record = state.records.get(name, Record())
        own = _own_slice(record)
        follows = _follows_shared(a, own)
        shared = state.ledger.shared if follows else None
        hit = self._target_cache.get(name)
        if hit is not None and hit[0] is a and hit[1] is record and hit[2] == shared:
            return hit[3]
        p = placement.describe(self.topology, state.ledger, a)
        props = units.allocation_props(p, a.bound, a.request.options.memory_nodes, not own)
        if own:
            props["Description"] = ("s", units.describe(name, _fields(a, record)))
        target = units.Target(record.unit, props, own)
        self._target_cache[name] = (a, record, shared, target)
        if follows:
            self._followers.add(name)
        else:
            self._followers.discard(name)
        return target

    def _targets(self, state: State) -> dict[str, units.Target]:
        return {name: self._target(state, name) for name in state.ledger.allocations}

    def _changed(self, old: State, new: State, touched: set[str] | None) -> set[str]:
        """Allocations whose systemd target may differ between two states."""
        if touched is None:
            names = {
                n for n in old.ledger.allocations.keys() | new.ledger.allocations.keys()
                if old.ledger.allocations.get(n) is not new.ledger.allocations.get(n)
                or old.records.get(n) is not new.records.get(n)
            }
        else:
            names = set(touched)
        if old.ledger.shared != new.ledger.shared:
            names |= self._followers & new.ledger.allocations.keys()
        return names

    def _shared_units(self) -> tuple[str, ...]:
        return (units.SHARED, *(units.CONFINED if self.config.confine_host else ()))

    def _units(self, state: State, names: Iterable[str]) -> dict[str, UnitSpec]:
        """What systemd should hold for the shared pool and the named allocations."""
        out = {u: UnitSpec(units.shared_props(state.ledger.shared), own=False)
               for u in self._shared_units()}
        for name in names:
            if name in state.ledger.allocations:
                target = self._target(state, name)
                saved = state.records.get(name, Record()).saved
                out[target.unit] = UnitSpec(target.props, target.own_slice, saved)
        return out

    async def _apply(self, old: State, new: State, changed: set[str]) -> None:
        """The reconcile transaction from ``old`` to ``new`` for the changed allocations."""
        tx = reconcile.plan(self._units(old, changed), self._units(new, changed),
                            old.ledger.exclusive | new.ledger.exclusive)
        await reconcile.execute(tx, self.systemd)

    async def _sync(self, state: State) -> None:
        """Make systemd match ``state`` whatever it holds now (startup, Revalidate, a rollback
        that could not be undone): the same transaction, from what systemd reports."""
        after = self._units(state, state.ledger.allocations)
        before = await self._observe(after)
        held = CPUSet.union_all(spec.cpus or CPUSet() for unit, spec in before.items()
                                if unit.startswith("cpuservice-bound-"))
        await reconcile.execute(reconcile.plan(before, after, state.ledger.exclusive | held),
                                self.systemd)

    async def _observe(self, after: Mapping[str, UnitSpec]) -> dict[str, UnitSpec]:
        """The units systemd holds now: our per-allocation slices (a dead one is stopped, so
        that it can be started again) and the other units ``after`` names."""
        before: dict[str, UnitSpec] = {}
        for unit, active in await self.systemd.list_units(OWN_PATTERNS):
            if units.name_of_slice(unit) is None:
                continue
            if active not in ("active", "activating"):
                await self.systemd.stop(unit)
                continue
            have = await self.systemd.get(unit, cgroup_iface(unit), units.CPU_PROPERTIES)
            have.update(await self.systemd.get(unit, UNIT_IFACE, ["Description"]))
            before[unit] = UnitSpec(units.observed_props(have), own=True)
        for unit, spec in after.items():
            if spec.own:
                continue
            have = await self.systemd.get(unit, cgroup_iface(unit), units.CPU_PROPERTIES)
            if have:
                before[unit] = UnitSpec(units.observed_props(have), own=False,
                                        restore=spec.restore)
        return before

    def _publish(
        self, old: State, new: State, changed: set[str], reasons: Mapping[str, str]
    ) -> None:
        """Signals for what changed. An unbound allocation's CPUSet is the shared pool: its
        changes are announced once, by PoolsChanged, not once per allocation."""
        before, after = old.ledger.allocations, new.ledger.allocations
        for name in sorted(changed | reasons.keys()):
            if name not in after:
                self._target_cache.pop(name, None)
                self._followers.discard(name)
                self.events.allocation_removed(name)
            elif name not in before:
                self.events.allocation_added(name)
            elif before[name] is not after[name] or name in reasons or (
                new.records.get(name) is not old.records.get(name)
            ):
                self.events.allocation_changed(name, reasons.get(name, "changed"))
        pools = ("shared", "exclusive", "fragment")
        if any(getattr(old.ledger, p) != getattr(new.ledger, p) for p in pools):
            self.events.pools_changed(new.ledger)

    # ---- startup -------------------------------------------------------------------------

    def _empty_ledger(self, topology: Topology) -> Ledger:
        return Ledger(topology.online, self.config.reserved, topology.isolated & topology.online,
                      self.config.granularity, self.config.min_shared_cpus)

    async def start(self) -> None:
        """Reconcile checkpoint, topology and systemd; then serve."""
        async with self.lock:
            base = self._empty_ledger(self.topology)
            try:
                payload = self.store.load()
                state = from_payload(payload, base) if payload else State(base, {})
            except CheckpointError as exc:
                aside = self.store.set_aside()
                log.error("%s; kept it as %s and rebuilt the state from systemd's units",
                          exc, aside)
                state = await self._from_units(base)
            if state.ledger.granularity != base.granularity:
                log.warning("checkpoint uses granularity %d, config says %d: keeping %d until "
                            "every allocation is released", state.ledger.granularity,
                            base.granularity, state.ledger.granularity)
            state = await self._drop_ended(state)
            ledger, changes = repair(self.topology, state.ledger)
            for change in changes:
                log.info("startup repair: %s: %s", change.name, change.reason)
            new = State(ledger, state.records)
            check_invariants(ledger)
            self.store.save(new)
            await self._sync(new)
            self.state = new
            for name, record in new.records.items():
                if ledger.allocations[name].request.options.lifetime == "unit" and (
                    not _own_slice(record)
                ):
                    await self._watch(name, record.unit)
        self._schedule_lifetime_check()

    async def _from_units(self, base: Ledger) -> State:
        """Rebuild allocations from the Descriptions of our slices (checkpoint lost)."""
        allocations: dict[str, Allocation] = {}
        records: dict[str, Record] = {}
        for unit, _ in await self.systemd.list_units(OWN_PATTERNS):
            fields = units.parse_description(
                (await self.systemd.get(unit, UNIT_IFACE, ["Description"])).get("Description", "")
            )
            try:
                allocation, record = _from_fields(fields or {}, unit)
            except (CPUServiceError, KeyError, ValueError) as exc:
                log.error("cannot rebuild allocation from %s: %s", unit, exc)
                continue
            allocations[allocation.name] = allocation
            records[allocation.name] = record
        ledger = replace(base, allocations=MappingProxyType(allocations))
        return State(ledger, records)

    async def _drop_ended(self, state: State) -> State:
        """Forget lifetime=unit allocations whose unit is gone (or empty after having run)."""
        ledger, records = state.ledger, dict(state.records)
        for name, a in list(ledger.allocations.items()):
            if a.request.options.lifetime != "unit":
                continue
            record = records.get(name, Record())
            if await self._ended(record):
                log.info("allocation %s ended with its unit %s", name, record.unit)
                ledger = ledger.without(name)
                records.pop(name, None)
        return State(ledger, records)

    async def _ended(self, record: Record) -> bool:
        if _own_slice(record):
            if (await self.systemd.unit_path(record.unit)) is None:
                return True
            return record.populated and not await self.systemd.processes(record.unit)
        state = await self.systemd.get(record.unit, UNIT_IFACE, ["ActiveState"])
        return state.get("ActiveState", "inactive") in ("inactive", "failed")

    # ---- lifetime=unit -------------------------------------------------------------------

    async def _watch(self, name: str, unit: str) -> None:
        path = await self.systemd.unit_path(unit)
        if path is not None:
            self._watched[path] = name
            await self.systemd.watch_unit(path)

    def _on_unit_state(self, path: str, state: str) -> None:
        if path in self._watched and state in ("inactive", "failed"):
            self._schedule_lifetime_check()

    def _on_unit_removed(self, unit: str) -> None:
        if any(a.request.options.lifetime == "unit" for a in self.ledger.allocations.values()):
            self._schedule_lifetime_check()

    def _on_unit_new(self, unit: str) -> None:
        if unit.endswith((".scope", ".service")) and any(
            a.request.options.lifetime == "unit" and not self.record(n).populated
            for n, a in self.ledger.allocations.items()
        ):
            self._schedule_lifetime_check()

    def _schedule_lifetime_check(self) -> None:
        if self._lifetime_task is None or self._lifetime_task.done():
            self._lifetime_task = asyncio.get_running_loop().create_task(self._lifetime_check())

    async def _lifetime_check(self) -> None:
        """Release lifetime=unit allocations whose unit ended; mark slices that got members."""
        await asyncio.sleep(0.05)  # let a burst of unit signals settle
        try:
            for name, a in list(self.ledger.allocations.items()):
                if a.request.options.lifetime != "unit" or name not in self.ledger.allocations:
                    continue
                record = self.record(name)
                if await self._ended(record):
                    await self.release(name, "its unit ended")
                elif not record.populated and record.unit.startswith("cpuservice-") and (
                    await self.systemd.processes(record.unit)
                ):
                    async with self.lock:
                        if name in self.state.records:
                            records = {**self.state.records,
                                       name: replace(self.record(name), populated=True)}
                            await self._commit(State(self.ledger, records), {name})
        except CPUServiceError as exc:
            log.error("lifetime check failed: %s", exc)


def _own_slice(record: Record) -> bool:
    """Whether the allocation has its own slice (foreign units never start with cpuservice)."""
    return record.unit.startswith("cpuservice-")


def _follows_shared(a: Allocation, own_slice: bool) -> bool:
    """Whether an allocation's unit properties change with the shared pool."""
    if a.bound:
        return not a.held  # degraded to nothing: it runs on the shared pool
    return a.request.options.memory_nodes or not own_slice


def _fields(a: Allocation, record: Record) -> dict[str, str]:
    opts = a.request.options
    fields = {
        "cpus": str(a.request.cpus), "bind": str(opts.bind).lower(), "policy": opts.policy,
        "exclusive": opts.exclusive, "numa-strategy": opts.numa_strategy,
        "numa-alignment": opts.numa_alignment, "memory-nodes": str(opts.memory_nodes).lower(),
        "lifetime": opts.lifetime, "owner": str(record.owner),
        "whole": a.whole.format() or "-",
    }
    if a.request.cpuset is not None:
        fields["cpuset"] = a.request.cpuset.format()
    if a.fragment:
        fields["fragment"] = f"{a.fragment.cpu}:{a.fragment.pieces}"
    return fields


def _from_fields(fields: Mapping[str, str], unit: str) -> tuple[Allocation, Record]:
    name = fields["name"]
    options: dict[str, Any] = {k: fields[k] for k in
                               ("policy", "exclusive", "numa-strategy", "numa-alignment",
                                "lifetime", "cpuset") if k in fields}
    options["bind"] = fields["bind"] == "true"
    options["memory-nodes"] = fields["memory-nodes"] == "true"
    request = Request.build(Decimal(fields["cpus"]), parse_options(options))
    fragment = None
    if "fragment" in fields:
        cpu, pieces = fields["fragment"].split(":")
        fragment = Fragment(int(cpu), int(pieces))
    whole = CPUSet.parse("" if fields["whole"] == "-" else fields["whole"])
    return Allocation(name, request, whole, fragment), Record(int(fields["owner"]), unit)
