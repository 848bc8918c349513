"""The kernel's PSI triggers (Documentation/accounting/psi.rst, "Monitoring for pressure
thresholds"): a trigger ``some STALL WINDOW`` written to a cgroup's ``cpu.pressure`` makes the
kernel signal POLLPRI on that open file when the cgroup's tasks waited more than STALL
microseconds within a WINDOW, at most once per window. Nothing runs in the daemon in between:
no timer, no reading.

The file is always readable (POLLIN): asyncio's selector, which waits for POLLIN, would run its
callback without end. So each trigger has an epoll instance of its own that waits for POLLPRI
only, edge-triggered, and the event loop waits on that instance, which is readable exactly when
the kernel signalled since it was last asked (nested epoll). The callback is told "event" (the
kernel signalled; it may already have consumed the flag while polling the nested instance, so
any wake-up counts) or "gone" (POLLERR: the cgroup was removed, the trigger is dead; it is
closed, and can be armed again).

Writing needs the file open for writing: the unit's ProtectControlGroups= leaves the hierarchy
read-only, so cpuservice.service makes the watched files writable (ReadWritePaths=). Where a
trigger cannot be made (cgroup v1 or hybrid, a kernel without PSI, a sandbox that forbids
it), ``arm`` raises OSError and the guard says it is unavailable."""

from __future__ import annotations

import asyncio
import errno
import os
import select
from collections.abc import Callable
from pathlib import Path

from cpuservice.model.figures import PRESSURE_FILE


class Trigger:
    """One armed trigger on ``path`` (a cgroup's cpu.pressure); ``on_event(kind)`` runs in the
    loop with "event" or "gone". ``close()`` disarms it (the kernel drops a trigger when its
    file is closed)."""

    def __init__(self, path: str | Path, spec: str,
                 on_event: Callable[[str], None],
                 opener: Callable[[str], int] | None = None) -> None:
        self.path = str(path)
        self.on_event = on_event
        self._loop: asyncio.AbstractEventLoop | None = None
        fd = (opener or _open)(self.path)
        try:
            data = spec.encode("ascii") + b"\0"  # the kernel reads up to the NUL
            if os.write(fd, data) != len(data):
                raise OSError(errno.EIO, f"short write of the trigger to {self.path}")
            poller = select.epoll(1)
        except BaseException:
            os.close(fd)
            raise
        try:
            poller.register(fd, select.EPOLLPRI | select.EPOLLET)
        except BaseException:
            poller.close()
            os.close(fd)
            raise
        self.fd, self.poller = fd, poller

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Be told of events through ``loop`` (the nested epoll's descriptor)."""
        self._loop = loop
        loop.add_reader(self.poller.fileno(), self._ready)

    def _ready(self) -> None:
        gone = any(mask & (select.EPOLLERR | select.EPOLLHUP)
                   for _, mask in self.poller.poll(0))
        if gone:
            self.close()  # (POLLERR stays set: closing stops the loop from calling again)
        self.on_event("gone" if gone else "event")

    @property
    def armed(self) -> bool:
        return self.fd >= 0

    def close(self) -> None:
        if self.fd < 0:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.poller.fileno())
        self.poller.close()
        os.close(self.fd)
        self.fd = -1


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)


def pressure_path(root: str | Path, control_group: str) -> Path:
    """The cpu.pressure file of ``control_group`` (a path below the hierarchy's ``root``)."""
    return Path(root) / control_group.lstrip("/") / PRESSURE_FILE
