"""Lending idle exclusive CPUs (issue 26), the shell's part: while some allocation lends (option
lend), every ``lend_sample_ms`` read each lender's CPU time from its cgroup, run the pure
controller (cpuservice.model.lending.step) on its load, and commit what it decides through the
engine's one ``apply``: lent cores join the borrow slice, withdrawn ones leave it first (one
transaction for every owner that got busy in the same sample). The checkpoint says what is lent;
a withdrawal is applied even when the checkpoint cannot be written (the owner's CPUs come first;
a restart that lends them again withdraws them at its next samples)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from cpuservice.apply.change import Change, Durability, Note
from cpuservice.host import cgroup
from cpuservice.host.journal import Kind
from cpuservice.model import compat, lending
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import CPUServiceError
from cpuservice.model.lending import Action, Lender
from cpuservice.model.request import Request, parse_options
from cpuservice.model.state import State
from cpuservice.model.topology import Topology
from cpuservice.shell.engine import Engine
from cpuservice.shell.ports import cgroup_iface

log = logging.getLogger(__name__)
FLUSH_SECONDS = 5.0  # how often the metrics hear of lent CPU time while something is lent
LENT, WITHDRAWN = "lent", "withdrawn"  # the reasons of AllocationChanged


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
        self.clock: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        self.lenders: dict[str, Lender] = {}
        self._groups: dict[str, str] = {}  # unit -> its ControlGroup (asked once)
        self._last: dict[str, tuple[float, int]] = {}  # allocation -> (time, usage_usec)
        self._sampled: float | None = None
        self._flushed = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        # allocation -> when it was last made or released (forget): a decision taken before
        # is not about the allocation of that name now
        self._born: dict[str, int] = {}
        self._births = itertools.count(1)

    def forget(self, name: str) -> None:
        """``name`` was released, or is a new allocation: what the loop knew under that name
        (its idle time, its last reading) was another allocation's."""
        self.lenders.pop(name, None)
        self._last.pop(name, None)
        self._born[name] = next(self._births)

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
            await self.commit(names, Action.WITHDRAW, self.clock(), {}, "the daemon stops")

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
        self._sampled = None

    async def sample(self) -> None:
        """Read every lender's load once, step the controller, commit what it decided:
        withdrawals first (one change), then lending."""
        now = self.clock()
        state, topology = self.engine.state, self.engine.topology
        self.lenders = lending.resync(self.lenders, topology, state, now)
        counters = self.engine.counters
        lent_now = lending.all_lent(topology, state)
        if self._sampled is not None:
            counters.lent(len(lent_now), now - self._sampled)
        self._sampled = now
        if lent_now and now - self._flushed >= FLUSH_SECONDS:
            self._flushed = now
            counters.flush()
        withdraw: list[str] = []
        lend: list[str] = []
        loads: dict[str, float | None] = {}
        for name, lender in list(self.lenders.items()):
            if self.skip(name):
                continue
            a = state.ledger.allocations[name]
            cpus = lending.lendable(topology, a)
            usage = await self._usage(state.records[name].unit)
            load: float | None = None
            if usage is not None:
                before, self._last[name] = self._last.get(name), (now, usage)
                if before is None:
                    continue  # the first reading: the next one tells the load
                load = lending.load_percent(before, (now, usage), len(cpus))
                if load is None:
                    continue  # the cgroup was made again: start over
            loads[name] = load
            new, action = lending.step(lender, load, now, self.config)
            self.lenders[name] = new
            if action is Action.WITHDRAW:
                withdraw.append(name)
            elif action is Action.LEND or (new.lent and lending.lent(topology, state, name)
                                           != cpus):
                lend.append(name)  # lent again, or its lendable cores changed while lent
        for name in set(self._last) - self.lenders.keys():
            del self._last[name]
        units = {r.unit for r in state.records.values()}
        for unit in set(self._groups) - units:
            del self._groups[unit]
        for name in set(self._born) - state.ledger.allocations.keys():
            del self._born[name]  # a decision about it is stale all the same: born.get differs
        born = {name: self._born.get(name) for name in withdraw + lend}
        # a commit that fails is tried again: the next samples find the state as it is
        # (still lent: withdrawn at the next busy sample; not lent: after the idle time again)
        try:
            if withdraw:
                await self.commit(withdraw, Action.WITHDRAW, now, loads, born=born)
            if lend:
                await self.commit(lend, Action.LEND, now, loads, born=born)
        except CPUServiceError as exc:
            log.warning("lending: %s %s failed: %s", "withdrawing from" if withdraw else
                        "lending", ", ".join(withdraw or lend), exc)

    async def _usage(self, unit: str) -> int | None:
        group = self._groups.get(unit)
        if group is None:
            try:
                found = (await self.engine.systemd.get(unit, cgroup_iface(unit),
                                                       ["ControlGroup"])).get("ControlGroup")
            except Exception as exc:  # unknown: busy, until it can be read
                log.warning("lending: cannot find the cgroup of %s: %s", unit, exc)
                return None
            if not found:
                return None
            group = self._groups[unit] = str(found)
        usage = self.read_usage(group)
        if usage is None:
            self._groups.pop(unit, None)  # ask again: the unit may have been made again
        return usage

    async def commit(self, names: Sequence[str], action: Action, detected: float,
                     loads: dict[str, float | None], cause: str = "",
                     born: Mapping[str, int | None] | None = None) -> None:
        """Lend (or withdraw) the cores of ``names`` in one change, under the engine's lock,
        from the state as it is then. ``detected``: when the sample that decided was taken
        (a withdrawal's latency is counted from it); ``cause``: why, when it is not the
        owners' load; ``born``: the allocations' births when the sample decided (one made or
        released since is left alone: the decision was about another allocation)."""
        async with self.engine.lock:
            state, topology = self.engine.state, self.engine.topology
            lent_now: dict[str, CPUSet] = {}
            notes: list[Note] = []
            for name in names:
                a = state.ledger.allocations.get(name)
                record = state.records.get(name)
                if a is None or record is None or self.skip(name):
                    continue
                if born is not None and born.get(name) != self._born.get(name):
                    continue
                was = lending.lent(topology, state, name)
                why = cause or _why(loads.get(name), action)
                if action is Action.LEND:
                    cpus = lending.lendable(topology, a)
                    if cpus and cpus != record.lent:
                        lent_now[name] = cpus
                        notes.append(Note(Kind.LENT, name, why, {"lent": cpus.format()}))
                elif record.lent:
                    lent_now[name] = EMPTY
                    if was:
                        notes.append(Note(Kind.WITHDRAWN, name, why,
                                          {"withdrawn": was.format()}))
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
            for _ in lent_now:
                self.engine.counters.withdrawn(took)


def _why(load: float | None, action: Action) -> str:
    if load is None:
        return "its load cannot be read" if action is Action.WITHDRAW else "idle"
    return f"{'busy' if action is Action.WITHDRAW else 'idle'}: load {load:.0f}%"
