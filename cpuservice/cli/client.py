"""A small asyncio client of org.cpuservice1, shared by cpuservicectl and cpuservice-run: the
calls, one-line errors that name the fix, and the polkit text agent on a terminal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from typing import Any

from dbus_fast import BusType, MessageFlag, Variant
from dbus_fast.aio import MessageBus

from cpuservice.host import dbuscall
from cpuservice.model import errors

DEST = "org.cpuservice1"
PATH = "/org/cpuservice1"
MANAGER = "org.cpuservice1.Manager"
ALLOCATION = "org.cpuservice1.Allocation"
PROPERTIES = "org.freedesktop.DBus.Properties"
OBJECT_MANAGER = "org.freedesktop.DBus.ObjectManager"
NO_QUOTA = 2**64 - 1
UNLIMITED = 2**32 - 1
SYSTEM_BUS = "/run/dbus/system_bus_socket"
# the unit the bus starts for DEST (SystemdService= in dbus/org.cpuservice1.service)
SERVICE_UNIT = "cpuservice.service"
SYSTEMD = ("org.freedesktop.systemd1", "/org/freedesktop/systemd1",
           "org.freedesktop.systemd1.Manager")
# how often a call that activates the service looks whether its unit failed meanwhile
ACTIVATION_POLL_SECONDS = 0.25

# exit codes, as cpuservicectl documents them
EXIT_FAILURE, EXIT_USAGE, EXIT_NO_SUCH, EXIT_NO_CPUS, EXIT_DENIED = 1, 2, 4, 5, 13
DENIED = (errors.AccessDenied.dbus_name, errors.InteractiveAuthorizationRequired.dbus_name)
EXIT_BY_ERROR = {
    errors.NoSuchAllocation.dbus_name: EXIT_NO_SUCH,
    errors.InsufficientCPUs.dbus_name: EXIT_NO_CPUS,
    DENIED[0]: EXIT_DENIED,
    DENIED[1]: EXIT_DENIED,
    errors.InvalidArgument.dbus_name: EXIT_USAGE,
}
# the bus's answers when nobody serves org.cpuservice1 (or activating it failed)
NOT_RUNNING = ("org.freedesktop.DBus.Error.ServiceUnknown",
               "org.freedesktop.DBus.Error.NameHasNoOwner",
               "org.freedesktop.DBus.Error.NoReply",
               "org.freedesktop.DBus.Error.TimedOut",
               "org.freedesktop.DBus.Error.Timeout",
               "org.freedesktop.DBus.Error.Spawn.")
EXAMPLE_RULE = "/usr/share/doc/cpuservice/examples/50-cpuservice-group.rules"


def exit_code(error: dbuscall.CallError) -> int:
    """The exit code the command-line tools give an error reply."""
    return EXIT_BY_ERROR.get(error.name, EXIT_FAILURE)


def explain(error: dbuscall.CallError, interactive: bool) -> str:
    """One line for a person: what went wrong and what to do about it."""
    if error.name.startswith(NOT_RUNNING) or error.name.startswith("org.freedesktop.systemd1."):
        return (f"cpuserviced is not running or not answering ({error.text.rstrip('.')}); "
                "see: systemctl status cpuservice")
    if error.name == DENIED[1] or (error.name == DENIED[0] and not interactive):
        return (f"{error.text}; run it as root, on a terminal without --no-ask-password to be "
                f"asked for a password, or see {EXAMPLE_RULE}")
    if error.name == DENIED[0]:
        return f"access denied: {error.text}; run it as root or see {EXAMPLE_RULE}"
    return error.text


def explain_connect(exc: BaseException, address: str | None) -> str:
    """One line for a bus that cannot be reached."""
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if address:
        return f"cannot reach the bus at {address}: {reason}"
    where = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or SYSTEM_BUS
    return (f"cannot reach the system bus ({where}): {reason}; is dbus running? "
            "see: systemctl status dbus")


def variants(options: Mapping[str, Any]) -> dict[str, Variant]:
    """Allocate options as D-Bus variants (bool -> b, everything else -> s)."""
    return {k: Variant("b", v) if isinstance(v, bool) else Variant("s", str(v))
            for k, v in options.items()}


def unwrap(value: Any) -> Any:
    if isinstance(value, Variant):
        return unwrap(value.value)
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [unwrap(v) for v in value]
    return value


class Client:
    def __init__(self, bus: MessageBus, interactive: bool = True) -> None:
        self.bus = bus
        self.interactive = interactive
        self.flags = MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if interactive else \
            MessageFlag.NONE
        self.owned = False  # DEST has an owner (so a call needs no activation)

    @classmethod
    async def connect(cls, address: str | None = None, interactive: bool = True) -> Client:
        bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
        return cls(bus, interactive)

    def close(self) -> None:
        self.bus.disconnect()

    async def call(
        self, member: str, signature: str = "", body: Sequence[Any] = (), path: str = PATH,
        interface: str = MANAGER, destination: str = DEST,
    ) -> list[Any]:
        reply = dbuscall.call(self.bus, destination, path, interface, member, signature, body,
                              self.flags)
        if destination != DEST or self.owned:
            return await reply
        return await self._activating(reply)

    async def _activating(self, reply: Coroutine[Any, Any, list[Any]]) -> list[Any]:
        """A call to the service while nobody owns its name: the bus starts the unit. If the
        unit fails before it takes the name, dbus-daemon never hears of it and answers only
        after its 25 s activation timeout (systemd issue 28877), so meanwhile the unit is
        watched: a new start of it that failed ends the call at once, with what systemd says."""
        (owned,) = await dbuscall.call(self.bus, *dbuscall.BUS, "NameHasOwner", "s", [DEST])
        if owned:
            self.owned = True
            return await reply
        before = await self._unit_state()
        task = asyncio.ensure_future(reply)
        try:
            while before is not None:
                done, _ = await asyncio.wait({task}, timeout=ACTIVATION_POLL_SECONDS)
                if done:
                    break
                now = await self._unit_state()
                if now is not None and now[0] != before[0] and now[1] in ("failed", "inactive"):
                    raise dbuscall.CallError(
                        "org.freedesktop.DBus.Error.Spawn.ChildExited",
                        f"{SERVICE_UNIT} {now[1]} as it started ({await self._result(now[2])})")
            result = await task
        finally:
            task.cancel()
        self.owned = True
        return result

    async def _unit_state(self) -> tuple[bytes, str, str] | None:
        """The unit's InvocationID (new at each start), ActiveState and object path; None when
        systemd does not know it or cannot say (no systemd on this bus)."""
        try:
            (path,) = await dbuscall.call(self.bus, *SYSTEMD, "LoadUnit", "s", [SERVICE_UNIT])
            (values,) = await dbuscall.call(self.bus, SYSTEMD[0], path, PROPERTIES, "GetAll",
                                            "s", ["org.freedesktop.systemd1.Unit"])
        except dbuscall.CallError:
            return None
        if unwrap(values.get("LoadState")) != "loaded":
            return None
        return (bytes(unwrap(values.get("InvocationID")) or b""),
                str(unwrap(values.get("ActiveState"))), str(path))

    async def _result(self, path: str) -> str:
        """The service's Result (exit-code, signal, start-limit-hit, ...), as words."""
        try:
            (value,) = await dbuscall.call(self.bus, SYSTEMD[0], path, PROPERTIES, "Get", "ss",
                                           ["org.freedesktop.systemd1.Service", "Result"])
        except dbuscall.CallError:
            return "result unknown"
        return f"result: {unwrap(value)}"

    async def properties(self, path: str = PATH, interface: str = MANAGER,
                         destination: str = DEST) -> dict[str, Any]:
        (values,) = await self.call("GetAll", "s", [interface], path=path, interface=PROPERTIES,
                                    destination=destination)
        return {k: unwrap(v) for k, v in values.items()}

    async def allocations(self) -> list[dict[str, Any]]:
        """Every allocation with all its properties, in one call (the ObjectManager's
        GetManagedObjects), sorted by name."""
        (objects,) = await self.call("GetManagedObjects", interface=OBJECT_MANAGER)
        rows = [{k: unwrap(v) for k, v in ifaces[ALLOCATION].items()} | {"Path": path}
                for path, ifaces in objects.items() if ALLOCATION in ifaces]
        return sorted(rows, key=lambda a: str(a["Name"]))

    async def allocation(self, name: str) -> dict[str, Any]:
        """One allocation's properties (NoSuchAllocation when there is none)."""
        (path,) = await self.call("GetAllocation", "s", [name])
        return await self.properties(path, ALLOCATION) | {"Path": path}

    async def allocate(self, name: str, cpus: str, options: Mapping[str, Any]) -> str:
        (path,) = await self.call("Allocate", "ssa{sv}", [name, cpus, variants(options)])
        return str(path)

    async def attach(self, name: str, pids: Sequence[int]) -> str:
        (unit,) = await self.call("Attach", "sau", [name, list(pids)])
        return str(unit)

    async def release(self, name: str) -> None:
        await self.call("Release", "s", [name])


AGENT_READY_SECONDS = 10.0


@contextlib.contextmanager
def polkit_agent(wanted: bool) -> Iterator[None]:
    """polkit's text agent (pkttyagent, shipped with polkitd) for the duration, as systemctl
    starts it: only when asking is allowed, the caller is not root and standard input is a
    terminal. The agent is told a descriptor it closes once it is registered; this waits for
    that, so the call that may need it comes after."""
    agent = _start_agent() if wanted else None
    try:
        yield
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(5)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def _start_agent() -> subprocess.Popen[bytes] | None:
    if os.geteuid() == 0 or not os.isatty(sys.stdin.fileno()):
        return None
    path = shutil.which("pkttyagent")
    if path is None:
        return None
    # registered for this process: it works with or without a login session
    read_end, write_end = os.pipe()
    try:
        agent = subprocess.Popen(
            [path, "--notify-fd", str(write_end), "--fallback", "--process", str(os.getpid())],
            pass_fds=(write_end,))
    except OSError:
        os.close(read_end)
        return None
    finally:
        os.close(write_end)
    try:  # the agent closes its end once registered (or dies): either way, go on
        select.select([read_end], [], [], AGENT_READY_SECONDS)
    finally:
        os.close(read_end)
    return agent
