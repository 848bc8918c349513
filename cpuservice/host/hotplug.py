"""CPU hotplug: kernel uevents for subsystem ``cpu`` (pyudev, kernel source, so it works with and
without udevd), debounced in the asyncio loop. Events are only hints: once a burst settles, the
service re-reads the topology and repairs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pyudev

log = logging.getLogger(__name__)
ACTIONS = frozenset({"offline", "online", "add", "remove"})
SETTLE_SECONDS = 0.05


async def _nothing() -> None:
    pass


class Debouncer:
    """Calls ``settled`` once after a burst of notify() calls has been quiet for ``delay``; when
    it fails, calls it again after ``retry`` seconds, doubling up to ``retry_max``, until it
    succeeds (a repair that systemd refused must not stay undone)."""

    def __init__(self, settled: Callable[[], Awaitable[None]] = _nothing,
                 delay: float = SETTLE_SECONDS, retry: float = 0.5, retry_max: float = 30.0):
        self.settled = settled
        self.delay = delay
        self.retry = retry
        self.retry_max = retry_max
        self._timer: asyncio.TimerHandle | None = None
        self._running: asyncio.Task[None] | None = None
        self._again = False

    def notify(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._running is not None and not self._running.done():
            self._again = True  # a burst landed while repairing: repair once more afterwards
            return
        self._running = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        failures = 0
        while True:
            self._again = False
            try:
                await self.settled()
            except Exception as exc:
                wait = min(self.retry_max, self.retry * 2**failures)
                failures += 1
                log.error("repair (after CPU hotplug or a daemon-reload) failed (%s); trying "
                          "again in %.1f s", exc, wait)
                await asyncio.sleep(wait)
                continue
            if not self._again:
                return


class CPUMonitor:
    """Kernel uevents of subsystem cpu, read in the loop with add_reader."""

    def __init__(self, debouncer: Debouncer) -> None:
        self.debouncer = debouncer
        self.monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        self.monitor.filter_by("cpu")
        self.monitor.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.monitor.fileno(), self._drain)

    def detach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.monitor.fileno())

    def _drain(self) -> None:
        while (device := self.monitor.poll(timeout=0)) is not None:
            if device.action in ACTIONS and device.subsystem == "cpu":
                log.info("uevent %s %s", device.action, device.sys_name)
                self.debouncer.notify()
