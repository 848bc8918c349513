"""A private dbus-daemon with the system bus's limits, open to every local user, and cpuservice
serving on it in a process of its own: the real bus API and service code with the in-memory
systemd of tests.unit.fake_systemd. For what any local user's calls cost the daemon (issue 37):
callers of other uids (nobody) connect to the same socket.

    python3 -m tests.envs.privbus serve ADDRESS DIR FIXTURE   # the daemon's process
    python3 -m tests.envs.privbus flood ADDRESS SECONDS CONNECTIONS DEPTH
        # CONNECTIONS connections, each keeping DEPTH bulk reads pending for SECONDS
        # (GetManagedObjects, GetAll of every allocation, Introspect, in turn by connection);
        # prints {"replies": N, "errors": {name: N}} as JSON
    python3 -m tests.envs.privbus flood ADDRESS SECONDS CONNECTIONS DEPTH noread
        # the same calls, DEPTH on each connection, whose replies are never read

The daemon's process also measures how late its event loop runs a timer due every 50 ms (the
lending loop's sample period): how long anything that waits for the loop (the lending loop's
withdrawal, a change's next step) is held up. It writes [monotonic time, lateness] pairs to
DIR/probe.json when it is stopped (SIGTERM); ``late(start, end)`` picks a window.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dbus_fast import Message, Variant
from dbus_fast.aio import MessageBus

ROOT = Path(__file__).parents[2]
# dbus-daemon's built-in limits are the system bus's (128 calls pending per connection, 256
# connections per user, 32 MiB per message): only the policy is written here.
CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
  <policy user="root">
    <allow own="*"/>
  </policy>
</busconfig>
"""
PROBE_PERIOD = 0.05
NOBODY = 65534


class PrivateSystemBus:
    """The bus and the daemon's process; ``stop()`` ends both and returns the probe's figures."""

    def __init__(self, tmp: Path, fixture: str = "b", **config: Any) -> None:
        self.dir = tmp
        # other users reach the socket: a directory of its own that anyone may enter
        self.sockdir = Path(tempfile.mkdtemp(prefix="cpuservice-bus-", dir="/tmp"))
        self.sockdir.chmod(0o755)
        self.socket = self.sockdir / "bus"
        self.address = f"unix:path={self.socket}"
        (tmp / "bus.conf").write_text(CONFIG.format(socket=self.socket))
        self.bus = subprocess.Popen(["dbus-daemon", "--nofork", "--nopidfile",
                                     f"--config-file={tmp / 'bus.conf'}"],
                                    stdout=subprocess.DEVNULL)
        self._wait(self.socket.exists, "dbus-daemon did not start")
        (tmp / "config.json").write_text(json.dumps(config))
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "tests.envs.privbus", "serve", self.address, str(tmp),
             fixture], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._wait((tmp / "ready").exists, "the daemon did not start")

    def _wait(self, done: Any, what: str, seconds: float = 120) -> None:
        # (a bound on startup, not a measurement: at a load average of 15 the daemon's process
        # took more than 30 s to import, start and populate)
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() > deadline or (getattr(self, "daemon", None) and
                                               self.daemon.poll() is not None):
                self.stop()
                raise RuntimeError(what)
            time.sleep(0.02)

    def stop(self) -> list[tuple[float, float]]:
        if getattr(self, "daemon", None) is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        if self.bus.poll() is None:
            self.bus.terminate()
            self.bus.wait(10)
        shutil.rmtree(self.sockdir, ignore_errors=True)
        probe = self.dir / "probe.json"
        return [tuple(x) for x in json.loads(probe.read_text())] if probe.exists() else []


async def serve(address: str, cfg: Any, timeline: bool = True) -> tuple[Any, Any, Any]:
    """The service on the bus at ``address``, wired as the daemon wires it but with the
    in-memory systemd: (bus, service, manager). ``timeline``: whether the fake keeps its
    snapshot of every unit per call (the ordering checks' record; costly at 1,000 allocations)."""
    from cpuservice.bus.api import BUS_NAME, Bus, Manager, capture_sender
    from cpuservice.daemon import assemble
    from cpuservice.host.authz import Authority
    from cpuservice.host.checkpoint import Store
    from tests.unit.fake_systemd import FakeKernel, FakeSystemd

    bus = await Bus(bus_address=address).connect()
    fake = FakeSystemd()
    if not timeline:
        fake._record = lambda: None  # type: ignore[method-assign]
    service = assemble(cfg, fake, Store(cfg.state_file), FakeKernel(fake))
    manager = Manager(service, bus, Authority(bus))
    bus.add_message_handler(capture_sender)
    await service.start()
    manager.export_all()
    await bus.request_name(BUS_NAME)
    return bus, service, manager


async def _serve(address: str, where: Path, fixture: str) -> None:
    from cpuservice.model import config as config_mod
    from cpuservice.model.fixtures import write_sysfs

    config_mod.VOLATILE_DIRS = ()  # type: ignore[assignment]  # the state lives in the test's temporary directory
    cfg = config_mod.validate({"sysfs_root": str(write_sysfs(where / "sys", fixture)),
                               "state_file": str(where / "state" / "state.json"),
                               **json.loads((where / "config.json").read_text())})
    bus, _, _ = await serve(address, cfg, timeline=False)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    late: list[tuple[float, float]] = []  # (when, how late)

    async def probe() -> None:
        due = time.monotonic() + PROBE_PERIOD
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            late.append((now, now - due))
            due = now + PROBE_PERIOD

    task = asyncio.ensure_future(probe())
    (where / "ready").write_text("")
    await stop.wait()
    task.cancel()
    (where / "probe.json").write_text(json.dumps(late))
    bus.disconnect()


async def call(bus: MessageBus, member: str, signature: str = "", body: list[Any] | None = None,
               path: str = "/org/cpuservice1",
               interface: str = "org.cpuservice1.Manager") -> Message:
    reply = await bus.call(Message(destination="org.cpuservice1", path=path, interface=interface,
                                   member=member, signature=signature, body=body or []))
    assert reply is not None
    return reply


async def populate(address: str, n: int) -> None:
    """n allocations: a third bound whole, a third fractional, a third not."""
    bus = await MessageBus(bus_address=address).connect()
    bind = {"bind": Variant("b", True)}
    for i in range(n):
        cpus, opts = (("1", bind), ("0.3", bind), ("0.5", {}))[i % 3]
        reply = await call(bus, "Allocate", "ssa{sv}", [f"a{i}", cpus, opts])
        if reply.error_name:
            raise RuntimeError(f"Allocate a{i}: {reply.error_name} {reply.body}")
    bus.disconnect()


async def measure(address: str, seconds: float) -> dict[str, float]:
    """Ping cpuservice every 20 ms for ``seconds`` (p50, p99; and dbus-daemon itself, p99:
    what the bus adds; and GetAllocation, a read that takes its turn, p99), then Allocate and
    Release ten times (median of the Allocates)."""
    bus = await MessageBus(bus_address=address).connect()
    pings, bus_pings, reads, allocates = [], [], [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        await call(bus, "Ping", path="/org/cpuservice1", interface="org.freedesktop.DBus.Peer")
        pings.append(time.perf_counter() - start)
        start = time.perf_counter()  # the same question to dbus-daemon itself
        await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                               interface="org.freedesktop.DBus.Peer", member="Ping"))
        bus_pings.append(time.perf_counter() - start)
        start = time.perf_counter()  # a read, which takes a turn among the users' reads
        await call(bus, "GetAllocation", "s", ["a1"])
        reads.append(time.perf_counter() - start)
        await asyncio.sleep(0.02)
    for i in range(10):
        start = time.perf_counter()
        reply = await call(bus, "Allocate", "ssa{sv}", [f"m{i}", "1", {"bind": Variant("b", True)}])
        allocates.append(time.perf_counter() - start)
        assert reply.error_name is None, reply.body
        assert (await call(bus, "Release", "s", [f"m{i}"])).error_name is None
    bus.disconnect()
    pings.sort()
    bus_pings.sort()
    reads.sort()
    return {"ping_p50": statistics.median(pings), "ping_p99": pings[int(len(pings) * 0.99)],
            "bus_ping_p99": bus_pings[int(len(bus_pings) * 0.99)],
            "read_p99": reads[int(len(reads) * 0.99)],
            "allocate": statistics.median(allocates)}


@contextlib.contextmanager
def flood_as_nobody(address: str, seconds: float, connections: int, depth: int,
                    reading: bool = True) -> Iterator[Callable[[], dict[str, Any]]]:
    """The flood below, run as uid 65534 for ``seconds``; the body's value gives its result
    (replies, errors by name) once it ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.envs.privbus", "flood", address, str(seconds),
         str(connections), str(depth), *([] if reading else ["noread"])],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        text=True, user=NOBODY, group=NOBODY, extra_groups=[])
    out: list[str] = []
    try:
        yield lambda: json.loads(out[0])
        out.append(proc.communicate(timeout=seconds + 60)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


BULK = [("org.freedesktop.DBus.ObjectManager", "GetManagedObjects", "", []),
        ("org.freedesktop.DBus.Properties", "GetAll", "s", ["org.cpuservice1.Allocation"]),
        ("org.freedesktop.DBus.Introspectable", "Introspect", "", [])]


async def _flood(address: str, seconds: float, connections: int, depth: int,
                 reading: bool = True) -> dict[str, Any]:
    from dbus_fast import Message, MessageType
    from dbus_fast.aio import MessageBus

    replies, errors = 0, dict[str, int]()
    deadline = time.monotonic() + seconds

    async def one(index: int) -> None:
        nonlocal replies
        bus = await MessageBus(bus_address=address).connect()
        interface, member, signature, body = BULK[index % len(BULK)]
        reply = await bus.call(Message(destination="org.cpuservice1", path="/org/cpuservice1",
                                       interface="org.cpuservice1.Manager",
                                       member="ListAllocations"))
        paths = [row[4] for row in reply.body[0]] if reply.body else []
        if not reading:  # a caller that never reads a reply: the bus keeps them for it
            asyncio.get_running_loop().remove_reader(bus._fd or -1)
            for n in range(depth):
                bus.send(Message(destination="org.cpuservice1", path=paths[n % len(paths)]
                                 if member == "GetAll" else "/org/cpuservice1", interface=interface,
                                 member=member, signature=signature, body=body))
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            return

        async def keep(n: int) -> None:
            nonlocal replies
            while time.monotonic() < deadline:
                path = ("/org/cpuservice1" if member == "GetManagedObjects" else
                        paths[n % len(paths)] if member == "GetAll" and paths else
                        "/org/cpuservice1/allocation")
                got = await bus.call(Message(destination="org.cpuservice1", path=path,
                                             interface=interface, member=member,
                                             signature=signature, body=body))
                if got.message_type == MessageType.ERROR:
                    errors[got.error_name or ""] = errors.get(got.error_name or "", 0) + 1
                else:
                    replies += 1
                n += depth

        await asyncio.gather(*(keep(n) for n in range(depth)))
        bus.disconnect()

    await asyncio.gather(*(one(i) for i in range(connections)))
    return {"replies": replies, "errors": errors}


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 4:
        asyncio.run(_serve(argv[1], Path(argv[2]), argv[3]))
        return 0
    if argv[:1] == ["flood"] and len(argv) in (5, 6):
        print(json.dumps(asyncio.run(_flood(argv[1], float(argv[2]), int(argv[3]),
                                            int(argv[4]), argv[5:] != ["noread"]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
