"""Access control with the real polkitd in the container host: an unprivileged caller (nobody)."""

from __future__ import annotations

from tests.integration.service_env import DEST, BusctlError, ServiceHost
from tests.integration.test_service import allocations

NOBODY = "65534"
def as_nobody(daemon: ServiceHost, *args: str) -> object:
    return daemon.busctl("call", *DEST, *args, check=False, user=NOBODY)


def denied(out: object) -> bool:
    return isinstance(out, BusctlError) and (
        "Access denied" in out.text or "Interactive authentication required" in out.text
        or "not authorized" in out.text or "needs authentication" in out.text)


def test_reads_need_no_authorization(daemon: ServiceHost) -> None:
    daemon.allocate("root1", "1", bind=True)
    out = daemon.busctl("get-property", *DEST, "SharedCPUs", user=NOBODY)
    assert out["data"] == daemon.prop("SharedCPUs")
    assert as_nobody(daemon, "ListAllocations")["data"][0][0][0] == "root1"
    assert as_nobody(daemon, "GetAllocation", "s", "root1")["data"] == [
        "/org/cpuservice1/allocation/root1"]
    assert as_nobody(daemon, "Capacity", "sa{sv}", "1", "1", "bind", "b", "true")["data"] == [6]
    intro = daemon.c.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          "busctl", "introspect", *DEST[:2]], check=False)
    assert intro.returncode == 0 and "Allocate" in intro.stdout


def test_changes_are_denied_by_default(daemon: ServiceHost) -> None:
    daemon.allocate("root1", "1", bind=True)
    for args in (("Allocate", "ssa{sv}", "mine", "1", "0"),
                 ("Release", "s", "root1"), ("Resize", "ss", "root1", "2"),
                 ("Revalidate",), ("Attach", "sau", "root1", "1", "1")):
        assert denied(as_nobody(daemon, *args)), args
    assert sorted(allocations(daemon)) == ["root1"]


def test_a_polkit_rule_grants_allocate_on_own_allocations(granted: ServiceHost) -> None:
    daemon = granted
    daemon.allocate("root1", "1", bind=True)
    assert not isinstance(as_nobody(daemon, "Allocate", "ssa{sv}", "mine", "1", "1", "bind", "b",
                                    "true"), BusctlError)
    owner = daemon.busctl("get-property", DEST[0], "/org/cpuservice1/allocation/mine",
                          "org.cpuservice1.Allocation", "Owner")["data"]
    assert owner == int(NOBODY)
    assert not isinstance(as_nobody(daemon, "Resize", "ss", "mine", "2"), BusctlError)
    # not someone else's, not the admin options
    assert denied(as_nobody(daemon, "Release", "s", "root1"))
    assert denied(as_nobody(daemon, "Resize", "ss", "root1", "2"))
    assert denied(as_nobody(daemon, "Allocate", "ssa{sv}", "pin", "1", "2", "bind", "b", "true",
                            "cpuset", "s", "7"))
    assert denied(as_nobody(daemon, "Allocate", "ssa{sv}", "u", "1", "1", "unit", "s",
                            "cron.service"))
    assert denied(as_nobody(daemon, "Revalidate"))
    # a process of root's may not be moved by nobody
    daemon.c.run(["systemd-run", "--unit=rootproc", "sleep", "300"])
    pid = daemon.show("rootproc.service", "MainPID")["MainPID"]
    try:
        assert denied(as_nobody(daemon, "Attach", "sau", "mine", "1", pid))
    finally:
        daemon.c.run(["systemctl", "stop", "rootproc.service"], check=False)
    assert not isinstance(as_nobody(daemon, "Release", "s", "mine"), BusctlError)
    assert sorted(allocations(daemon)) == ["root1"]
    # root may release anyone's
    as_nobody(daemon, "Allocate", "ssa{sv}", "mine2", "1", "0")
    daemon.call("Release", "s", "mine2")
    assert sorted(allocations(daemon)) == ["root1"]


def test_unit_hardening_exposure(daemon: ServiceHost) -> None:
    out = daemon.c.run(["systemd-analyze", "security", "cpuservice.service", "--no-pager"],
                       check=False).stdout
    line = next(x for x in out.splitlines() if "Overall exposure level" in x)
    exposure = float(line.split(":")[1].split()[0])
    print(f"\nsystemd-analyze security cpuservice.service: {exposure}")
    assert exposure <= 2.0
    unit = daemon.show("cpuservice.service", "PrivateNetwork", "RestrictAddressFamilies")
    assert unit["PrivateNetwork"] == "no" and "AF_NETLINK" in unit["RestrictAddressFamilies"]


FORGER = r"""
import asyncio, sys, time
from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

async def main(base: int, seconds: float) -> None:
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for job in range(base, base + 300):
            for result in ("failed", "done"):
                bus.send(Message(message_type=MessageType.SIGNAL, destination="org.cpuservice1",
                                 path="/org/freedesktop/systemd1",
                                 interface="org.freedesktop.systemd1.Manager",
                                 member="JobRemoved", signature="uoss",
                                 body=[job, f"/org/freedesktop/systemd1/job/{job}", "x.slice",
                                       result]))
                sent += 1
        await asyncio.sleep(0.01)
    print(sent, flush=True)

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""


def test_forged_systemd_signals_change_nothing(daemon: ServiceHost) -> None:
    """nobody sends JobRemoved 'failed' (and 'done') for the coming job ids while root
    allocates and releases: no request fails, systemd holds what the service says."""
    import asyncio
    import subprocess

    from dbus_fast import Variant

    from tests.integration import client
    from tests.integration.test_service import _check_consistent

    daemon.configure("b")
    job = daemon.busctl("call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                        "org.freedesktop.systemd1.Manager", "StartUnit", "ss",
                        "cpuservice.slice", "replace")["data"][0]
    base = int(job.rsplit("/", 1)[1])
    forger = subprocess.Popen(
        ["nsenter", "-t", str(daemon.c.pid1), "-a", "setpriv", f"--reuid={NOBODY}",
         f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3", "-c", FORGER, str(base), "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    async def requests() -> int:
        bus = await client.connect(daemon.c.bus_address)
        done = 0
        try:
            await asyncio.sleep(1.0)  # the forger is sending
            for i in range(25):
                await client.call(bus, "Allocate", "ssa{sv}",
                                  [f"f{i}", "1", {"bind": Variant("b", True)}])
                await client.call(bus, "Resize", "ss", [f"f{i}", "2"])
                await client.call(bus, "Release", "s", [f"f{i}"])
                done += 1
        finally:
            bus.disconnect()
        return done

    try:
        assert asyncio.run(requests()) == 25
    finally:
        out, err = forger.communicate(timeout=60)
    assert forger.returncode == 0, err
    assert int(out) > 1000  # it did send
    daemon.allocate("after", "2", bind=True)
    _check_consistent(daemon)
