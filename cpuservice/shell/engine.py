"""The state and the one way it changes: plan (pure) -> checkpoint -> reconcile transaction ->
events. Every use case, startup recovery, Revalidate and hotplug repair commits through here.

systemd is reached only through the small protocol declared below (the real adapter is
cpuservice.host.systemd.Systemd; unit tests use an in-memory fake).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from cpuservice.apply import partitions, reconcile, targets, units, views
from cpuservice.apply.change import Basis, Change, Durability, Note
from cpuservice.apply.reconcile import UnitSpec
from cpuservice.apply.targets import Targets, partition_mode, partition_of
from cpuservice.host import cgroup, journal, metrics
from cpuservice.host.checkpoint import Store
from cpuservice.host.irqs import IRQS, WORKQUEUES, Report
from cpuservice.model import lending
from cpuservice.model.config import Config
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import CheckpointWriteError, CPUServiceError, SystemdFailure
from cpuservice.model.keep import NO_KEEP, Keep
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.state import Record, State
from cpuservice.model.topology import Topology
from cpuservice.shell import observe, publish
from cpuservice.shell.effector import Effector
from cpuservice.shell.ports import (
    Events,
    Fanout,
    KernelAPI,
    SystemdAPI,
    cgroup_iface,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """The engine's state at one instant, for readers."""

    state: State
    topology: Topology
    partition_reports: Mapping[str, partitions.State | None]
    capabilities: partitions.Capabilities
    irqs: Report | None
    generation: int = 0  # changes committed since the start (the service counts them)
    # allocation -> the health reasons its figures raised (cpuservice.shell.health)
    strain: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def partition_report(self, name: str) -> partitions.State | None:
        return self.partition_reports.get(name)


def kernel_holders(config: Config) -> tuple[str, ...]:
    """The pseudo-units of the kernel that follow the shared pool, as configured."""
    return (*((IRQS,) if config.isolate_irqs else ()),
            *((WORKQUEUES,) if config.isolate_workqueues else ()))


def empty_ledger(config: Config, topology: Topology, keep: Keep = NO_KEEP) -> Ledger:
    return Ledger(topology.online, config.reserved, topology.isolated & topology.online,
                  config.granularity, config.min_shared_cpus, keep=keep)


class Engine:
    def __init__(self, config: Config, systemd: SystemdAPI, store: Store,
                 topology: Topology, kernel: KernelAPI | None = None, keep: Keep = NO_KEEP
                 ) -> None:
        self.config = config
        self.keep = keep  # cores kept next to devices (config keep_near, found at startup)
        self.systemd = systemd
        self.kernel = kernel
        self.effector = Effector(systemd, kernel)
        self.store = store
        self.topology = topology
        self.state = State(empty_ledger(config, topology, keep), {})
        self.targets = Targets(config.confine_host, kernel_holders(config))
        self.events = Fanout()  # sinks subscribe (subscribe())
        self.on_committed: list[Callable[[], None]] = []  # after each change: status, metrics
        # committed changes of allocations, one event each (the daemon sends them to journald)
        self.audit: journal.Audit = journal.Journal(native=False)
        self.counters = metrics.Counters()  # requests and repairs, for the metrics
        # cpuset partitions: what this host can do (the daemon detects it), what the kernel
        # reports of each partitioned allocation's slice, and the reader of that report
        self.capabilities = partitions.Capabilities()
        self.partition_states: dict[str, partitions.State] = {}
        self.read_partition: Callable[[str], partitions.State | None] = partitions.read_state
        # the health reasons of the allocations' figures (cpuservice.shell.health replaces it)
        self.strain: Mapping[str, tuple[str, ...]] = MappingProxyType({})
        self.detect_kernel: Callable[[], tuple[bool, str]] = partitions.detect_kernel
        self.detect_lending: Callable[[], tuple[bool, str]] = cgroup.detect_lending
        self.lock = asyncio.Lock()

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    def adopt(self, state: State) -> None:
        """Startup: the state recovered from the checkpoint or the units, before the first
        ``apply`` makes systemd hold it (a failure then retries it, never undoes it)."""
        self.state = state

    async def apply(self, change: Change) -> None:
        """The one way anything changes: checkpoint (as durable as the change asks), one
        reconcile transaction (its own steps, then what the new state needs), events, audit.
        On failure both the state and systemd are put back and the cause is raised."""
        new = change.state
        if new is None:
            await self._execute(reconcile.Transaction(change.steps))
            return
        check_invariants(new.ledger)
        old, old_topology = self.state, self.topology
        memo = self.targets.memo()  # a failed change leaves no spec of its own behind
        changed = self.targets.changed(old, new, change.touched)
        observed = change.basis is Basis.OBSERVED
        topology = change.topology or old_topology
        tx = reconcile.Transaction(())
        ahead: publish.Ahead | None = None  # the events, derived while systemd applies them
        try:
            if not observed:  # planned before anything is touched: no safe order, no change
                tx = self.plan((old_topology, old), (topology, new), changed)
            if change.durability is Durability.FIRST:
                self.store.save(new, changed)
            elif change.durability is Durability.SERVE_READ_ONLY:
                try:
                    self.store.save(new, changed)
                except CheckpointWriteError as exc:
                    # what this change derived follows from the checkpoint and systemd again
                    # at the next start; changes that need a write are refused until one
                    # succeeds
                    log.error("%s: serving read-only, every change is refused until the "
                              "state can be written", exc)
        except BaseException:
            self.targets.restore(memo)
            raise
        try:
            self.topology = topology
            if observed:
                await reconcile.execute(reconcile.Transaction(change.steps), self.effector)
                await self._sync(new)
            else:
                reports = MappingProxyType(dict(self.partition_states))
                ahead = publish.Ahead(self.events, (old, old_topology, reports),
                                      (new, topology, reports), changed, change.reasons,
                                      self.strain)
                await publish.meanwhile(functools.partial(
                    reconcile.execute, reconcile.Transaction(change.steps + tx.ops),
                    self.effector), ahead.steps())
            if change.durability is Durability.AFTER:
                self.store.save(new, changed)
        except Exception as exc:
            log.error("applying a change failed, rolling back: %s", exc)
            self.topology = old_topology
            self.targets.restore(memo)
            # (no safe order of the sync: nothing of it was done, nothing to put back)
            if (observed or not (isinstance(exc, reconcile.Failed) and exc.clean)) and not \
                    isinstance(exc, reconcile.NoSafeOrder):
                try:
                    await self._sync(old)
                except Exception as again:
                    log.error("rollback incomplete: %s", again)
            if change.durability is not Durability.NONE:
                try:
                    self.store.save(old, changed)
                except CPUServiceError as again:
                    log.error("cannot write the state back: %s", again)
            raise _cause(exc) from None
        except BaseException:
            self.topology = old_topology
            self.targets.restore(memo)
            raise
        self.state = new
        before_partitions = dict(self.partition_states)
        await self.observe_partitions(changed)
        found = None if ahead is None else ahead.done(before_partitions, self.partition_states,
                                                      self.strain)
        if found is None:
            found = publish.changes((old, old_topology, before_partitions),
                                    (new, self.topology, self.partition_states), changed,
                                    change.reasons, self.strain)
        publish.deliver(self.events, self.targets.forget, found)
        for event in change.events:
            self.audit.send(event)
        for note in change.notes:
            self._audit(note, old, old_topology)
        self._committed()

    def plan(self, old: tuple[Topology, State], new: tuple[Topology, State],
             changed: Iterable[str]) -> reconcile.Transaction:
        """The transaction from ``old`` to ``new`` (each with its topology) for the units of
        the shared pool's holders and the ``changed`` allocations; NoSafeOrder when no order
        of it keeps the ordering rule."""
        names = set(changed)
        after = self.targets.specs(new[0], new[1], names)
        before = targets.with_appearing(self.targets.specs(old[0], old[1], names), after,
                                        old[0].online | new[0].online)
        return reconcile.plan(before, after,
                              old[1].ledger.exclusive | new[1].ledger.exclusive,
                              lending.shareable(old, new), units.BORROW, new[1].ledger.shared)

    def orderable(self, ledger: Ledger, records: Mapping[str, Record] | None = None) -> bool:
        """Whether the change from the state to ``ledger`` (with ``records``: the state's by
        default) has an order that keeps the ordering rule (what re-packing and defragment
        ask of the moves they choose). Leaves nothing of itself in the specs."""
        new = State(ledger, self.state.records if records is None else records)
        memo = self.targets.memo()
        try:
            self.plan((self.topology, self.state), (self.topology, new),
                      self.targets.changed(self.state, new, None))
        except reconcile.NoSafeOrder as exc:
            log.info("moves refused: %s", exc)
            return False
        finally:
            self.targets.restore(memo)
        return True

    def subscribe(self, sink: Events) -> None:
        """``sink`` is told every committed change, with the values to publish."""
        self.events.sinks.append(sink)

    def _committed(self) -> None:
        for callback in self.on_committed:
            callback()

    def snapshot(self) -> Snapshot:
        """What readers (the bus, the CLI through it, the metrics) may see: immutable values of
        this instant, never the engine itself."""
        return Snapshot(self.state, self.topology, MappingProxyType(dict(self.partition_states)),
                        self.capabilities, self.kernel.report if self.kernel else None,
                        strain=self.strain)

    async def settle(self) -> None:
        """Wait until the kernel holders have what was last applied to them (give-backs are
        written shortly after the change that made them)."""
        if self.kernel is not None:
            await self.kernel.settle()

    async def _execute(self, tx: reconcile.Transaction) -> None:
        try:
            await reconcile.execute(tx, self.effector)
        except reconcile.Failed as exc:
            raise _cause(exc) from None

    def _audit(self, note: Note, old: State, old_topology: Topology) -> None:
        """Record a committed change of an allocation, with the uid of the D-Bus caller who
        asked for it, if one did."""
        extra = dict(note.extra)
        caller = journal.CALLER.get()
        if caller is not None and "caller_uid" not in extra:
            extra["caller_uid"] = str(caller)
        state, topology = (old, old_topology) if note.before else (self.state, self.topology)
        self.audit.send(journal.event(note.kind, topology, state, note.name, note.reason,
                                      self.partition_report(note.name), **extra))

    def specs(self, state: State, names: Iterable[str]) -> dict[str, UnitSpec]:
        return self.targets.specs(self.topology, state, names)

    async def _sync(self, state: State) -> None:
        """Make systemd match ``state`` whatever it holds now (startup, Revalidate, a rollback
        that could not be undone): the same transaction, from what systemd reports."""
        after = self.specs(state, state.ledger.allocations)
        before, dead = await observe.held_now(self.systemd, self.kernel, after)
        before = targets.with_appearing(before, after, self.topology.online)
        # what bound slices hold now is protected too; a slice on the shared pool (a bound
        # allocation that lost every CPU) holds nothing of its own
        on_pool = {state.records[n].unit for n, a in state.ledger.allocations.items()
                   if a.bound and not a.held and n in state.records}
        held = CPUSet.union_all(spec.cpus or CPUSet() for unit, spec in before.items()
                                if (own := units.name_of_slice(unit)) and own[1]
                                and unit not in on_pool)
        # a dead slice of ours is stopped first, so that it can be started again
        stops = tuple(reconcile.Op(reconcile.Kind.STOP, unit) for unit in dead)
        tx = reconcile.plan(before, after, state.ledger.exclusive | held,
                            self.targets.shareable(self.topology, state, before), units.BORROW,
                            state.ledger.shared)
        await reconcile.execute(reconcile.Transaction(stops + tx.ops), self.effector)

    async def detect_capabilities(self) -> partitions.Capabilities:
        """What this host can do about partitions: systemd's version and whether its slices
        have CPUSetPartition, and what the kernel offers; and whether it can lend."""
        try:
            version = await self.systemd.manager_version()
            root = await self.systemd.get("-.slice", cgroup_iface("-.slice"),
                                          [partitions.PROPERTY])
        except CPUServiceError as exc:
            log.warning("cannot ask systemd what it supports: %s", exc)
            version, root = "", {}
        kernel, why = self.detect_kernel()
        lend, why_not_lend = self.detect_lending()
        self.capabilities = partitions.Capabilities(
            version, partitions.PROPERTY in root, kernel, why,
            lending=lend, lending_reason=why_not_lend)
        if not lend:
            log.warning("lending (option lend) is not available, allocations lend nothing: %s",
                        why_not_lend)
        self.targets.set_partitions(self.capabilities.systemd_property)
        if self.capabilities.partitions:
            log.info("cpuset partitions available (systemd %s)", version)
        else:
            log.info("cpuset partitions not available: %s", self.capabilities.why_not())
        return self.capabilities

    async def check_partitions(self, reason: str = "partition") -> list[str]:
        """Read every partition's report again and announce the allocations whose report
        changed; the allocations the kernel's report now degrades."""
        before = dict(self.partition_states)
        announced = False
        for name in sorted(await self.observe_partitions()):
            if name in self.state.ledger.allocations:
                strain = self.strain.get(name, ())
                diff = views.changed(
                    views.allocation(self.topology, self.state, name, before.get(name), strain),
                    views.allocation(self.topology, self.state, name, self.partition_report(name),
                                     strain))
                if diff:
                    self.events.allocation_changed(name, reason, diff)
                    announced = True
        if announced:
            self._committed()
        allocations = self.state.ledger.allocations
        return sorted(n for n, report in self.partition_states.items() if n in allocations
                      and partitions.degraded(partition_mode(allocations[n], self.ledger),
                                              report))

    async def observe_partitions(self, names: Iterable[str] | None = None) -> set[str]:
        """Read what the kernel made of the named allocations' partitions (None: all of them);
        the names whose report changed. Never fails: an unreadable report is None (degraded)."""
        allocations = self.state.ledger.allocations
        changed: set[str] = set()
        for name in sorted(allocations if names is None else names):
            a = allocations.get(name)
            if a is None or partition_of(a) == partitions.NONE:
                if name in self.partition_states:
                    del self.partition_states[name]
                    changed.add(name)
                continue
            unit = self.state.records[name].unit
            report = partitions.UNREADABLE
            try:
                group = (await self.systemd.get(unit, cgroup_iface(unit), ["ControlGroup"])
                         ).get("ControlGroup", "")
                report = (self.read_partition(str(group)) if group else None) or report
            except Exception as exc:  # an observation never fails the change it follows
                log.warning("cannot read the partition of %s: %s", unit, exc)
            if name not in self.partition_states or self.partition_states[name] != report:
                why = partitions.degraded(partition_mode(a, self.ledger), report)
                if why:
                    log.warning("allocation %s: %s (%s)", name, why, unit)
                self.partition_states[name] = report
                changed.add(name)
        return changed

    def partition_report(self, name: str) -> partitions.State | None:
        return self.partition_states.get(name)


def _cause(exc: Exception) -> CPUServiceError:
    """What a failed change tells its caller: the cause, as a named error."""
    cause = exc.cause if isinstance(exc, reconcile.Failed) else exc
    if isinstance(cause, CPUServiceError):
        return cause
    return SystemdFailure(f"systemd failed: {cause}")
