"""An in-memory systemd for unit tests of the service: units with their properties and states,
jobs, UnitRemoved/UnitNew/PropertiesChanged callbacks, failure injection, and a timeline of every
unit's AllowedCPUs after each call, with a checker for the reconcile ordering rule."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from cpuservice.apply.partitions import State as PartitionState
from cpuservice.apply.units import dropin_paths
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import SystemdFailure

NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
CONFINED = ("system.slice", "user.slice", "machine.slice", "init.scope")
BORROW = "cpuservice-borrow.slice"  # transient: started with the first borrower


class Crash(BaseException):
    """The daemon dies here (kill -9): nothing after this call runs, no undo."""


@dataclass
class Unit:
    name: str
    props: dict[str, Any] = field(default_factory=dict)
    active: str = "active"
    transient: bool = False
    pids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Write:
    """One mutating call: member, unit, properties as set."""

    member: str
    unit: str
    props: Mapping[str, Any]


class FakeSystemd:
    """The surface cpuservice.service uses of cpuservice.host.systemd.Systemd."""

    def __init__(self, units: Iterable[str] = ("cpuservice-shared.slice", *CONFINED)
                 ) -> None:
        self.units: dict[str, Unit] = {u: Unit(u) for u in units}
        self.writes: list[Write] = []
        self.timeline: list[dict[str, CPUSet]] = [self.snapshot()]
        self.calls = 0  # mutating calls so far
        self.reads = 0  # reading calls so far (unit_path, get, processes, ...)
        self.fail: Callable[[int, str, str], Exception | None] = lambda n, member, unit: None
        self.on_unit_removed: Callable[[str], None] = lambda unit: None
        self.on_unit_new: Callable[[str], None] = lambda unit: None
        self.on_unit_state: Callable[[str, str], None] = lambda path, state: None
        self.watched: set[str] = set()
        self.version = "252.39-1~deb12u1"
        self.partitions = False  # slices know CPUSetPartition (systemd >= 261)
        self.invalid: dict[str, str] = {}  # unit -> why the kernel calls its partition invalid

    # ---- failure injection ----

    def fail_at(self, n: int, error: BaseException | None = None) -> None:
        """Make the n-th mutating call from now (1-based) raise ``error`` (default: systemd
        refuses it); a Crash stops the caller as kill -9 would."""
        target = self.calls + n

        def fail(call: int, member: str, unit: str) -> Exception | None:
            if call == target:
                raise error or SystemdFailure(f"systemd refused {member}: injected failure")
            return None

        self.fail = fail

    def _mutating(self, member: str, unit: str, props: Mapping[str, Any]) -> None:
        if "CPUSetPartition" in props and not self.partitions:  # systemd < 261
            raise SystemdFailure(f"systemd refused {member}: org.freedesktop.DBus.Error."
                                 "PropertyReadOnly: Cannot set property CPUSetPartition, or "
                                 "unknown property.")
        self.calls += 1
        self.fail(self.calls, member, unit)
        self.writes.append(Write(member, unit, {k: v for k, (_, v) in props.items()}))

    # ---- timeline ----

    def snapshot(self) -> dict[str, CPUSet]:
        out = {}
        for u in self.units.values():
            mask = u.props.get("AllowedCPUs")
            if u.active in ("active", "activating") and mask and CPUSet.from_mask(bytes(mask)):
                out[u.name] = CPUSet.from_mask(bytes(mask))
        return out

    def _record(self) -> None:
        self.timeline.append(self.snapshot())

    def mark(self) -> tuple[int, int]:
        """Indexes into the timeline and the writes, to check what happens after them."""
        return len(self.timeline) - 1, len(self.writes)

    def cpus(self, unit: str) -> CPUSet:
        mask = self.units[unit].props.get("AllowedCPUs", b"")
        return CPUSet.from_mask(bytes(mask))

    # ---- the Systemd surface ----

    @staticmethod
    def path(unit: str) -> str:
        return "/org/freedesktop/systemd1/unit/" + "".join(
            c if c.isalnum() else f"_{ord(c):02x}" for c in unit)

    async def start_transient(self, unit: str, props: Mapping[str, tuple[str, Any]]) -> None:
        self._mutating("StartTransientUnit", unit, props)
        if unit in self.units:
            raise SystemdFailure(f"systemd refused StartTransientUnit: "
                                 f"org.freedesktop.systemd1.UnitExists: {unit} exists")
        pids = [int(p) for p in props.get("PIDs", ("au", []))[1]]
        self.units[unit] = Unit(unit, {k: v for k, (_, v) in props.items() if k != "PIDs"},
                                transient=True, pids=pids)
        self._record()
        self.on_unit_new(unit)

    async def set_properties(self, unit: str, props: Mapping[str, tuple[str, Any]],
                             missing_ok: bool = False) -> None:
        if not props:
            return
        self._mutating("SetUnitProperties", unit, props)
        if unit not in self.units:
            if missing_ok:
                return
            raise SystemdFailure(f"systemd refused SetUnitProperties: {NO_SUCH_UNIT}: "
                                 f"unit {unit} not loaded")
        u = self.units[unit]
        for name, (_, value) in props.items():
            u.props[name] = value
        if not u.transient:  # systemd writes a runtime drop-in per property
            paths = u.props.setdefault("DropInPaths", [])
            paths += [p for p in dropin_paths(unit, props)
                      if "system.control" in p and p not in paths]
        self._record()

    async def stop(self, unit: str) -> None:
        self._mutating("StopUnit", unit, {})
        if unit not in self.units:
            return
        removed = self.units.pop(unit)
        self._record()
        if self.path(unit) in self.watched:
            self.on_unit_state(self.path(unit), "inactive")
        if removed.transient:
            self.on_unit_removed(unit)

    async def remove_overrides(self, unit: str, names: Sequence[str]) -> None:
        self._mutating("RemoveOverrides", unit, {n: ("s", "") for n in names})
        u = self.units.get(unit)
        if u is not None:
            gone = set(dropin_paths(unit, names))
            u.props["DropInPaths"] = [p for p in u.props.get("DropInPaths", []) if p not in gone]

    async def manager_version(self) -> str:
        return self.version

    def read_partition(self, control_group: str) -> PartitionState | None:
        """What the kernel would report in the cgroup's cpuset.cpus.partition."""
        u = self.units.get(control_group.rsplit("/", 1)[-1])
        if u is None:
            return None
        mode = str(u.props.get("CPUSetPartition") or "member")
        reason = self.invalid.get(u.name)
        return PartitionState(mode, reason, False) if reason else PartitionState(mode)

    async def load_state(self, unit: str) -> str:
        self.reads += 1
        u = self.units.get(unit)
        return "not-found" if u is None else str(u.props.get("LoadState", "loaded"))

    async def unit_path(self, unit: str) -> str | None:
        self.reads += 1
        return self.path(unit) if unit in self.units else None

    async def get(self, unit: str, interface: str, names: Iterable[str]) -> dict[str, Any]:
        self.reads += 1
        if unit not in self.units and unit != "-.slice":  # the root slice is always loaded
            return {}
        u = self.units.get(unit, Unit(unit))
        values: dict[str, Any] = {"AllowedCPUs": b"", "AllowedMemoryNodes": b"",
                                  "CPUWeight": 2**64 - 1, "CPUQuotaPerSecUSec": 2**64 - 1,
                                  "Description": unit, "ActiveState": u.active,
                                  "LoadState": "loaded", "DropInPaths": [],
                                  "ControlGroup": "/" + unit}
        if self.partitions:
            values["CPUSetPartition"] = ""
        values.update(u.props)
        return {k: values[k] for k in names if k in values}

    async def list_units(self, patterns: Sequence[str]) -> list[tuple[str, str]]:
        self.reads += 1
        return [(u.name, u.active) for u in self.units.values()
                if any(fnmatch.fnmatchcase(u.name, p) for p in patterns)]

    async def processes(self, unit: str) -> list[int]:
        self.reads += 1
        prefix = unit[:-len(".slice")] + "-" if unit.endswith(".slice") else None
        return [p for u in self.units.values() for p in u.pids
                if u.name == unit or u.props.get("Slice") == unit
                or (prefix and u.name.startswith(prefix))]

    async def member_units(self, unit: str) -> set[str]:
        self.reads += 1
        prefix = unit[:-len(".slice")] + "-" if unit.endswith(".slice") else None
        return {u.name for u in self.units.values() if u.pids and u.name != unit and (
            u.props.get("Slice") == unit or (prefix and u.name.startswith(prefix)))}

    async def watch_unit(self, path: str) -> None:
        self.watched.add(path)

    async def unwatch_unit(self, path: str) -> None:
        self.watched.discard(path)

    # ---- what a test does to the units ----

    def kill_processes(self, unit: str) -> None:
        """The processes of a unit (and of the scopes in it) end; scopes go away."""
        for u in list(self.units.values()):
            if u.name == unit or u.props.get("Slice") == unit:
                u.pids.clear()
                if u.name.endswith(".scope"):
                    del self.units[u.name]
                    self.on_unit_removed(u.name)


# units that hold the shared pool together: they may share its CPUs with one another (the
# borrow slice holds the shared pool too, and the CPUs lent now)
SHARED_HOLDERS = frozenset({"cpuservice-shared.slice", BORROW, *CONFINED, "kernel:irqs",
                            "kernel:workqueues"})


def violations(timeline: Sequence[Mapping[str, CPUSet]], exclusive: CPUSet,
               lent: Mapping[int, str | AbstractSet[str]] | None = None) -> list[str]:
    """Instants at which a CPU of ``exclusive`` is in the AllowedCPUs of two units, other than
    two holders of the shared pool (before it leaves the pool, such a CPU is theirs) or, for a
    CPU of ``lent`` (cpu -> the unit of the allocation that lends it, or the units of those
    that lend it before and after a change), the borrow slice and one such unit: never the
    borrow slice and any other unit, never two owners."""
    found = []
    for i, units in enumerate(timeline):
        for cpu in exclusive:
            holders = {u for u, cpus in units.items() if cpu in cpus}
            owner = lent.get(cpu, frozenset()) if lent else frozenset()
            owners = {owner} if isinstance(owner, str) else owner
            if len(holders) > 1 and not holders <= SHARED_HOLDERS and not (
                    BORROW in holders and len(holders) == 2 and holders - {BORROW} <= owners):
                found.append(f"instant {i}: cpu {cpu} in {', '.join(sorted(holders))}")
    return found


def empty_writes(writes: Sequence[Write], foreign: Iterable[str] = ()) -> list[Write]:
    """Writes of an empty AllowedCPUs to a unit that is not a restored foreign unit."""
    exempt = set(foreign)
    return [w for w in writes if "AllowedCPUs" in w.props and w.unit not in exempt
            and not CPUSet.from_mask(bytes(w.props["AllowedCPUs"]))]


class FakeKernel:
    """cpuservice.host.irqs.Kernel for the unit tests: the interrupt and workqueue holders are units
    of the fake systemd, so that the timeline and its checker see them like the shared slice."""

    def __init__(self, systemd: FakeSystemd) -> None:
        from cpuservice.host.irqs import Report
        self.systemd = systemd
        self.report = Report()
        self.batches: list[dict[str, CPUSet]] = []  # the holders set together, each time

    async def set_cpus(self, holder: str, cpus: CPUSet) -> None:
        fake = self.systemd
        fake._mutating("SetKernelCPUs", holder, {"AllowedCPUs": ("ay", cpus.to_mask())})
        fake.units.setdefault(holder, Unit(holder)).props["AllowedCPUs"] = cpus.to_mask()
        fake._record()
        self.report.cpus = cpus

    async def set_many(self, wants: Mapping[str, CPUSet]) -> None:
        self.batches.append(dict(wants))
        for holder, cpus in wants.items():
            await self.set_cpus(holder, cpus)

    async def settle(self) -> None:
        pass

    async def get_cpus(self, holder: str) -> CPUSet | None:
        unit = self.systemd.units.get(holder)
        return None if unit is None else CPUSet.from_mask(bytes(unit.props["AllowedCPUs"]))
