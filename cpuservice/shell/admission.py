"""Burst admission (group commit): Allocate requests that arrive while a change is in flight
wait in a queue; the next group takes them together. A group's requests are placed one after
another in memory, each on the ledger the ones before it leave (so every answer is the one
serial processing in the group's order would give), and committed as one change: one
checkpoint write, one change of the shared pool's holders, the new slices started at once,
one PoolsChanged. If committing a group fails, the group is undone as a whole and its requests
are committed one at a time instead, so that each gets exactly its own outcome.

Fairness: a group takes the oldest waiting request of every owner before it takes a second one
of anybody (round robin over owners, in order of their oldest request), up to GROUP_MAX
requests (more only when more owners wait), so one user's burst delays another user's request
by at most the one group in flight.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from cpuservice import placement
from cpuservice.apply.change import Change, Note
from cpuservice.host.journal import Kind
from cpuservice.model import limits
from cpuservice.model.errors import AllocationExists, CPUServiceError, InsufficientCPUs
from cpuservice.model.pools import Allocation
from cpuservice.model.request import Request
from cpuservice.model.state import Record, State, with_record
from cpuservice.placement import repack
from cpuservice.placement.moves import Move
from cpuservice.shell import foreign, moving, publish
from cpuservice.shell.engine import Engine
from cpuservice.shell.moving import MoveLog

log = logging.getLogger(__name__)
GROUP_MAX = 64  # requests placed and committed together, at most (unless more owners wait)
GATHER_TURNS = 8  # turns of the loop a group waits for, at most, while the queue grows


@dataclass(eq=False)
class Ask:
    """One Allocate waiting for its group, and the future its caller awaits."""

    name: str
    owner: int
    request: Request
    limited: bool  # held to the per-user limits
    caller: int | None = None  # the D-Bus caller's uid, for the audit trail
    force: bool = False  # past the admission guard (option force: root or manage)
    future: asyncio.Future[Allocation] = field(default_factory=lambda: (
        asyncio.get_running_loop().create_future()))


Outcome = tuple[Ask, Allocation | Exception]


def take_group(waiting: list[Ask], limit: int = GROUP_MAX) -> list[Ask]:
    """Remove and return the next group from ``waiting`` (oldest first): round robin over the
    owners in order of their oldest request; every owner's oldest request is in it, whatever
    ``limit`` says. Asks whose caller gave up (a cancelled future) are dropped."""
    waiting[:] = [a for a in waiting if not a.future.done()]
    queues: dict[int, list[Ask]] = {}
    for ask in waiting:
        queues.setdefault(ask.owner, []).append(ask)
    group: list[Ask] = []
    depth = 0
    while True:
        row = [q[depth] for q in queues.values() if len(q) > depth]
        if not row or (depth > 0 and len(group) >= limit):
            break
        group.extend(row if depth == 0 else row[:max(0, limit - len(group))])
        depth += 1
    taken = set(map(id, group))
    waiting[:] = [a for a in waiting if id(a) not in taken]
    return group


Guard = Callable[[int, str], None]  # (CPUs taken out of the shared pool, what): raises


async def place(engine: Engine, state: State, ask: Ask, moves: MoveLog | None = None,
                pending: Sequence[str] = (), guard: Guard | None = None,
                ) -> tuple[State, Allocation, tuple[Move, ...]]:
    """``state`` with ``ask`` placed in it (not committed), or its error raised. A request
    refused only for fragmentation is placed after moving movable allocations (``moves``: how
    often each may still move; ``pending``: names already moved by this group), when a small
    set of moves makes room (placement.repack); those moves are returned. ``guard`` is asked
    about what the request takes out of the shared pool (the admission guard), unless it
    forces."""
    name, request = ask.name, ask.request
    if name in state.ledger.allocations:
        raise AllocationExists(f"allocation {name!r} already exists")
    unit, saved, fresh = await foreign.target_unit(engine.systemd, name, request, state.records)
    records = with_record(state.records, name, Record(ask.owner, unit, saved, fresh=fresh))
    moved: tuple[Move, ...] = ()
    try:
        ledger, allocation = placement.allocate(engine.topology, state.ledger, name, request)
    except InsufficientCPUs:
        # moves systemd cannot be taken through safely (reconcile.NoSafeOrder) are passed over
        found = None if moves is None or not moves.limit else repack.repack(
            engine.topology, state.ledger, name, request,
            allowed=lambda n: moves.allowed(n, list(pending).count(n)),
            safe=lambda after: engine.orderable(after, records))
        if found is None:
            raise
        ledger, allocation, moved = found
    if ask.limited:
        limits.check(engine.config, state.records, ask.owner, name, ledger)
    if guard is not None and not ask.force:
        guard(len(state.ledger.shared) - len(ledger.shared), f"Allocate {name!r}")
    return State(ledger, records), allocation, moved


async def commit(engine: Engine, asks: Sequence[Ask], moves: MoveLog | None = None,
                 fresh: Callable[[str], None] = lambda name: None,
                 guard: Guard | None = None) -> list[Outcome]:
    """Under the lock: place ``asks`` in order, each on the ledger the ones before it leave,
    and commit those placed (and the moves that made room for them) as one change; the outcome
    of each (a placement error is that request's own). A failed commit is raised (and undone
    by the engine). ``fresh`` is told each new name just before the commit (whatever was known
    of an earlier allocation of that name no longer holds)."""
    state = engine.state
    outcomes: list[Outcome] = []
    notes: list[Note] = []
    pending: list[str] = []  # the allocations moved, once per move
    for ask in asks:
        try:
            state, allocation, made = await place(engine, state, ask, moves, pending, guard)
        except Exception as exc:  # that request's own (a bug too: the others go on)
            if not isinstance(exc, CPUServiceError):
                log.exception("placing allocation %s", ask.name)
            outcomes.append((ask, exc))
            continue
        outcomes.append((ask, allocation))
        extra = {} if ask.caller is None else {"caller_uid": str(ask.caller)}
        notes.append(Note(Kind.ALLOCATED, ask.name, extra=extra))
        notes.extend(moving.notes(made, f"to make room for {ask.name}"))
        pending.extend(move.name for move in made)
    names = frozenset(a.name for a, outcome in outcomes if isinstance(outcome, Allocation))
    if names:
        for name in names:
            fresh(name)
        await engine.apply(Change(state, names | set(pending),
                                  dict.fromkeys(pending, publish.MOVED), notes=tuple(notes)))
        if moves is not None:
            moves.record(pending)
        engine.counters.moved("repack", len(pending))
    return outcomes


class Admission:
    """The queue, and the one task that drains it a group at a time. ``follow`` runs for each
    committed allocation before its caller is answered, ``fresh`` for each new name just
    before its commit (the service's bookkeeping)."""

    def __init__(self, engine: Engine,
                 follow: Callable[[str, Allocation], Awaitable[None]],
                 limit: int = GROUP_MAX,
                 fresh: Callable[[str], None] = lambda name: None) -> None:
        self.engine = engine
        self.follow = follow
        self.fresh = fresh
        self.moves = MoveLog(engine.config.max_moves_per_allocation_per_hour)
        self.limit = limit
        self.waiting: list[Ask] = []
        self._drain: asyncio.Task[None] | None = None
        self.groups = 0  # groups committed since the start
        self.order: list[Ask] | None = None  # tests: the asks in the order they were placed
        self.guard: Guard | None = None  # the admission guard (the service's HostPressure)

    async def submit(self, ask: Ask) -> Allocation:
        """Queue ``ask`` and wait for its answer (its allocation, or its error raised)."""
        self.waiting.append(ask)
        if self._drain is None or self._drain.done():
            # its own, empty context: the drain serves every caller, it must not carry the
            # context (the caller's uid for the audit trail) of the one that happened to start it
            self._drain = asyncio.get_running_loop().create_task(
                self._run(len(self.waiting)), context=contextvars.Context())
        return await ask.future

    async def _run(self, seen: int) -> None:
        while self.waiting:
            group: list[Ask] = []
            try:
                await self._gather(seen)
                group = take_group(self.waiting, self.limit)
                seen = len(self.waiting)
                if not group:
                    continue
                await self._admit(group)
            except asyncio.CancelledError:
                for ask in (*group, *self.waiting):
                    ask.future.cancel()
                self.waiting.clear()
                raise
            except BaseException as exc:  # a bug, or the process dying (kill -9 in the tests)
                stop = not isinstance(exc, Exception)
                for ask in (*group, *(self.waiting if stop else ())):
                    if not ask.future.done():
                        ask.future.set_exception(exc)
                if stop:
                    self.waiting.clear()
                    return

    async def _gather(self, seen: int) -> None:
        """Let the requests that come together join the queue before a group is taken: the
        bus is read a buffer at a time and each call's handler reaches the queue in a turn of
        the loop of its own, so a burst arrives over several turns (32 at once made groups of
        26 and 6, the second waiting for the first's jobs). While the queue grew since it held
        ``seen`` requests and holds less than a group, one more turn, GATHER_TURNS at most; a
        lone request waits none."""
        for _ in range(GATHER_TURNS):
            if len(self.waiting) == seen or len(self.waiting) >= self.limit:
                return
            seen = len(self.waiting)
            await asyncio.sleep(0)

    async def _admit(self, group: Sequence[Ask]) -> None:
        async with self.engine.lock:
            asks = [a for a in group if not a.future.done()]
            if self.order is not None:
                self.order.extend(asks)
            if len(asks) > 1:
                try:
                    outcomes = await commit(self.engine, asks, self.moves, self.fresh,
                                            self.guard)
                except CPUServiceError as exc:
                    log.warning("committing %d allocations together failed (%s); committing "
                                "them one at a time", len(asks), exc)
                else:
                    self.groups += 1
                    await self._answer(outcomes)
                    return
            for ask in asks:
                try:
                    outcomes = await commit(self.engine, [ask], self.moves, self.fresh,
                                            self.guard)
                except CPUServiceError as exc:
                    outcomes = [(ask, exc)]
                self.groups += 1
                await self._answer(outcomes)

    async def _answer(self, outcomes: Sequence[Outcome]) -> None:
        for ask, outcome in outcomes:
            try:
                if isinstance(outcome, Allocation):
                    await self.follow(ask.name, outcome)
            except Exception as exc:  # committed, but not followed: the caller is told
                outcome = exc
            if ask.future.done():
                continue
            if isinstance(outcome, Allocation):
                ask.future.set_result(outcome)
            else:
                ask.future.set_exception(outcome)
