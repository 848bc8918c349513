"""Moving movable allocations (issue 27), the shell's part: how often each may still be moved
(``max_moves_per_allocation_per_hour``), and what a committed move records. The choice of moves
is the placement engine's (placement.repack, placement.defrag)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from cpuservice.apply.change import Note
from cpuservice.host.journal import Kind
from cpuservice.placement.moves import Move

HOUR = 3600.0


class MoveLog:
    """When each allocation was moved in the last hour (in memory: a restart forgets it, and
    allows each allocation its moves again)."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self._moves: dict[str, deque[float]] = {}

    def allowed(self, name: str, pending: int = 0) -> bool:
        """Whether ``name`` may be moved once more (``pending``: moves of it not yet
        committed)."""
        moves = self._moves.get(name)
        if moves is not None:
            now = self.clock()
            while moves and moves[0] <= now - HOUR:
                moves.popleft()
            if not moves:
                del self._moves[name]
                moves = None
        return (len(moves) if moves else 0) + pending < self.limit

    def record(self, names: Iterable[str]) -> None:
        now = self.clock()
        for name in names:
            self._moves.setdefault(name, deque()).append(now)

    def forget(self, name: str) -> None:
        self._moves.pop(name, None)


def notes(moves: Iterable[Move], why: str) -> tuple[Note, ...]:
    """The journal entries of committed moves."""
    return tuple(Note(Kind.MOVED, m.name, why, {"old": m.old.held.format(),
                                                 "new": m.new.held.format()}) for m in moves)
