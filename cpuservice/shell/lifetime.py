"""``lifetime=unit``: an allocation ends with its unit (a foreign unit that stopped or failed),
or, for its own slice, when the slice has had processes and has none left. Driven by systemd's
signals only; a burst of them leads to one check."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from cpuservice.apply.change import Change
from cpuservice.apply.targets import own_slice
from cpuservice.host.checkpoint import Record, State
from cpuservice.model.errors import CPUServiceError
from cpuservice.model.state import with_record
from cpuservice.shell.engine import Engine
from cpuservice.shell.ports import UNIT_IFACE, SystemdAPI

log = logging.getLogger(__name__)
SETTLE_SECONDS = 0.05


async def ended(systemd: SystemdAPI, record: Record) -> bool:
    """Whether the unit of a lifetime=unit allocation has ended."""
    if own_slice(record):
        if (await systemd.unit_path(record.unit)) is None:
            return True
        return record.populated and not await systemd.processes(record.unit)
    state = await systemd.get(record.unit, UNIT_IFACE, ["ActiveState"])
    return state.get("ActiveState", "inactive") in ("inactive", "failed")


class Lifetime:
    """Watches the units of lifetime=unit allocations; ``release`` ends an allocation.

    Each signal leads to a check of the one allocation it concerns, never of all of them: a
    foreign unit's state change (its object path), the removal of an allocation's own slice or of
    a unit inside it (known from UnitNew: one Slice lookup per new scope or service while own
    slices are followed, and from the slice's members when it starts being followed). Signals
    about any other unit cost nothing (a user can cause them at will with LoadUnit)."""

    def __init__(self, engine: Engine,
                 release: Callable[[str, str, int | None], Awaitable[None]] | None = None,
                 serial: Callable[[str], int | None] = lambda name: None) -> None:
        self.engine = engine
        self.release = release
        self.serial = serial
        self._watched: dict[str, str] = {}  # unit object path -> allocation name
        self._tracked: set[str] = set()  # the lifetime=unit allocations
        self._since: dict[str, float] = {}  # when each began to be followed (monotonic)
        self._members: dict[str, str] = {}  # unit inside an own slice -> allocation name
        self._pending: set[str] = set()  # allocations to check next
        self._task: asyncio.Task[None] | None = None
        self._unknown: set[str] = set()  # new units whose Slice is being looked up
        self._lookups: set[asyncio.Task[None]] = set()

    def track(self, name: str) -> None:
        """A lifetime=unit allocation to follow (its own slice through systemd's signals).
        One whose slice has had no process ``lifetime_grace_seconds`` from now (its caller
        died before Attach) is released then."""
        self._tracked.add(name)
        self._since[name] = time.monotonic()
        grace = self.engine.config.lifetime_grace_seconds
        asyncio.get_running_loop().call_later(grace + SETTLE_SECONDS, self.schedule, name)

    async def watch(self, name: str, unit: str) -> None:
        """Follow a foreign unit's ActiveState (own slices are followed through UnitRemoved)."""
        path = await self.engine.systemd.unit_path(unit)
        if path is not None:
            self._watched[path] = name
            await self.engine.systemd.watch_unit(path)

    async def watch_all(self) -> None:
        for name, record in self.engine.state.records.items():
            a = self.engine.ledger.allocations[name]
            if a.request.options.lifetime == "unit":
                self.track(name)
                if not own_slice(record):
                    await self.watch(name, record.unit)
                elif record.populated:  # units that joined before this start
                    for unit in await self.engine.systemd.member_units(record.unit):
                        self._members[unit] = name

    async def unwatch(self, name: str) -> None:
        self._tracked.discard(name)
        self._since.pop(name, None)
        for unit, owner in list(self._members.items()):
            if owner == name:
                del self._members[unit]
        for path, watched in list(self._watched.items()):
            if watched == name:
                del self._watched[path]
                await self.engine.systemd.unwatch_unit(path)

    # ---- systemd's signals ----

    def member(self, unit: str, name: str) -> None:
        """``unit`` runs inside allocation ``name``'s own slice (Attach made it)."""
        if name in self._tracked:
            self._members[unit] = name

    def _own_slices(self) -> dict[str, str]:
        """slice unit -> allocation, for the tracked allocations that run in their own slice."""
        records = self.engine.state.records
        return {records[n].unit: n for n in self._tracked
                if n in records and own_slice(records[n])}

    def on_unit_state(self, path: str, state: str) -> None:
        if path in self._watched and state in ("inactive", "failed"):
            self.schedule(self._watched[path])

    def on_unit_removed(self, unit: str) -> None:
        name = self._members.pop(unit, None) or self._own_slices().get(unit)
        if name is not None:
            self.schedule(name)
        # a unit gone before its Slice was looked up (what LoadUnit of anything causes) is not
        # followed: in a slice with other members it ends nothing; if it was a slice's first and
        # only member, the slice never counts as populated and the grace period releases it

    def on_unit_new(self, unit: str) -> None:
        if (unit.endswith((".scope", ".service")) and unit not in self._members
                and unit not in self._unknown and self._own_slices()):
            self._unknown.add(unit)
            task = asyncio.get_running_loop().create_task(self._learn(unit))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)

    async def _learn(self, unit: str) -> None:
        """Which own slice a new unit joined, if any (its Slice, or a slice below ours)."""
        iface = "org.freedesktop.systemd1." + ("Scope" if unit.endswith(".scope") else "Service")
        try:
            slice_ = str((await self.engine.systemd.get(unit, iface, ["Slice"])).get("Slice", ""))
        except CPUServiceError:
            return  # gone again already (a LoadUnit of nothing): not ours to follow
        finally:
            self._unknown.discard(unit)
        for own, name in self._own_slices().items():
            if slice_ == own or slice_.startswith(own[:-len(".slice")] + "-"):
                self._members[unit] = name
                self.schedule(name)
                return

    def schedule(self, name: str | None = None) -> None:
        """Check ``name`` (None: every tracked allocation) soon; a signal that arrives while a
        check runs leads to one more check of what it concerns."""
        self._pending.update(self._tracked if name is None else {name})
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._checks())

    async def _checks(self) -> None:
        while self._pending:
            await asyncio.sleep(SETTLE_SECONDS)  # let a burst of unit signals settle
            names, self._pending = self._pending, set()
            await self.check(names)

    def _abandoned(self, name: str, record: Record) -> bool:
        """An own slice that never had a process within the grace period."""
        grace = self.engine.config.lifetime_grace_seconds
        since = self._since.get(name, time.monotonic())
        return own_slice(record) and not record.populated and (
            time.monotonic() - since >= grace)

    async def check(self, names: set[str] | None = None) -> None:
        """Release lifetime=unit allocations (``names``, None: all) whose unit ended; mark slices
        that got members."""
        engine = self.engine
        for name in sorted(self._tracked if names is None else names & self._tracked):
            if name not in engine.ledger.allocations:
                self._tracked.discard(name)
                self._since.pop(name, None)
                continue
            try:
                await self._check_one(name)
            except CPUServiceError as exc:  # one allocation's trouble must not stop the others
                log.error("lifetime check of %s failed: %s", name, exc)
                asyncio.get_running_loop().call_later(5.0, self.schedule, name)

    async def _check_one(self, name: str) -> None:
        engine = self.engine
        record = engine.state.records.get(name, Record())
        serial = self.serial(name)  # release only this allocation, not a later one of its name
        if await ended(engine.systemd, record):
            if self.release is not None:
                await self.release(name, "its unit ended", serial)
        elif self._abandoned(name, record) and not await engine.systemd.processes(record.unit):
            if self.release is not None:
                await self.release(name, "no process joined its slice in time", serial)
        elif not record.populated and own_slice(record) and (
            await engine.systemd.processes(record.unit)
        ):
            async with engine.lock:
                if name in engine.state.records:
                    records = with_record(engine.state.records, name,
                                          replace(engine.state.records[name], populated=True))
                    await engine.apply(Change(State(engine.ledger, records), frozenset({name})))
