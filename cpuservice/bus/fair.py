"""Fair turns for the reads any local user may make (issue 37): one read at a time, round robin
over the connections that wait, at most a fifth of the time while they queue.

dbus-fast reads every call buffered on the daemon's one bus connection in one go, so 128 calls
pipelined by each of a few connections used to run back to back while everything else (another
caller's Ping, a change's next step, the lending loop's sample) waited behind all of them. Here a
read waits for its turn instead:
- **one at a time**: whatever became ready meanwhile (a reply from systemd, a timer) runs before
  the next read, so it waits for one read at most, never for a caller's whole pipeline;
- **round robin**: each connection with reads waiting gets a turn in order, so a connection with
  128 reads queued delays another's single read by one read, not by 128;
- **a fifth of the time at most**: after a read that took t (its reply written to the bus
  included), the next starts 4t later (``share``);
- **a bounded stream of bytes**: after a reply of n bytes, the next read starts no sooner than
  n / ``rate`` later. Replies leave on the daemon's one connection to the bus, and the bus
  holds them until their callers read them: a megabyte reply every millisecond to callers who
  read slowly filled the bus's buffers, and then every other reply (a Ping's, an Allocate's)
  waited behind them for hundreds of milliseconds;
- **bounded**: a connection may have ``per_sender`` reads waiting, all of them together
  ``total`` beyond each connection's first; past that a read is refused at once (``Refused``:
  LimitExceeded to the caller). A connection's first read is never refused (the bus bounds the
  connections), so one busy user cannot lock others out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator

PER_SENDER = 128  # reads one connection may have waiting: as many calls as the system bus lets
# it have pending; a bus with a higher limit (a session bus: 50,000) meets this one
TOTAL = 4096  # reads waiting beyond each connection's first
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
    def __init__(self, per_sender: int = PER_SENDER, total: int = TOTAL,
                 share: float = SHARE, rate: float = RATE) -> None:
        self.per_sender = per_sender
        self.total = total
        self.rest = (1 - share) / share  # pause per second of read
        self.rate = rate
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._count: dict[str, int] = {}  # per connection: waiting, or holding the turn
        self._extra = 0  # waiting reads beyond each connection's first
        self._busy = False  # a read holds the turn, or the pause after one runs
        self.served = 0  # reads that had their turn (for tests and the benchmark)

    def pending(self, sender: str) -> int:
        return self._count.get(sender, 0)

    @contextlib.asynccontextmanager
    async def turn(self, sender: str) -> AsyncIterator[Turn]:
        """Wait for ``sender``'s turn, hold it for the body; Refused past the bounds."""
        held = self._count.get(sender, 0)
        if held >= self.per_sender:
            raise Refused(f"this connection has {held} reads waiting (at most "
                          f"{self.per_sender}); wait for their replies")
        extra = held > 0
        if extra and self._extra >= self.total:
            raise Refused(f"{self._extra} reads are waiting (at most {self.total}); "
                          "try again shortly")
        self._count[sender] = held + 1
        self._extra += extra
        try:
            if self._busy:
                fut = asyncio.get_running_loop().create_future()
                self._waiting.setdefault(sender, deque()).append(fut)
                try:
                    await fut
                except asyncio.CancelledError:
                    if fut.done() and not fut.cancelled():
                        self._next()  # it was given the turn: pass it on
                    raise
            else:
                self._busy = True
            start, account = time.monotonic(), Turn()
            try:
                yield account
            finally:
                self.served += 1
                self._finished(max((time.monotonic() - start) * self.rest,
                                   account.sent / self.rate))
        finally:
            self._extra -= extra
            left = self._count[sender] - 1
            if left:
                self._count[sender] = left
            else:
                del self._count[sender]

    def _finished(self, pause: float) -> None:
        if pause > 0.0002 and self._waiting:
            asyncio.get_running_loop().call_later(pause, self._next)
        else:
            self._next()

    def _next(self) -> None:
        """Give the turn to the next connection in the round, or free it."""
        while self._waiting:
            sender, queue = next(iter(self._waiting.items()))
            fut = queue.popleft()
            if queue:
                self._waiting.move_to_end(sender)
            else:
                del self._waiting[sender]
            if not fut.cancelled():
                fut.set_result(None)  # it runs after whatever is ready now
                return
        self._busy = False
