"""Thin adapter over systemd's D-Bus API (org.freedesktop.systemd1), on a dbus-fast bus.

Only what cpuservice needs: transient slices and scopes, runtime property changes, stopping
units, listing them, and the signals that tell when jobs finish and units go away.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from cpuservice.apply import units
from cpuservice.host import dbuscall
from cpuservice.model.errors import SystemdFailure
from cpuservice.model.props import Props

DEST = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
PROPERTIES = "org.freedesktop.DBus.Properties"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
UNIT_MASKED = "org.freedesktop.systemd1.UnitMasked"
_FINISHED_KEEP = 4096

log = logging.getLogger(__name__)



def as_dbus(props: Props) -> list[list[Any]]:
    return [[name, Variant(sig, value)] for name, (sig, value) in props.items()]


# How long a job (start, stop) is waited for: longer than systemd's DefaultTimeoutStopSec (90 s
# unless configured), after which systemd kills what ignored SIGTERM, so that stopping a slice
# whose process ignores SIGTERM (a container's PID 1 does) ends as a stop, not as our timeout
# (seen in the lab). setup() reads the manager's own value: that plus JOB_MARGIN, at least
# JOB_SECONDS, at most JOB_SECONDS_MAX (a configured infinity must not hold a caller forever).
JOB_SECONDS = 120
JOB_MARGIN = 30
JOB_SECONDS_MAX = 900


def job_wait(default_stop_usec: int) -> float:
    """The job wait for a manager whose DefaultTimeoutStopUSec is ``default_stop_usec``."""
    return float(min(max(JOB_SECONDS, default_stop_usec / 1e6 + JOB_MARGIN), JOB_SECONDS_MAX))


class Systemd:
    """Calls into systemd and follows its signals; one instance per bus connection."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self.on_unit_removed: Callable[[str], None] = lambda unit: None
        self.on_unit_new: Callable[[str], None] = lambda unit: None
        self.on_unit_state: Callable[[str, str], None] = lambda path, state: None
        # a daemon-reload finished: drop-ins were read again, and a persistent one of an
        # administrator may now mask a runtime property cpuservice set (see daemon.serve)
        self.on_reloaded: Callable[[], None] = lambda: None
        self.owner = dbuscall.NameOwner(bus, DEST)
        self.job_seconds: float = JOB_SECONDS

    async def setup(self) -> None:
        """Subscribe to systemd's signals (before any job is started). Only signals from the
        connection that owns org.freedesktop.systemd1 count (forged ones are dropped)."""
        await self.owner.follow()
        self.bus.add_message_handler(self._on_message)
        for member in ("JobRemoved", "UnitRemoved", "UnitNew", "Reloading"):
            await self._bus_call("AddMatch", f"type='signal',sender='{DEST}',path='{PATH}',"
                                 f"interface='{MANAGER}',member='{member}'")
        await self.call("Subscribe")
        try:
            (value,) = await self.call("Get", "ss", [MANAGER, "DefaultTimeoutStopUSec"],
                                       interface=PROPERTIES)
            self.job_seconds = job_wait(int(value.value))
        except (SystemdFailure, TypeError, ValueError, AttributeError):
            pass  # an older or partial manager: the default wait

    async def watch_unit(self, unit_path: str) -> None:
        """Deliver ActiveState changes of one unit to on_unit_state."""
        await self._bus_call("AddMatch", self._watch_rule(unit_path))

    async def unwatch_unit(self, unit_path: str) -> None:
        await self._bus_call("RemoveMatch", self._watch_rule(unit_path))

    @staticmethod
    def _watch_rule(unit_path: str) -> str:
        return (f"type='signal',sender='{DEST}',path='{unit_path}',interface='{PROPERTIES}',"
                "member='PropertiesChanged'")

    async def _bus_call(self, member: str, rule: str) -> None:
        try:
            await dbuscall.call(self.bus, *dbuscall.BUS, member, "s", [rule])
        except dbuscall.CallError as exc:
            raise SystemdFailure(f"{member} failed: {exc.text}") from None

    def _on_message(self, msg: Message) -> bool:
        if msg.message_type != MessageType.SIGNAL or not self.owner.sent(msg):
            return False
        if msg.interface == MANAGER:
            if msg.member == "JobRemoved":
                _, job, _unit, result = msg.body
                future = self._waiting.pop(job, None)
                if future is not None and not future.done():
                    future.set_result(result)
                else:
                    self._finished[job] = result
                    while len(self._finished) > _FINISHED_KEEP:
                        self._finished.popitem(last=False)
            elif msg.member == "UnitRemoved":
                self.on_unit_removed(msg.body[0])
            elif msg.member == "UnitNew":
                self.on_unit_new(msg.body[0])
            elif msg.member == "Reloading" and msg.body and not msg.body[0]:
                self.on_reloaded()
        elif msg.interface == PROPERTIES and msg.member == "PropertiesChanged" and msg.path:
            changed = msg.body[1]
            if "ActiveState" in changed:
                self.on_unit_state(msg.path, changed["ActiveState"].value)
        return False

    async def call(
        self, member: str, signature: str = "", body: Sequence[Any] = (), path: str = PATH,
        interface: str = MANAGER,
    ) -> list[Any]:
        try:
            return await dbuscall.call(self.bus, DEST, path, interface, member, signature, body)
        except dbuscall.CallError as exc:
            raise SystemdFailure(f"systemd refused {member}: {exc.name}: {exc.text}") from None

    async def _run_job(self, member: str, signature: str, body: Sequence[Any]) -> None:
        (job,) = await self.call(member, signature, body)
        result = self._finished.pop(job, None)
        if result is None:
            future = asyncio.get_running_loop().create_future()
            self._waiting[job] = future
            try:
                # (not wait_for: its waiter costs the job's end one more turn of the loop)
                async with asyncio.timeout(self.job_seconds):
                    result = await future
            except TimeoutError:
                raise SystemdFailure(
                    f"systemd job {member} {body[0]} did not finish within "
                    f"{self.job_seconds:g} s "
                    f"(systemctl list-jobs shows it; it goes on in systemd)") from None
            finally:
                self._waiting.pop(job, None)
        if result != "done":
            raise SystemdFailure(f"systemd job {member} {body[0]} ended with result {result!r}")

    async def start_transient(self, unit: str, props: Props) -> None:
        """StartTransientUnit and wait until its job is done."""
        await self._run_job("StartTransientUnit", "ssa(sv)a(sa(sv))",
                            [unit, "fail", as_dbus(props), []])

    async def set_properties(self, unit: str, props: Props, missing_ok: bool = False) -> None:
        """SetUnitProperties at runtime (lost at reboot; the daemon re-applies them).
        ``missing_ok``: a unit that is not loaded or is masked is no error (a restore)."""
        if not props:
            return
        try:
            await self.call("SetUnitProperties", "sba(sv)", [unit, True, as_dbus(props)])
        except SystemdFailure as exc:
            if not (missing_ok and (NO_SUCH_UNIT in str(exc) or UNIT_MASKED in str(exc))):
                raise

    async def stop(self, unit: str) -> None:
        """StopUnit and wait; a unit that is already gone is fine."""
        try:
            await self._run_job("StopUnit", "ss", [unit, "fail"])
        except SystemdFailure as exc:
            if NO_SUCH_UNIT not in str(exc):
                raise

    async def remove_overrides(self, unit: str, names: Sequence[str]) -> None:
        """Remove the runtime drop-ins that setting ``names`` on ``unit`` wrote (after their
        values were set back): the unit's own configuration then rules again, at the next
        daemon-reload too. A drop-in that cannot be removed is logged, not an error."""
        for path in units.dropin_paths(unit, names):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc.strerror)

    async def unit_path(self, unit: str) -> str | None:
        try:
            (path,) = await self.call("GetUnit", "s", [unit])
        except SystemdFailure as exc:
            if NO_SUCH_UNIT in str(exc):
                return None
            raise
        return str(path)

    async def manager_version(self) -> str:
        """systemd's Version property ("262.1-1")."""
        (value,) = await self.call("Get", "ss", [MANAGER, "Version"], interface=PROPERTIES)
        return str(value.value)

    async def load_state(self, unit: str) -> str:
        """LoadState after asking systemd to load the unit: "loaded", "not-found", "masked",
        "bad-setting", "error" (a stopped unit that systemd unloaded is still "loaded")."""
        (path,) = await self.call("LoadUnit", "s", [unit])
        (value,) = await self.call("Get", "ss", ["org.freedesktop.systemd1.Unit", "LoadState"],
                                   path=str(path), interface=PROPERTIES)
        return str(value.value)

    async def get(self, unit: str, interface: str, names: Iterable[str]) -> dict[str, Any]:
        """Some properties of a loaded unit ({} when it is not loaded)."""
        path = await self.unit_path(unit)
        if path is None:
            return {}
        (values,) = await self.call("GetAll", "s", [interface], path=path, interface=PROPERTIES)
        wanted = set(names)
        return {k: v.value for k, v in values.items() if k in wanted}

    async def list_units(self, patterns: Sequence[str]) -> list[tuple[str, str]]:
        """(name, active state) of loaded units matching the glob patterns."""
        (rows,) = await self.call("ListUnitsByPatterns", "asas", [[], list(patterns)])
        return [(row[0], row[3]) for row in rows]

    async def processes(self, unit: str) -> list[int]:
        """PIDs in a unit's cgroup and below."""
        try:
            (rows,) = await self.call("GetUnitProcesses", "s", [unit])
        except SystemdFailure as exc:
            if NO_SUCH_UNIT in str(exc):
                return []
            raise
        return [int(row[1]) for row in rows]

    async def member_units(self, unit: str) -> set[str]:
        """The units right below ``unit`` (a slice) that hold its processes, from the control
        group paths GetUnitProcesses reports."""
        try:
            (rows,) = await self.call("GetUnitProcesses", "s", [unit])
        except SystemdFailure as exc:
            if NO_SUCH_UNIT in str(exc):
                return set()
            raise
        out = set()
        for row in rows:
            parts = str(row[0]).split("/")
            if unit in parts and parts.index(unit) + 1 < len(parts):
                out.add(parts[parts.index(unit) + 1])
        return out
