"""Fair turns for the reads any local user may make (issue 37): one read at a time, round robin
over the users that wait, at most a fifth of the time while they queue.

dbus-fast reads every call buffered on the daemon's one bus connection in one go, so 128 calls
pipelined by each of a few connections used to run back to back while everything else (another
caller's Ping, a change's next step, the lending loop's sample) waited behind all of them. Here a
read waits for its turn instead:
- **one at a time**: whatever became ready meanwhile (a reply from systemd, a timer) runs before
  the next read, so it waits for one read at most, never for a caller's whole pipeline;
- **round robin by user**: each caller (a uid; the bus.reads module names them) with reads
  waiting gets a turn in order, so a user with 128 reads queued on each of 256 connections (what
  the system bus allows one user) delays another user's single read by one read, not by 32,768;
- **a fifth of the time at most**: after a read that took t (its reply written to the bus
  included), the same caller's next read starts 4t later (``share``) if reads are waiting;
  other callers' reads go on meanwhile;
- **a bounded stream of bytes**: after a reply of n bytes, the caller's next read starts no
  sooner than n / ``rate`` later. Replies leave on the daemon's one connection to the bus, and
  the bus holds them until their callers read them: a megabyte reply every millisecond to
  callers who read slowly filled the bus's buffers, and then every other reply (a Ping's, an
  Allocate's) waited behind them for hundreds of milliseconds;
- **bounded**: a caller may have ``per_caller`` reads waiting, all of them together ``total``
  beyond each caller's first; past that a read is refused at once (``Refused``: LimitExceeded to
  the caller, whoever it is). A caller's first read is never refused, so one busy user cannot
  lock others out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator

PER_CALLER = 1024  # reads one user may have waiting (the system bus lets a user have 256
# connections with 128 calls pending each: a client that pipelines on 8 connections fits)
TOTAL = 4096  # reads waiting beyond each caller's first
SHARE = 0.2  # of the time that reads (their replies written to the bus included) may take
# while they queue: a reply of a megabyte holds the bus connection for milliseconds, and every
# other message (an Allocate's calls to systemd, its reply) waits behind it meanwhile
RATE = 16 << 20  # bytes per second that replies to reads may send while they queue


class Refused(Exception):
    """Too many reads are waiting; the text names the bound."""


class Turn:
    """The body's account of its read: ``sent``, the bytes of its reply."""

    sent = 0


class Turns:
    def __init__(self, per_caller: int = PER_CALLER, total: int = TOTAL,
                 share: float = SHARE, rate: float = RATE) -> None:
        self.per_caller = per_caller
        self.total = total
        self.rest = (1 - share) / share  # pause per second of read
        self.rate = rate
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._count: dict[str, int] = {}  # per caller: waiting, or holding the turn
        self._extra = 0  # waiting reads beyond each caller's first
        self._busy = False  # a read holds the turn
        self._resting: dict[str, float] = {}  # caller -> when its pause after a read ends
        self._timer: asyncio.TimerHandle | None = None  # for the first pause to end
        self.served = 0  # reads that had their turn (for tests and the benchmark)

    def pending(self, caller: str) -> int:
        return self._count.get(caller, 0)

    @contextlib.asynccontextmanager
    async def turn(self, caller: str) -> AsyncIterator[Turn]:
        """Wait for ``caller``'s turn, hold it for the body; Refused past the bounds."""
        held = self._count.get(caller, 0)
        if held >= self.per_caller:
            raise Refused(f"{held} reads of this caller are waiting (at most "
                          f"{self.per_caller}); wait for their replies")
        extra = held > 0
        if extra and self._extra >= self.total:
            raise Refused(f"{self._extra} reads are waiting (at most {self.total}); "
                          "try again shortly")
        self._count[caller] = held + 1
        self._extra += extra
        try:
            fut = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(caller, deque()).append(fut)
            if not self._busy:
                self._next()
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._busy = False  # it was given the turn: pass it on
                    self._next()
                raise
            start, account = time.monotonic(), Turn()
            try:
                yield account
            finally:
                self.served += 1
                pause = max((time.monotonic() - start) * self.rest, account.sent / self.rate)
                if pause > 0.0002 and self._waiting:  # (one read after another: no pause)
                    self._resting[caller] = time.monotonic() + pause
                self._busy = False
                self._next()
        finally:
            self._extra -= extra
            left = self._count[caller] - 1
            if left:
                self._count[caller] = left
            else:
                del self._count[caller]

    def _next(self) -> None:
        """Give the turn to the next caller in the round that is not resting after its last
        read; when all that wait rest, wake up when the first pause ends."""
        if self._busy:
            return
        now = time.monotonic()
        for caller, until in list(self._resting.items()):
            if until <= now:
                del self._resting[caller]
        for caller, queue in list(self._waiting.items()):
            if caller in self._resting:
                continue
            while queue and queue[0].cancelled():
                queue.popleft()
            if not queue:
                del self._waiting[caller]
                continue
            fut = queue.popleft()
            if queue:
                self._waiting.move_to_end(caller)
            else:
                del self._waiting[caller]
            self._busy = True
            fut.set_result(None)  # it runs after whatever is ready now
            return
        if self._waiting and self._timer is None:
            wake = min(self._resting[c] for c in self._waiting)
            self._timer = asyncio.get_running_loop().call_later(wake - now, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._next()
