"""systemd's service notifications (``sd_notify``): READY=1 once the service answers, a STATUS=
line that follows the pools (``systemctl status cpuservice`` shows it), STOPPING=1, and the
watchdog's WATCHDOG=1.

The protocol is a datagram of ``KEY=value`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a path, or an abstract name written with a leading ``@``). It is a few lines,
so it is written here rather than taken from python3-systemd, which is not among the package's
dependencies; without ``$NOTIFY_SOCKET`` (started by hand, in tests) nothing is sent.

The unit is Type=notify: READY=1 is sent after the bus name is owned and the first reconcile
(startup recovery) is done, which Type=dbus could not express (it is ready when the name
appears, and the name is requested only after recovery, but a failure after that would go
unseen). The watchdog is on when systemd sets ``$WATCHDOG_USEC`` (WatchdogSec= in the unit) for
this process: the event loop pings at half the interval, so a loop that is stuck is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from cpuservice.model.pools import Ledger

log = logging.getLogger(__name__)


def status_text(ledger: Ledger) -> str:
    """The one-line STATUS: "12 allocations, 40 bound CPUs, shared 2-3,66-67" (pure)."""
    count = len(ledger.allocations)
    bound = len(ledger.held)
    text = (f"{count} allocation{'' if count == 1 else 's'}, {bound} bound "
            f"CPU{'' if bound == 1 else 's'}, shared {ledger.shared.format() or '-'}")
    degraded = sum(1 for a in ledger.bound.values() if a.degraded)  # only bound ones can be
    return f"{text}, {degraded} degraded" if degraded else text


def socket_address(value: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` as an address for sendto (an abstract name starts with a NUL)."""
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between pings (half of ``$WATCHDOG_USEC``), or None when there is no watchdog
    for this process (``$WATCHDOG_PID``, when set, must be ours)."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2 / 1_000_000


class Notifier:
    """Sends notifications to systemd; does nothing without ``$NOTIFY_SOCKET``."""

    def __init__(self, address: str | None = None) -> None:
        value = os.environ.get("NOTIFY_SOCKET", "") if address is None else address
        self.address = socket_address(value)
        self._status = ""
        self._watchdog: asyncio.Task[None] | None = None
        # one socket for every notification (each change sends its STATUS=): a socket made,
        # set non-blocking and closed per message cost more than the message; made anew after
        # a failure
        self._sock: socket.socket | None = None

    def send(self, **fields: str) -> bool:
        """One notification (``ready="1"`` -> READY=1); False when it could not be sent."""
        if self.address is None:
            return False
        data = "".join(f"{key.upper()}={value}\n" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)  # never stall the event loop (the watchdog pings)
            self._sock.sendto(data, self.address)
        except OSError as exc:
            log.warning("cannot notify systemd (%s)", exc)
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            return False
        return True

    def ready(self, status: str) -> None:
        self._status = status
        self.send(ready="1", status=status)

    def status(self, text: str) -> None:
        """STATUS=, when it changed."""
        if text != self._status:
            self._status = text
            self.send(status=text)

    def stopping(self) -> None:
        self.send(stopping="1", status="stopping")

    def start_watchdog(self, interval: float | None = None) -> None:
        """Ping from the event loop every ``interval`` s (default: from ``$WATCHDOG_USEC``)."""
        interval = watchdog_interval() if interval is None else interval
        if interval is None or self.address is None:
            return
        log.info("watchdog: pinging systemd every %.1f s", interval)
        self._watchdog = asyncio.get_running_loop().create_task(self._ping(interval))

    async def _ping(self, interval: float) -> None:
        while True:
            self.send(watchdog="1")
            await asyncio.sleep(interval)

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
