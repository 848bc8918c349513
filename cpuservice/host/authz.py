"""Authorization: polkit's CheckAuthorization for the calling bus name, and who owns a process.

Actions (dbus/org.cpuservice1.policy): ``org.cpuservice1.allocate`` for work on one's own
allocations, ``org.cpuservice1.manage`` for anyone's, for the ``cpuset`` and ``unit`` options and
for Revalidate. Reads need nothing; uid 0 needs nothing.
"""

from __future__ import annotations

import asyncio
import os
import select
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from dbus_fast import Variant
from dbus_fast.aio import MessageBus

from cpuservice.host import dbuscall
from cpuservice.model.errors import AccessDenied, InteractiveAuthorizationRequired

ALLOCATE = "org.cpuservice1.allocate"
MANAGE = "org.cpuservice1.manage"
INTERACTIVE_TIMEOUT = 120.0  # a person typing a password
QUICK_TIMEOUT = 10.0


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


MAX_ATTACH_PIDS = 256
MAX_OPEN_PIDFDS = 512  # pidfds of all Attach calls in flight together (RLIMIT_NOFILE is 1024)
PID_MAX_LIMIT = 2**22  # the kernel's PID_MAX_LIMIT: no PID is ever above it


class BusyError(Exception):
    """Too many Attach calls hold descriptors right now."""


def process_uid(pid: int) -> int:
    """The real uid of a live process; LookupError when there is none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    raise LookupError(f"no process {pid}")


def systemd_cgroup(text: str) -> str:
    """The path of a process's cgroup in systemd's hierarchy, from /proc/PID/cgroup (the
    name=systemd line where cgroups are hybrid, the unified 0:: line otherwise)."""
    unified = ""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "name=systemd":
            return path
        if controllers == "":
            unified = path
    return unified


def movable_from(cgroup: str, uid: int, own_units: set[str]) -> bool:
    """Whether a user may move a process out of ``cgroup`` without manage: it runs in the user's
    own sessions or user manager (``user.slice/user-UID.slice/...``) or in a unit of one of the
    user's allocations. A system service's process (its sandbox) needs manage."""
    parts = [p for p in cgroup.split("/") if p]
    if parts[:2] == ["user.slice", f"user-{uid}.slice"] and len(parts) > 2:
        return True
    return any(p in own_units for p in parts)


def may_move(pid: int, uid: int, own_units: set[str]) -> bool:
    """Whether ``uid`` may move process ``pid`` without manage: its own process, in a unit it
    may manage (see movable_from). LookupError when there is no such process."""
    if process_uid(pid) != uid:
        return False
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise LookupError(f"no process {pid}") from None
    return movable_from(systemd_cgroup(text), uid, own_units)


class PidHandles:
    """pidfds of processes checked before a move: if one dies before the move is done its PID
    may have been reused, and the move is reported as unsafe. Each PID is opened once (a PID
    named twice is moved once) and every descriptor is closed by close().

    Whatever a caller sends, descriptors stay bounded: every PID is checked (1 to PID_MAX_LIMIT)
    before anything is opened, anything that goes wrong while opening closes what was opened, and
    all the Attach calls in flight hold at most MAX_OPEN_PIDFDS descriptors together (LookupError
    for a bad PID, BusyError beyond the budget)."""

    _open = 0  # descriptors held by every PidHandles alive

    def __init__(self, pids: list[int]) -> None:
        self.fds: dict[int, int] = {}
        unique = list(dict.fromkeys(pids))
        if len(unique) > MAX_ATTACH_PIDS:
            raise LookupError(f"{len(unique)} PIDs: at most {MAX_ATTACH_PIDS} per call")
        for pid in unique:
            if type(pid) is not int or not 0 < pid <= PID_MAX_LIMIT:
                raise LookupError(f"no process {pid}")
        if PidHandles._open + len(unique) > MAX_OPEN_PIDFDS:
            raise BusyError(f"too many processes are being attached at once (at most "
                            f"{MAX_OPEN_PIDFDS}); try again when the other calls have ended")
        try:
            for pid in unique:
                try:
                    fd = os.pidfd_open(pid)
                except (OSError, OverflowError, ValueError):
                    raise LookupError(f"no process {pid}") from None
                self.fds[pid] = fd
                PidHandles._open += 1
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return list(self.fds)

    def all_alive(self) -> bool:
        poller = select.poll()
        for fd in self.fds.values():
            poller.register(fd, select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
            PidHandles._open -= 1
        self.fds.clear()


class RateLimit:
    """At most ``per_minute`` changes (Allocate, Resize, Release, Attach, and what lending
    commits for the user's allocations) per user in any 60 seconds; 0: no limit. Each change
    of an unprivileged user may rewrite every interrupt's affinity (isolate_irqs) and the
    shared pool's slices: a loop must not churn the host. take() raises BusyError, saying
    when the next change is possible; add() counts a change that happens anyway."""

    WINDOW = 60.0

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._times: dict[int, deque[float]] = {}

    def _recent(self, uid: int) -> deque[float]:
        now = self.clock()
        times = self._times.setdefault(uid, deque())
        while times and now - times[0] >= self.WINDOW:
            times.popleft()
        return times

    def take(self, uid: int, ceiling: int | None = None) -> None:
        """One more change by ``uid``; BusyError once it made ``ceiling`` (default:
        per_minute) in the last minute."""
        if not self.per_minute:
            return
        times = self._recent(uid)
        limit = self.per_minute if ceiling is None else min(ceiling, self.per_minute)
        if len(times) >= limit:
            wait = self.WINDOW - (self.clock() - times[0])
            raise BusyError(f"user {uid} made {len(times)} changes in the last minute; the "
                            f"limit is max_changes_per_user_per_minute={self.per_minute}"
                            f"{'' if limit == self.per_minute else f' ({limit} for this)'}; "
                            f"try again in {wait:.0f} s")
        times.append(self.clock())

    def add(self, uid: int) -> None:
        """A change by ``uid`` that is never refused (a withdrawal of lent cores), counted."""
        if self.per_minute:
            self._recent(uid).append(self.clock())

    def count(self, uid: int) -> int:
        """The changes ``uid`` made in the last minute."""
        return len(self._recent(uid)) if uid in self._times else 0
