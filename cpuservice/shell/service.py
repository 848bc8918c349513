"""The use cases: what a caller can ask of the service (reads, allocate, release, resize,
attach, revalidate). Requests are validated once (request, placement), planned purely, and
committed through the engine (checkpoint, reconcile transaction, events).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from cpuservice import placement
from cpuservice.apply import partitions, units
from cpuservice.apply.change import Basis, Change, Durability, Note, effects
from cpuservice.apply.reconcile import Kind as OpKind
from cpuservice.apply.reconcile import Op
from cpuservice.apply.targets import own_slice, partition_of, partition_of_request, slice_of
from cpuservice.host import journal
from cpuservice.host.devices import Resolver
from cpuservice.host.journal import Kind
from cpuservice.model import compat, limits
from cpuservice.model.errors import (
    CheckpointWriteError,
    CPUServiceError,
    InvalidArgument,
    NoSuchAllocation,
    SystemdFailure,
)
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.props import Props
from cpuservice.model.request import Request, parse_amount, parse_options, validate_name
from cpuservice.model.state import Record, State, copy_records, with_record
from cpuservice.model.topology import Topology
from cpuservice.placement import Placement, defrag
from cpuservice.placement.moves import Move
from cpuservice.shell import lending, moving, nearwatch, publish, recovery
from cpuservice.shell.admission import Admission, Ask
from cpuservice.shell.engine import Engine, Snapshot
from cpuservice.shell.host_pressure import HostPressure
from cpuservice.shell.lending import Lending
from cpuservice.shell.lifetime import Lifetime
from cpuservice.shell.nrt_export import NrtExport
from cpuservice.shell.partition_watch import PartitionHealer
from cpuservice.shell.ports import Events
from cpuservice.shell.statistics import Statistics

log = logging.getLogger(__name__)


class Service:
    def __init__(self, engine: Engine, lifetime: Lifetime) -> None:
        self.engine = engine
        self.config = engine.config
        self.systemd = engine.systemd
        self.lifetime = lifetime
        self.lock = engine.lock
        self.devices = Resolver(self.config.sysfs_root, self.config.procfs_root)  # option near
        self._attached = 0
        # Attach scopes are named <name>-<boot tag>-<n>: unique across restarts of the daemon
        self._tag = secrets.token_hex(4)
        # an allocation's identity, beyond its name: a caller authorized for one allocation
        # must not act on another that took its name meanwhile
        self._serials: dict[str, int] = {}
        self._releasing: set[str] = set()  # own slices being stopped before their release
        self._next_serial = itertools.count(1)
        self._partition_watch: asyncio.Task[None] | None = None
        self.healer = PartitionHealer(engine)
        # an allocation's serial is made when somebody first asks for it (serial()), maybe
        # while its change is being applied; one left from an earlier allocation of the
        # same name goes when the new one is committed
        self.admission = Admission(engine, self._follow, fresh=self._forget_serial)
        self.lending = Lending(engine, skip=self._releasing.__contains__)
        self.lending.identity = self.serial
        self.statistics = Statistics(engine)  # how each allocation fares (GetStatistics)
        self.host = HostPressure(self.config.guard)  # the shared pool's pressure, the guard
        self.admission.guard = self.host.check
        self.generation = 0  # changes committed since the start: the NRT export's generation
        self._nrt = NrtExport(self.config.default_options, self.devices.roots)
        engine.on_committed.append(self._count_commit)

    def _count_commit(self) -> None:
        self.generation += 1

    # ---- reads ---------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self.engine.state

    @property
    def ledger(self) -> Ledger:
        return self.engine.state.ledger

    @property
    def topology(self) -> Topology:
        return self.engine.topology

    @property
    def events(self) -> Events:
        return self.engine.events

    @events.setter
    def events(self, events: Events) -> None:
        """Make ``events`` the one sink, replacing every subscribed one (tests)."""
        self.engine.events.sinks[:] = [events]

    def subscribe(self, sink: Events) -> None:
        """``sink`` is told every committed change (the bus)."""
        self.engine.subscribe(sink)

    def on_committed(self, callback: Callable[[], None]) -> None:
        """``callback`` runs after each committed change (the status line, the metrics)."""
        self.engine.on_committed.append(callback)

    def snapshot(self) -> Snapshot:
        return replace(self.engine.snapshot(), generation=self.generation)

    def node_resource_topology(self, node_name: str = "") -> dict[str, Any]:
        """The machine now as a NodeResourceTopology object (see NrtExport)."""
        return self._nrt(self.snapshot(), node_name)

    def count_request(self, method: str, result: str) -> None:
        """A finished D-Bus request, for the metrics."""
        self.engine.counters.request(method, result)

    def allocation(self, name: str) -> Allocation:
        try:
            return self.ledger.allocations[name]
        except KeyError:
            raise NoSuchAllocation(f"no allocation named {name!r}") from None

    def record(self, name: str) -> Record:
        return self.state.records.get(name, Record())

    def serial(self, name: str) -> int:
        """The identity of the allocation called ``name`` now (NoSuchAllocation if none)."""
        self.allocation(name)
        return self._serials.setdefault(name, next(self._next_serial))

    def _forget_serial(self, name: str) -> None:
        """``name`` is a new allocation, or none: its serial and what lending knew are gone."""
        self._serials.pop(name, None)
        self.lending.forget(name)

    def _not_releasing(self, name: str) -> None:
        """Under the lock: refuse a call about an allocation whose slice is being stopped."""
        if name in self._releasing:
            raise InvalidArgument(f"allocation {name!r} is being released (processes stopping)")

    def _same(self, name: str, serial: int | None) -> None:
        """Under the lock: ``name`` is still the allocation the caller was authorized for."""
        if self.serial(name) != serial and serial is not None:
            raise NoSuchAllocation(f"allocation {name!r} was released and allocated again "
                                   "meanwhile; ask again")

    def check_limits(self, owner: int, name: str, ledger: Ledger) -> None:
        """Per-user limits of an unprivileged owner on ``ledger`` as it would be after the
        change (LimitExceeded; see limits.check)."""
        limits.check(self.config, self.state.records, owner, name, ledger)

    def placement_of(self, name: str) -> Placement:
        return placement.describe(self.topology, self.ledger, self.allocation(name))

    def request(self, cpus: str, options: Mapping[str, Any]) -> Request:
        """A validated request, its devices (option near) resolved; its partition is the one it
        can have (see partitions.check), it lends only where the host can (see lending.can_lend)."""
        if "near" in options:
            options = {**options, "near": self.devices.resolve_option(options["near"])}
        request = Request.parse(cpus, options, self.config.defaults)
        opts = request.options
        wanted = partition_of_request(request)
        caps = self.engine.capabilities
        effective = partitions.check(wanted, "partition" in options, opts.bind,
                                     request.fraction == 0, opts.unit, caps)
        fixed = {**options, "partition": str(effective)} if effective != wanted else {}
        if opts.lend and not lending.can_lend(caps, "lend" in options):
            fixed = {**options, **fixed, "lend": False}
        return Request.parse(cpus, fixed, self.config.defaults) if fixed else request

    def plan(self, cpus: str, options: Mapping[str, Any]) -> Placement:
        return placement.place(self.topology, self.ledger, self.request(cpus, options))

    def capacity(self, cpus: str, options: Mapping[str, Any]) -> int:
        return placement.capacity(self.topology, self.ledger, self.request(cpus, options))

    # ---- changes -------------------------------------------------------------------------

    async def start(self) -> None:
        """Learn what the host can do, recover (checkpoint, topology, systemd), then follow
        lifetime=unit allocations and the kernel's reports of partitions."""
        caps = await self.engine.detect_capabilities()
        self.engine.capabilities = replace(  # (guard_reason: after the guard's start)
            caps, near=self.devices.kinds(), devices=self.devices.inventory(),
            guard=self.host.start(), guard_reason=self.host.unavailable)
        await recovery.start(self.engine)
        await nearwatch.check(self.engine, self.devices)
        await self.lifetime.watch_all()
        self.lifetime.schedule()
        await self.healer.heal_quietly()
        partitioned = any(partition_of(a) != partitions.NONE
                          for a in self.ledger.allocations.values())
        if (self.engine.capabilities.partitions or partitioned) and self._partition_watch is None:
            self._partition_watch = asyncio.create_task(self.healer.watch())
        self.lending.ensure()

    async def heal_partitions(self) -> None:
        """See PartitionHealer.heal."""
        await self.healer.heal()

    async def allocate(
        self, name: str, cpus: str, options: Mapping[str, Any], owner: int,
        limited: bool = False, force: bool = False,
    ) -> Allocation:
        """``limited``: the owner is an unprivileged user, held to the per-user limits;
        ``force``: past the admission guard.
        Requests that arrive while a change is in flight are committed together (see
        cpuservice.shell.admission); the answer is the one serial processing would give."""
        validate_name(name)
        units.check_unit_names(name)
        request = self.request(cpus, options)
        return await self.admission.submit(Ask(name, owner, request, limited,
                                               journal.CALLER.get(), force))

    async def _follow(self, name: str, allocation: Allocation) -> None:
        """After an Allocate is committed: its identity, its unit followed, its load too when
        it lends."""
        self.serial(name)
        if allocation.request.options.lend:
            self.lending.ensure()
        if allocation.request.options.lifetime == "unit":
            self.lifetime.track(name)
            record = self.record(name)
            if not own_slice(record):
                await self.lifetime.watch(name, record.unit)

    async def release(self, name: str, reason: str = "released",
                      serial: int | None = None) -> None:
        """``serial``: act only if ``name`` is still that allocation (see serial()).

        An allocation's own slice is stopped first, without the lock: systemd may take up to
        its stop timeout (90 s for a process that ignores SIGTERM) and nobody else waits for
        that. Meanwhile the allocation keeps its CPUs in the ledger (so no one else is placed
        on CPUs its processes may still run on) and other calls about it are refused; then the
        release is committed as usual (its slice is gone: the stop step is instant)."""
        async with self.lock:
            self._same(name, serial)
            self._not_releasing(name)
            serial = self.serial(name)
            record = self.record(name)
            if own_slice(record):
                self._releasing.add(name)
        stopped = name in self._releasing
        if stopped:
            try:
                if self.engine.store.write_error:  # the release could not be recorded
                    raise CheckpointWriteError(self.engine.store.write_error)
                await self.engine.apply(effects(Op(OpKind.STOP, record.unit)))
            finally:
                self._releasing.discard(name)
        async with self.lock:
            self._same(name, serial)
            ledger = placement.release(self.ledger, name)
            records = copy_records(self.state.records)
            record = records.pop(name, Record())
            # a foreign unit's saved values leave the checkpoint only once systemd has them back
            try:
                await self.engine.apply(Change(
                    State(ledger, records), frozenset({name}),
                    durability=Durability.FIRST if own_slice(record) else Durability.AFTER,
                    notes=(Note(Kind.RELEASED, name, reason, before=True),)))
            except CPUServiceError:
                if stopped:  # the allocation stays: its slice comes back (empty), as recorded
                    try:
                        await self.engine.apply(Change(self.state, None,
                                                       durability=Durability.NONE,
                                                       basis=Basis.OBSERVED))
                    except CPUServiceError as exc:
                        log.error("cannot start %s again after a failed release: %s",
                                  record.unit, exc)
                raise
            self._forget_serial(name)
            await self.lifetime.unwatch(name)

    async def resize(self, name: str, cpus: str, serial: int | None = None,
                     limited: bool = False) -> Allocation:
        amount = parse_amount(cpus)
        async with self.lock:
            self._same(name, serial)
            self._not_releasing(name)
            old = self.allocation(name)
            if partition_of(old) != partitions.NONE and amount != int(amount):
                raise InvalidArgument(
                    f"allocation {name!r} is a {partition_of(old)} partition: it needs a whole "
                    f"number of CPUs, not {cpus}")
            ledger, allocation = placement.resize(self.topology, self.ledger, name, amount)
            if limited and amount > old.request.cpus:  # (the guard too: Resize has no force)
                self.check_limits(self.record(name).owner, name, ledger)
                self.host.check(len(self.ledger.shared) - len(ledger.shared), f"Resize {name!r}",
                                "or ask root (not held to it)")
            await self.engine.apply(Change(
                State(ledger, self.state.records), frozenset({name}),
                {name: f"resized to {amount}"},
                notes=(Note(Kind.RESIZED, name, f"from {old.request.cpus} CPUs"),)))
            return allocation

    async def set_movable(self, name: str, movable: str, serial: int | None = None) -> None:
        """Whether allocation ``name`` may be moved (option movable)."""
        async with self.lock:
            self._same(name, serial)
            self._not_releasing(name)
            old = self.allocation(name)
            opts = old.request.options
            options = {**compat.dump(opts, exclude_defaults=True), "movable": movable}
            request = Request.build(old.request.cpus, parse_options(options))
            if request == old.request:
                return
            new = replace(old, request=request)
            await self.engine.apply(Change(
                State(self.ledger.with_allocation(new), self.state.records), frozenset({name}),
                {name: f"movable {request.options.movable}"}))

    async def set_lending(self, name: str, lend: bool, serial: int | None = None) -> None:
        """Whether allocation ``name`` lends its idle whole cores (option lend); off withdraws
        what it lends now, in the same change."""
        async with self.lock:
            self._same(name, serial)
            self._not_releasing(name)
            self.allocation(name)
            if lend:  # NotSupported where the host cannot
                lending.can_lend(self.engine.capabilities, True)
            change = lending.switched(self.topology, self.state, name, lend)
            if change is not None:
                await self.engine.apply(change)
        self.lending.ensure()

    async def defragment(self, dry_run: bool) -> tuple[Move, ...]:
        """Move movable allocations so that free CPUs form wholly free cores (see
        placement.defrag); ``dry_run``: only say which moves."""
        log_ = self.admission.moves
        async with self.lock:
            ledger, moves = defrag.defragment(self.topology, self.ledger,
                                              allowed=log_.allowed,
                                              safe=self.engine.orderable)
            if dry_run or not moves:
                return moves
            await self.engine.apply(Change(
                State(ledger, self.state.records), frozenset(m.name for m in moves),
                dict.fromkeys((m.name for m in moves), publish.MOVED),
                notes=moving.notes(moves, "defragment")))
            log_.record(m.name for m in moves)
            self.engine.counters.moved("defragment", len(moves))
            return moves

    async def attach(self, name: str, pids: Sequence[int], serial: int | None = None) -> str:
        """Move running processes into a new transient scope in the allocation's slice."""
        async with self.lock:
            self._same(name, serial)
            self._not_releasing(name)
            allocation = self.allocation(name)
            record = self.record(name)
            own = slice_of(name, allocation.request)
            if record.unit != own:
                raise InvalidArgument(
                    f"allocation {name!r} applies to unit {record.unit!r}: start processes there"
                )
            if not pids:
                raise InvalidArgument("no PIDs to attach")
            self._attached += 1
            scope = units.attach_scope(name, self._tag, self._attached)
            props: Props = {"PIDs": ("au", list(pids)), "Slice": ("s", own),
                                  "Description": ("s", f"processes attached to {name}")}
            # the scope is kept whatever follows: stopping it would kill the processes it holds
            start = Op(OpKind.START, scope, props, keep=True)
            note = Note(Kind.ATTACHED, name,
                        extra={"scope": scope, "pids": ",".join(str(p) for p in pids)})
            state = self.state if record.populated else State(
                self.ledger, with_record(self.state.records, name, replace(record, populated=True)))
            # populated is recorded once the scope holds the processes (a crash before must
            # not leave a record that says so of an empty slice)
            try:
                await self.engine.apply(Change(
                    state, frozenset({name}), steps=(start,), notes=(note,),
                    durability=Durability.NONE if record.populated else Durability.AFTER))
            except SystemdFailure as exc:
                raise InvalidArgument(f"cannot attach PIDs {list(pids)}: {exc}") from None
            self.lifetime.member(scope, name)
            return scope

    async def revalidate(self, full: bool = True) -> None:
        """Re-read the topology and repair (the same repair runs at startup). ``full`` also
        re-checks every unit against systemd; CPU hotplug applies just the differences."""
        began = time.monotonic()
        async with self.lock:
            await recovery.revalidate(self.engine, full, began)
            await nearwatch.check(self.engine, self.devices)
