"""Lending idle exclusive CPUs (issue 26), the shell's part: while some allocation lends (option
lend), every ``lend_sample_ms`` read what each lender's threads ran and where (its cgroup's
cpu.stat, its threads' schedstat and last CPU: cpuservice.host.cgroup), run the pure controller
(cpuservice.model.lending_control) on it core by core, and commit what it decides through the
engine's one ``apply``: lent cores join the borrow slice, withdrawn ones leave it first (one
transaction for every owner that got busy in the same sample, then one for the lends). The
checkpoint says what is lent; a withdrawal is applied even when the checkpoint cannot be
written (the owner's CPUs come first; a restart that lends them again withdraws them at its next
samples).

What an owner's load costs to read is bounded: an owner idle as a whole (its cgroup's total
below lend_idle_percent of one CPU) has its threads read 4 times a second at most, and an owner
with more than cgroup.MAX_THREADS threads is judged on its total alone (every core as loaded
as the owner is). What lending commits is bounded too: an owner's lends are
lending_control.DWELL_SECONDS apart at least, and count against its user's
max_changes_per_user_per_minute (a lend is held back once the user has made a quarter of it;
a withdrawal is never held back, and counts as well)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from cpuservice.apply.change import Change, Durability, Note
from cpuservice.apply.partitions import Capabilities
from cpuservice.host import cgroup
from cpuservice.host.authz import BusyError, RateLimit
from cpuservice.host.journal import Kind
from cpuservice.model import compat, lending, lending_control
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import CPUServiceError, NotSupported
from cpuservice.model.lending_control import Lender, Load
from cpuservice.model.request import Request, parse_options
from cpuservice.model.state import State
from cpuservice.model.topology import Topology
from cpuservice.shell.engine import Engine
from cpuservice.shell.ports import cgroup_iface

log = logging.getLogger(__name__)
FLUSH_SECONDS = 5.0  # how often the metrics hear of lent CPU time while something is lent
REFRESH_SECONDS = 0.25  # an owner idle as a whole has its threads read this often
LEND_SHARE = 4  # lends stop once a user made 1/LEND_SHARE of max_changes_per_user_per_minute
LENT, WITHDRAWN = "lent", "withdrawn"  # the reasons of AllocationChanged
Threads = Callable[[str, Mapping[int, int]], dict[int, tuple[int, int]] | None]


class Action(StrEnum):
    LEND = "lend"
    WITHDRAW = "withdraw"


def can_lend(caps: Capabilities, explicit: bool) -> bool:
    """Whether an allocation may lend on this host (``caps.lending``); where it cannot, an
    explicit ``lend`` (an Allocate's option, SetLending) is NotSupported, a default is off."""
    if caps.lending:
        return True
    if explicit:
        raise NotSupported(f"option 'lend': this host cannot lend: {caps.lending_reason}")
    return False


def switched(topology: Topology, state: State, name: str, lend: bool) -> Change | None:
    """The change that turns option lend of allocation ``name`` on or off (None: it is
    already so); off withdraws what it lends now. InvalidArgument where it cannot lend."""
    a = state.ledger.allocations[name]
    options = {**compat.dump(a.request.options, exclude_defaults=True), "lend": lend}
    request = Request.build(a.request.cpus, parse_options(options))
    if request == a.request:
        return None
    new = State(state.ledger.with_allocation(replace(a, request=request)), state.records)
    was = lending.lent(topology, state, name)
    record = state.records.get(name)
    if not lend and record is not None and record.lent:
        new = lending.with_lent(new, {name: EMPTY})
    notes = (Note(Kind.WITHDRAWN, name, "lending turned off", {"withdrawn": was.format()}),
             ) if was else ()
    return Change(new, frozenset({name}), {name: f"lending {'on' if lend else 'off'}"},
                  notes=notes)


@dataclass
class _Seen:
    """An owner's threads when they were last read: tid -> run time (ns), when, what its
    cgroup's usage grew by while they were read, and what it used since in samples that
    read no thread."""

    runtimes: dict[int, int]
    at: float
    gap_us: int = 0
    skipped_us: int = 0


_FIRST = Load(unplaced=-1.0)  # the first reading of an owner: the next one tells its load


class Lending:
    """The lending controller's loop and its commits (see the module's docstring).
    ``skip``: allocations to leave alone for now (their slice is being stopped)."""

    def __init__(self, engine: Engine, skip: Callable[[str], bool] = lambda name: False,
                 root: Path = cgroup.CGROUP_ROOT) -> None:
        self.engine = engine
        self.config = engine.config
        self.skip = skip
        self.read_usage: Callable[[str], int | None] = lambda group: cgroup.read_usage(
            group, root)
        self.read_threads: Threads = lambda group, known: cgroup.read_threads(group, known,
                                                                               root)
        self.clock: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        # the owners' users' change rate (the daemon shares the Manager's with it)
        self.rate = RateLimit(self.config.max_changes_per_user_per_minute, lambda: self.clock())
        self.lenders: dict[str, Lender] = {}
        self._groups: dict[str, str] = {}  # unit -> its ControlGroup (asked once)
        self._last: dict[str, tuple[float, int]] = {}  # allocation -> (time, usage_usec)
        self._seen: dict[str, _Seen] = {}  # allocation -> its threads when last read
        self._unreadable: set[str] = set()  # allocations whose load cannot be read (logged)
        self._sampled: float | None = None
        self._flushed = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        # an allocation's identity beyond its name (the service's serial, made on demand and
        # forgotten with the allocation: as many as live allocations): a decision taken about
        # one is not about another that took its name meanwhile
        self.identity: Callable[[str], int] = lambda name: 0

    def forget(self, name: str) -> None:
        """``name`` was released, or is a new allocation: what the loop knew under that name
        (its idle time, its last reading) was another allocation's."""
        self.lenders.pop(name, None)
        self._last.pop(name, None)
        self._seen.pop(name, None)

    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def ensure(self) -> None:
        """Sample while some allocation lends (at startup, after an Allocate or SetLending;
        never again once the daemon stops). The loop runs in a context of its own: what it
        commits is no caller's (journal.CALLER of whoever started it)."""
        if not self._stopped and not self.running() and self._wanted():
            self._task = asyncio.create_task(self._run(), context=contextvars.Context())

    def _wanted(self) -> bool:
        state = self.engine.state
        return bool(lending.lenders(state) or lending.all_lent(self.engine.topology, state))

    async def shutdown(self) -> None:
        """The daemon stops: no more samples, and nothing stays lent that no one watches (a
        restart lends again once the owners have been idle for lend_idle_seconds)."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            async with self.engine.lock:  # a commit in flight ends first, and is recorded
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        state = self.engine.state
        names = sorted(n for n, r in state.records.items() if r.lent)
        if names:
            await self.commit(dict.fromkeys(names, EMPTY), Action.WITHDRAW, self.clock(), {},
                              "the daemon stops")

    async def _run(self) -> None:
        interval = self.config.lend_sample_ms / 1000
        while self._wanted():
            await self.sleep(interval)
            try:
                await self.sample()
            except Exception:  # one failed sample never stops lending's protection
                log.exception("lending: a sample failed")
        self.lenders.clear()
        self._last.clear()
        self._seen.clear()
        self._sampled = None

    async def sample(self) -> None:
        """Read every lender's load once, step the controller, commit what it decided:
        withdrawals first (one change), then lends (one change, within the budget)."""
        now = self.clock()
        state, topology = self.engine.state, self.engine.topology
        self.lenders = lending_control.resync(self.lenders, topology, state)
        counters = self.engine.counters
        lent_now = lending.all_lent(topology, state)
        if self._sampled is not None:
            counters.lent(len(lent_now), now - self._sampled)
        self._sampled = now
        if lent_now and now - self._flushed >= FLUSH_SECONDS:
            self._flushed = now
            counters.flush()
        keep: dict[str, CPUSet] = {}  # owners withdrawn from -> what stays lent
        lend: dict[str, CPUSet] = {}  # owners that lend more -> what is lent after
        why: dict[str, str] = {}
        for name, lender in list(self.lenders.items()):
            if self.skip(name):
                continue
            cpus = lending.lendable(topology, state.ledger.allocations[name])
            load = await self._load(name, state.records[name].unit, now, cpus)
            if load is _FIRST:
                continue
            cores = lending_control.cores_of(topology, cpus)
            new = lending_control.step(lender, load, cores, now, self.config)
            self.lenders[name] = new
            if lender.lent - new.lent:
                keep[name] = lender.lent & new.lent
                why[name] = _why(load, cores, lender.lent - new.lent)
            if new.lent - lender.lent:
                lend[name] = new.lent
        for table in (self._last, self._seen):
            for name in set(table) - self.lenders.keys():
                del table[name]
        self._unreadable &= self.lenders.keys()
        units = {r.unit for r in state.records.values()}
        for unit in set(self._groups) - units:
            del self._groups[unit]
        born = {name: self.identity(name) for name in [*keep, *lend]}
        # a commit that fails is tried again: the next samples find the state as it is
        # (still lent: withdrawn at the next busy sample; not lent: after the idle time again)
        try:
            if keep:
                await self.commit(keep, Action.WITHDRAW, now, why, born=born)
            lend = self._budget(lend)
            if lend:
                await self.commit(lend, Action.LEND, now, {}, born=born)
        except CPUServiceError as exc:
            log.warning("lending: %s %s failed: %s", "withdrawing from" if keep else
                        "lending", ", ".join(keep or lend), exc)

    def _budget(self, lend: dict[str, CPUSet]) -> dict[str, CPUSet]:
        """The lends within their users' change rate; one held back leaves its lender as the
        state says (its idle time goes on; it is tried again after the dwell)."""
        ceiling = max(1, self.rate.per_minute // LEND_SHARE)
        out = {}
        for name, cpus in lend.items():
            record = self.engine.state.records.get(name)
            try:
                if record is not None and record.owner != 0:
                    self.rate.take(record.owner, ceiling)
            except BusyError:
                self.lenders[name] = replace(self.lenders[name], lent=lending.lent(
                    self.engine.topology, self.engine.state, name))
                continue
            out[name] = cpus
        return out

    async def _load(self, name: str, unit: str, now: float, cpus: CPUSet) -> Load | None:
        """The owner's Load since its last reading (_FIRST: there was none; None: it cannot
        be read, which counts as busy on every core; logged once until it can be again)."""
        group = await self._group(unit)
        at = self.clock()
        usage = self.read_usage(group) if group else None
        if usage is None:
            self._groups.pop(unit, None)  # ask again: the unit may have been made again
            self._last.pop(name, None)
            self._seen.pop(name, None)
            if name not in self._unreadable:
                self._unreadable.add(name)
                log.warning("lending: the load of %s cannot be read (cgroup %s of %s): it "
                            "counts as busy, none of its cores is lent", name, group or "unknown",
                            unit)
            return None
        if name in self._unreadable:
            self._unreadable.discard(name)
            log.info("lending: the load of %s can be read again", name)
        before, self._last[name] = self._last.get(name), (at, usage)
        seconds = at - before[0] if before else 0.0
        used = usage - before[1] if before else -1
        if seconds <= 0 or used < 0:  # the first reading, or the cgroup was made again
            self._seen.pop(name, None)
            return _FIRST
        total = lending_control.percent(used, seconds)
        seen = self._seen.get(name)
        idle = total < self.config.lend_idle_percent  # as a whole: then on every core too
        if idle and seen is not None and now - seen.at < REFRESH_SECONDS:
            seen.skipped_us += used
            return Load(unplaced=total)
        threads = self.read_threads(group, seen.runtimes if seen else {})
        if threads is None:  # too many threads (or gone): its total alone, on every core
            self._seen.pop(name, None)
            return Load(unplaced=total)
        after = self.read_usage(group)  # the kernel may account time while threads are read
        gap = max(0, after - usage) if after is not None else 0
        self._seen[name] = _Seen({t: r for t, (r, _) in threads.items()}, now, gap)
        if idle:  # read only to know them when it gets busy
            return Load(unplaced=total)
        return lending_control.thread_load(
            seen.runtimes if seen else {}, threads, used, seconds,
            self.config.lend_busy_percent, cpus, seen.skipped_us if seen else 0,
            seen.gap_us if seen else 0, gap)

    async def _group(self, unit: str) -> str:
        """The unit's ControlGroup ('' when it cannot be told)."""
        group = self._groups.get(unit)
        if group is None:
            try:
                found = (await self.engine.systemd.get(unit, cgroup_iface(unit),
                                                       ["ControlGroup"])).get("ControlGroup")
            except Exception as exc:  # unknown: busy, until it can be read
                log.warning("lending: cannot find the cgroup of %s: %s", unit, exc)
                return ""
            if not found:
                return ""
            group = self._groups[unit] = str(found)
        return group

    async def commit(self, targets: Mapping[str, CPUSet], action: Action, detected: float,
                     why: Mapping[str, str], cause: str = "",
                     born: Mapping[str, int | None] | None = None) -> None:
        """Lend (or withdraw) CPUs of the owners in ``targets`` in one change, under the
        engine's lock, from the state as it is then: a lend makes them lend their target's
        lendable CPUs; a withdrawal keeps of what they lend only what is in their target.
        ``detected``: when the sample that decided was taken (a withdrawal's latency is
        counted from it); ``why``/``cause``: why, for each owner / for all of them;
        ``born``: the allocations' identities when the sample decided (one released, or
        released and made again, since is left alone: the decision was about another)."""
        async with self.engine.lock:
            state, topology = self.engine.state, self.engine.topology
            lent_now: dict[str, CPUSet] = {}
            notes: list[Note] = []
            for name, target in targets.items():
                a = state.ledger.allocations.get(name)
                record = state.records.get(name)
                if a is None or record is None or self.skip(name):
                    continue
                if born is not None and born.get(name) != self.identity(name):
                    continue
                was = lending.lent(topology, state, name)
                if action is Action.LEND:
                    cpus = target & lending.lendable(topology, a)
                    if cpus and cpus != record.lent:
                        lent_now[name] = cpus
                        notes.append(Note(Kind.LENT, name, cause or "idle",
                                          {"lent": cpus.format()}))
                elif record.lent != was & target:
                    lent_now[name] = was & target
                    if was - target:
                        notes.append(Note(Kind.WITHDRAWN, name, cause or why.get(name, "busy"),
                                          {"withdrawn": (was - target).format()}))
            if not lent_now:
                return
            reason = LENT if action is Action.LEND else WITHDRAWN
            await self.engine.apply(Change(
                lending.with_lent(state, lent_now), frozenset(lent_now),
                dict.fromkeys(lent_now, reason), notes=tuple(notes),
                durability=Durability.FIRST if action is Action.LEND
                else Durability.SERVE_READ_ONLY))
        if action is Action.WITHDRAW and not cause:  # owners that got busy: one each
            took = self.clock() - detected
            for name in lent_now:
                self.engine.counters.withdrawn(took)
                owner = state.records[name].owner
                if owner != 0:
                    self.rate.add(owner)  # never held back, but counted


def _why(load: Load | None, cores: Mapping[int, CPUSet], withdrawn: CPUSet) -> str:
    """Why ``withdrawn`` left the borrow slice, for the journal."""
    if load is None:
        return "its load cannot be read"
    busiest = max((load.on(c) for c in cores.values() if c & withdrawn), default=0.0)
    threads = f", {load.busy_threads} busy thread(s)" if load.busy_threads else ""
    return f"busy: load {busiest:.0f}% of a CPU on its busiest withdrawn core{threads}"
