"""The state and the one way it changes: plan (pure) -> checkpoint -> reconcile transaction ->
events. Every use case, startup recovery, Revalidate and hotplug repair commits through here.

systemd is reached only through the small protocol declared below (the real adapter is
cpuservice.systemd.Systemd; unit tests use an in-memory fake).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from . import journal, metrics, partitions, reconcile, units, views
from .checkpoint import State, Store
from .config import Config
from .cpuset import CPUSet
from .errors import CPUServiceError, SystemdFailure
from .irqs import IRQS, KERNEL_HOLDERS, WORKQUEUES, Report
from .pools import Ledger, check_invariants
from .props import Props
from .reconcile import UnitSpec
from .targets import Targets, partition_mode, partition_of
from .topology import Topology

log = logging.getLogger(__name__)
OWN_PATTERNS = ("cpuservice-bound-*.slice", "cpuservice-shared-*.slice",
                f"{units.PARTITION_PREFIX}*.slice")
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
_TYPE_IFACE = {"slice": "Slice", "scope": "Scope", "service": "Service", "socket": "Socket",
               "mount": "Mount", "swap": "Swap"}


def cgroup_iface(unit: str) -> str:
    return f"org.freedesktop.systemd1.{_TYPE_IFACE[unit.rsplit('.', 1)[1]]}"


class SystemdAPI(Protocol):
    """What cpuservice asks of systemd."""

    on_unit_removed: Callable[[str], None]
    on_unit_new: Callable[[str], None]
    on_unit_state: Callable[[str, str], None]

    async def start_transient(self, unit: str, props: Props) -> None: ...
    async def set_properties(self, unit: str, props: Props, missing_ok: bool = False) -> None: ...
    async def stop(self, unit: str) -> None: ...
    async def remove_overrides(self, unit: str, names: Sequence[str]) -> None: ...
    async def unit_path(self, unit: str) -> str | None: ...
    async def load_state(self, unit: str) -> str: ...
    async def manager_version(self) -> str: ...
    async def get(self, unit: str, interface: str, names: Iterable[str]) -> dict[str, Any]: ...
    async def list_units(self, patterns: Sequence[str]) -> list[tuple[str, str]]: ...
    async def processes(self, unit: str) -> list[int]: ...
    async def member_units(self, unit: str) -> set[str]: ...
    async def watch_unit(self, unit_path: str) -> None: ...
    async def unwatch_unit(self, unit_path: str) -> None: ...


class KernelAPI(Protocol):
    """What cpuservice asks of the kernel for isolation beyond cgroups (cpuservice.irqs)."""

    report: Report

    async def set_cpus(self, holder: str, cpus: CPUSet) -> None: ...
    async def set_many(self, wants: Mapping[str, CPUSet]) -> None: ...
    async def get_cpus(self, holder: str) -> CPUSet | None: ...
    async def settle(self) -> None: ...


class Effector:
    """The reconcile transaction's effector: systemd for units, the kernel for the pseudo-units
    of interrupts and workqueues (they only ever get AllowedCPUs)."""

    def __init__(self, systemd: SystemdAPI, kernel: KernelAPI | None) -> None:
        self.systemd, self.kernel = systemd, kernel

    async def start_transient(self, unit: str, props: Props) -> None:
        await self.systemd.start_transient(unit, props)

    async def set_properties(self, unit: str, props: Props, missing_ok: bool = False) -> None:
        if unit in KERNEL_HOLDERS:
            if self.kernel is not None and "AllowedCPUs" in props:
                await self.kernel.set_cpus(unit, CPUSet.from_mask(bytes(props["AllowedCPUs"][1])))
            return
        await self.systemd.set_properties(unit, props, missing_ok)

    def batched(self, unit: str) -> bool:
        return unit in KERNEL_HOLDERS

    async def set_many(self, writes: Mapping[str, Props]) -> None:
        """Both kernel holders in one write."""
        wants = {u: CPUSet.from_mask(bytes(p["AllowedCPUs"][1]))
                 for u, p in writes.items() if "AllowedCPUs" in p}
        if self.kernel is not None and wants:
            await self.kernel.set_many(wants)

    async def stop(self, unit: str) -> None:
        await self.systemd.stop(unit)

    async def remove_overrides(self, unit: str, names: Sequence[str]) -> None:
        await self.systemd.remove_overrides(unit, names)


class Events(Protocol):
    """What the bus layer is told after each committed change, with the values to publish."""

    def allocation_added(self, name: str, values: Mapping[str, Any]) -> None: ...
    def allocation_removed(self, name: str) -> None: ...
    def allocation_changed(self, name: str, reason: str, changed: Mapping[str, Any]) -> None: ...
    def pools_changed(self, shared: str, exclusive: str, fragment: str) -> None: ...
    def manager_changed(self, changed: Mapping[str, Any], invalidated: Sequence[str]) -> None: ...


class NoEvents:
    def allocation_added(self, name: str, values: Mapping[str, Any]) -> None:
        pass

    def allocation_removed(self, name: str) -> None:
        pass

    def allocation_changed(self, name: str, reason: str, changed: Mapping[str, Any]) -> None:
        pass

    def pools_changed(self, shared: str, exclusive: str, fragment: str) -> None:
        pass

    def manager_changed(self, changed: Mapping[str, Any], invalidated: Sequence[str]) -> None:
        pass


def kernel_holders(config: Config) -> tuple[str, ...]:
    """The pseudo-units of the kernel that follow the shared pool, as configured."""
    return (*((IRQS,) if config.isolate_irqs else ()),
            *((WORKQUEUES,) if config.isolate_workqueues else ()))


def empty_ledger(config: Config, topology: Topology) -> Ledger:
    return Ledger(topology.online, config.reserved, topology.isolated & topology.online,
                  config.granularity, config.min_shared_cpus)


class Engine:
    def __init__(self, config: Config, systemd: SystemdAPI, store: Store,
                 topology: Topology, kernel: KernelAPI | None = None) -> None:
        self.config = config
        self.systemd = systemd
        self.kernel = kernel
        self.effector = Effector(systemd, kernel)
        self.store = store
        self.topology = topology
        self.state = State(empty_ledger(config, topology), {})
        self.targets = Targets(config.confine_host, kernel_holders(config))
        self.events: Events = NoEvents()
        # committed changes of allocations, one event each (the daemon sends them to journald)
        self.audit: journal.Audit = journal.Journal(native=False)
        self.counters = metrics.Counters()  # requests and repairs, for the metrics
        # cpuset partitions: what this host can do (the daemon detects it), what the kernel
        # reports of each partitioned allocation's slice, and the reader of that report
        self.capabilities = partitions.Capabilities()
        self.partition_states: dict[str, partitions.State] = {}
        self.read_partition: Callable[[str], partitions.State | None] = partitions.read_state
        self.detect_kernel: Callable[[], tuple[bool, str]] = partitions.detect_kernel
        self.lock = asyncio.Lock()

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    async def commit(
        self,
        new: State,
        touched: set[str] | None,
        reasons: Mapping[str, str] | None = None,
        sync: bool = False,
        checkpoint_first: bool = True,
        topology: Topology | None = None,
    ) -> None:
        """Checkpoint, apply to systemd, publish; on failure put both back and raise.
        ``touched``: the allocations the change is about (None: look at all of them);
        ``sync``: from what systemd reports rather than from the current state; ``topology``:
        the machine as it is now, when it changed (hotplug, Revalidate)."""
        check_invariants(new.ledger)
        old, old_topology = self.state, self.topology
        memo = self.targets.memo()  # a failed change leaves no spec of its own behind
        changed = self.targets.changed(old, new, touched)
        if checkpoint_first:
            self.store.save(new, changed)
        try:
            before = self.specs(old, changed)
            self.topology = topology or old_topology
            if sync:
                await self.sync(new)
            else:
                tx = reconcile.plan(before, self.specs(new, changed),
                                    old.ledger.exclusive | new.ledger.exclusive)
                await reconcile.execute(tx, self.effector)
            if not checkpoint_first:
                self.store.save(new, changed)
        except Exception as exc:
            log.error("applying a change failed, rolling back: %s", exc)
            self.topology = old_topology
            self.targets.restore(memo)
            if sync or not (isinstance(exc, reconcile.Failed) and exc.clean):
                try:
                    await self.sync(old)
                except Exception as again:
                    log.error("rollback incomplete: %s", again)
            try:
                self.store.save(old, changed)
            except CPUServiceError as again:
                log.error("cannot write the state back: %s", again)
            cause = exc.cause if isinstance(exc, reconcile.Failed) else exc
            if isinstance(cause, CPUServiceError):
                raise cause from None
            raise SystemdFailure(f"systemd failed: {cause}") from None
        except BaseException:
            self.topology = old_topology
            self.targets.restore(memo)
            raise
        self.state = new
        before_partitions = dict(self.partition_states)
        await self.observe_partitions(changed)
        self._publish(old, new, changed, reasons or {}, old_topology, before_partitions)

    def specs(self, state: State, names: Iterable[str]) -> dict[str, UnitSpec]:
        return self.targets.specs(self.topology, state, names)

    async def sync(self, state: State) -> None:
        """Make systemd match ``state`` whatever it holds now (startup, Revalidate, a rollback
        that could not be undone): the same transaction, from what systemd reports."""
        after = self.specs(state, state.ledger.allocations)
        before = await self.observe(after)
        # what bound slices hold now is protected too; a slice on the shared pool (a bound
        # allocation that lost every CPU) holds nothing of its own
        on_pool = {state.records[n].unit for n, a in state.ledger.allocations.items()
                   if a.bound and not a.held and n in state.records}
        held = CPUSet.union_all(spec.cpus or CPUSet() for unit, spec in before.items()
                                if (own := units.name_of_slice(unit)) and own[1]
                                and unit not in on_pool)
        await reconcile.execute(reconcile.plan(before, after, state.ledger.exclusive | held),
                                self.effector)

    async def observe(self, after: Mapping[str, UnitSpec]) -> dict[str, UnitSpec]:
        """The units systemd holds now: our per-allocation slices (a dead one is stopped, so
        that it can be started again) and the other units ``after`` names. A slice is ours only
        when it is one ``after`` names or its Description records the allocation its name
        says: a slice somebody else made with a similar name is left alone."""
        before: dict[str, UnitSpec] = {}
        for unit, active in await self.systemd.list_units(OWN_PATTERNS):
            if units.name_of_slice(unit) is None:
                continue
            have = await self.systemd.get(unit, cgroup_iface(unit), units.OWN_PROPERTIES)
            have.update(await self.systemd.get(unit, UNIT_IFACE, ["Description"]))
            if unit not in after and not units.made_by_us(unit, have.get("Description", "")):
                log.warning("leaving %s alone: cpuservice did not make it", unit)
                continue
            if active not in ("active", "activating"):
                await self.systemd.stop(unit)
                continue
            before[unit] = UnitSpec(units.observed_props(have), own=True)
        for unit, spec in after.items():
            if unit in KERNEL_HOLDERS:
                cpus = await self.kernel.get_cpus(unit) if self.kernel is not None else None
                if cpus:
                    before[unit] = UnitSpec(units.shared_props(cpus), own=False)
                continue
            if spec.own:
                continue
            have = await self.systemd.get(unit, cgroup_iface(unit), units.CPU_PROPERTIES)
            if have:
                before[unit] = UnitSpec(units.observed_props(have), own=False,
                                        restore=spec.restore, forget=spec.forget)
        return before

    async def detect_capabilities(self) -> partitions.Capabilities:
        """What this host can do about partitions: systemd's version and whether its slices
        have CPUSetPartition, and what the kernel offers."""
        try:
            version = await self.systemd.manager_version()
            root = await self.systemd.get("-.slice", cgroup_iface("-.slice"),
                                          [partitions.PROPERTY])
        except CPUServiceError as exc:
            log.warning("cannot ask systemd what it supports: %s", exc)
            version, root = "", {}
        kernel, why = self.detect_kernel()
        self.capabilities = partitions.Capabilities(version, partitions.PROPERTY in root,
                                                    kernel, why)
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
        for name in sorted(await self.observe_partitions()):
            if name in self.state.ledger.allocations:
                diff = views.changed(
                    views.allocation(self.topology, self.state, name, before.get(name)),
                    views.allocation(self.topology, self.state, name, self.partition_report(name)))
                if diff:
                    self.events.allocation_changed(name, reason, diff)
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

    def _publish(self, old: State, new: State, changed: set[str], reasons: Mapping[str, str],
                 old_topology: Topology,
                 old_partitions: Mapping[str, partitions.State | None] | None = None) -> None:
        """Events, with their values, for what changed. An unbound allocation's CPUSet is the
        shared pool: it is announced once, by SharedCPUs and PoolsChanged, not per allocation."""
        before, after = old.ledger.allocations, new.ledger.allocations
        for name in sorted(changed | reasons.keys()):
            if name not in after:
                self.targets.forget(name)
                self.events.allocation_removed(name)
            elif name not in before:
                self.events.allocation_added(name, views.allocation(
                    self.topology, new, name, self.partition_report(name)))
            elif before[name] is not after[name] or name in reasons or (
                new.records.get(name) is not old.records.get(name)
            ):
                was_partition = (self.partition_states if old_partitions is None
                                 else old_partitions).get(name)
                diff = views.changed(views.allocation(old_topology, old, name, was_partition),
                                     views.allocation(self.topology, new, name,
                                                      self.partition_report(name)))
                self.events.allocation_changed(name, reasons.get(name, "changed"), diff)
        was, now = old.ledger, new.ledger
        if (was.shared, was.exclusive, was.fragment) != (now.shared, now.exclusive, now.fragment):
            self.events.pools_changed(now.shared.format(), now.exclusive.format(),
                                      now.fragment.format())
        manager = views.changed(views.manager(was), views.manager(now))
        invalidated = ["Topology"] if self.topology != old_topology else []
        if manager or invalidated:
            self.events.manager_changed(manager, invalidated)
