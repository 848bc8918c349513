"""Authorization: polkit's CheckAuthorization for the calling bus name, and who owns a process.

Actions (dbus/org.cpuservice1.policy): ``org.cpuservice1.allocate`` for work on one's own
allocations, ``org.cpuservice1.manage`` for anyone's, for the ``cpuset`` and ``unit`` options and
for Revalidate. Reads need nothing; uid 0 needs nothing.
"""

from __future__ import annotations

import asyncio
import os
import select
from pathlib import Path

from dbus_fast import Variant
from dbus_fast.aio import MessageBus

from . import dbuscall
from .errors import CPUServiceError

ALLOCATE = "org.cpuservice1.allocate"
MANAGE = "org.cpuservice1.manage"
INTERACTIVE_TIMEOUT = 120.0  # a person typing a password
QUICK_TIMEOUT = 10.0


class AccessDenied(CPUServiceError):
    dbus_name = "org.freedesktop.DBus.Error.AccessDenied"


class InteractiveAuthorizationRequired(CPUServiceError):
    dbus_name = "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"


class Authority:
    """Asks polkitd over the service's own bus connection."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    async def check(self, sender: str, uid: int, action: str, interactive: bool) -> None:
        """Return when ``sender`` may perform ``action``; raise AccessDenied (or
        InteractiveAuthorizationRequired when authenticating would have helped) otherwise."""
        if uid == 0:
            return
        subject = ["system-bus-name", {"name": Variant("s", sender)}]
        asking = dbuscall.call(
            self.bus, "org.freedesktop.PolicyKit1", "/org/freedesktop/PolicyKit1/Authority",
            "org.freedesktop.PolicyKit1.Authority", "CheckAuthorization", "(sa{sv})sa{ss}us",
            [subject, action, {}, 1 if interactive else 0, ""])
        try:
            (result,) = await asyncio.wait_for(
                asking, INTERACTIVE_TIMEOUT if interactive else QUICK_TIMEOUT)
        except TimeoutError:
            raise AccessDenied(f"no answer from polkit about {action} in time") from None
        except dbuscall.CallError as exc:
            raise AccessDenied(f"polkit could not decide on {action}: {exc.text}") from None
        authorized, challenge, _ = result
        if authorized:
            return
        if challenge and not interactive:
            raise InteractiveAuthorizationRequired(
                f"{action} needs authentication; call again allowing interactive authorization"
            )
        raise AccessDenied(f"not authorized for {action}")


def process_uid(pid: int) -> int:
    """The real uid of a live process; LookupError when there is none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    raise LookupError(f"no process {pid}")


class PidHandles:
    """pidfds of processes checked before a move: if one dies before the move is done its PID
    may have been reused, and the move is reported as unsafe."""

    def __init__(self, pids: list[int]) -> None:
        self.fds: dict[int, int] = {}
        for pid in pids:
            try:
                if pid <= 0:
                    raise ProcessLookupError
                self.fds[pid] = os.pidfd_open(pid)
            except OSError:
                self.close()
                raise LookupError(f"no process {pid}") from None

    def all_alive(self) -> bool:
        poller = select.poll()
        for fd in self.fds.values():
            poller.register(fd, select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
