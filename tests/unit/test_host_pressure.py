"""The host's side of issue 39: the shared pool's holders' pressure (GetHostPressure) and the
admission guard on the kernel's PSI triggers, on a fake cgroup tree whose triggers are sockets
(urgent data is POLLPRI, as the kernel signals a trigger; a closed peer is POLLHUP, as a
removed cgroup) and an injected clock."""

from __future__ import annotations

import asyncio
import os
import select
import socket
from pathlib import Path
from typing import Any

import pytest

from cpuservice.bus import statistics as bus_statistics
from cpuservice.daemon import assemble
from cpuservice.host import psi
from cpuservice.host.checkpoint import Store
from cpuservice.model import config as config_mod
from cpuservice.model import starvation
from cpuservice.model.errors import InvalidArgument, SharedPoolStarving
from cpuservice.model.starvation import HOST_CGROUPS, Episode, Guard
from cpuservice.shell.host_pressure import HostPressure
from cpuservice.shell.service import Service
from tests.unit.test_service_fake import Host, Recorder, run

PRESSURE = ("some avg10={:.2f} avg60=1.00 avg300=0.50 total=123456\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
GUARD = Guard(50.0, 2, 10.0)


# ---- the decision (pure) ----

def test_the_trigger_is_the_share_of_the_window() -> None:
    assert GUARD.trigger() == "some 1000000 2000000"
    assert Guard(100.0, 10, 10).trigger() == "some 10000000 10000000"
    assert Guard(0.00001, 2, 10).trigger() == "some 1 2000000"  # the kernel wants > 0
    assert not Guard().enabled and Guard(1).enabled


def test_an_episode_lasts_while_events_come_and_ends_after_hold() -> None:
    e = starvation.event(Episode(), GUARD, 100.0, "system.slice")
    assert e.starving(GUARD, 100.0) and e.starving(GUARD, 109.9)
    assert not e.starving(GUARD, 110.0)  # hold seconds without an event
    for t in (102.0, 104.0, 106.0):  # the kernel reports once per window while it lasts
        e = starvation.event(e, GUARD, t, "cpuservice-shared.slice")
    assert e.since == 100.0 and e.last == 106.0 and e.lasted(115.9) == pytest.approx(15.9)
    assert e.where == ("system.slice", "cpuservice-shared.slice")
    assert e.starving(GUARD, 115.9) and not e.starving(GUARD, 116.0)
    again = starvation.event(e, GUARD, 130.0, "system.slice")  # a new episode
    assert again.since == 130.0 and again.where == ("system.slice",)
    assert not Episode().starving(GUARD, 0.0) and Episode().lasted(5.0) == 0.0


def test_the_refusal_says_why_for_how_long_and_how_to_override() -> None:
    e = starvation.event(Episode(), GUARD, 100.0, "system.slice")
    e = starvation.event(e, GUARD, 108.0, "system.slice")
    with pytest.raises(SharedPoolStarving) as caught:
        starvation.check(e, GUARD, 112.4, 2, "Allocate 'db'", {"system.slice": 87.25})
    text = str(caught.value)
    assert "Allocate 'db' would take 2 CPUs out of the shared pool" in text
    assert "system.slice has been above 50 % (admission_guard_percent" in text
    assert "for 12 s" in text and "avg10 now: system.slice 87.2 %" in text
    assert "stayed below for 10 s" in text and "option 'force'" in text
    assert caught.value.dbus_name == "org.cpuservice1.Error.SharedPoolStarving"
    # nothing taken from the pool, the guard off, the episode over: admitted
    starvation.check(e, GUARD, 112.4, 0, "Allocate 'u'")
    starvation.check(e, Guard(0.0), 112.4, 2, "Allocate 'db'")
    starvation.check(e, GUARD, 118.0, 2, "Allocate 'db'")


def test_the_configuration_is_off_by_default_and_checked() -> None:
    cfg = config_mod.validate({})
    assert not cfg.guard.enabled and cfg.guard == Guard(0.0, 2, 10.0)
    assert config_mod.validate({"admission_guard_percent": 40,
                                "admission_guard_window_seconds": 4}).guard == Guard(40, 4, 10)
    for bad in ({"admission_guard_window_seconds": 3}, {"admission_guard_percent": 101},
                {"admission_guard_percent": True}, {"admission_guard_hold_seconds": 1},
                {"admission_guard_percent": 10, "admission_guard_window_seconds": 10,
                 "admission_guard_hold_seconds": 5}):
        with pytest.raises(config_mod.ConfigError):
            config_mod.validate(bad)


# ---- the triggers, on sockets ----

class Kernel:
    """The fake cgroup tree's triggers: each opened cpu.pressure is one end of a socket pair;
    the other end reads what was written and signals (urgent data: POLLPRI)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peers: dict[str, socket.socket] = {}
        self.written: dict[str, bytes] = {}
        self.refuse: OSError | None = None
        for _, group in HOST_CGROUPS:
            self.pressure(group, 0.0)

    def pressure(self, group: str, avg10: float) -> None:
        path = self.root / group.lstrip("/") / "cpu.pressure"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PRESSURE.format(avg10))

    def open(self, path: str) -> int:
        if self.refuse is not None:
            raise self.refuse
        ours, theirs = socket.socketpair()
        self.peers[path] = theirs
        fd = os.dup(ours.fileno())
        ours.close()
        return fd

    def signal(self, group: str) -> None:
        path = str(psi.pressure_path(self.root, group))
        peer = self.peers[path]
        self.written[path] = peer.recv(100, socket.MSG_DONTWAIT)
        peer.send(b"!", socket.MSG_OOB)

    def remove(self, group: str) -> None:
        self.peers.pop(str(psi.pressure_path(self.root, group))).close()


def _oob_works() -> bool:
    a, b = socket.socketpair()
    try:
        a.send(b"!", socket.MSG_OOB)
        return bool(select.select([], [], [b], 0)[2])
    except OSError:
        return False
    finally:
        a.close()
        b.close()


needs_oob = pytest.mark.skipif(not _oob_works(), reason="AF_UNIX urgent data needs Linux 5.15")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.01)


@needs_oob
def test_a_trigger_wakes_the_loop_on_pollpri_only_and_says_when_it_is_gone(
        tmp_path: Path) -> None:
    async def body() -> None:
        kernel = Kernel(tmp_path)
        told: list[str] = []
        path = psi.pressure_path(tmp_path, "/system.slice")
        trigger = psi.Trigger(path, "some 1000000 2000000", told.append, kernel.open)
        trigger.watch(asyncio.get_running_loop())
        await _settle()
        assert told == []  # readable and writable all along: not an event
        kernel.signal("/system.slice")
        assert kernel.written[str(path)] == b"some 1000000 2000000\0"  # the kernel reads to NUL
        await _settle()
        assert told == ["event"]
        kernel.remove("/system.slice")
        await _settle()
        assert told == ["event", "gone"] and not trigger.armed  # closed: no endless wake-ups
    run(body)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _service(tmp: Path, **settings: Any) -> tuple[Service, Kernel, Clock]:
    host = Host(tmp, **{"admission_guard_percent": 50, **settings})
    svc = assemble(host.cfg, host.fake, Store(host.cfg.state_file), host.kernel)
    kernel, clock = Kernel(tmp / "cgroup"), Clock()
    svc.host.root, svc.host.opener, svc.host.clock = kernel.root, kernel.open, clock
    svc.engine.detect_lending = lambda: (False, "not here")
    await svc.start()
    return svc, kernel, clock


@needs_oob
def test_the_guard_refuses_what_takes_from_a_starving_pool_until_the_pressure_ends(
        tmp_path: Path) -> None:
    async def body() -> None:
        svc, kernel, clock = await _service(tmp_path)
        caps = svc.engine.capabilities.as_dbus()
        assert caps["PressureGuard"] == ("b", True) and caps["PressureGuardUnavailable"][1] == ""
        await svc.allocate("before", "1", {"bind": True}, 0)  # no pressure: admitted
        kernel.pressure("/system.slice", 93.5)
        kernel.signal("/system.slice")
        await _settle()
        assert svc.host.starving() and svc.host.events == 1
        clock.now += 7
        with pytest.raises(SharedPoolStarving) as caught:
            await svc.allocate("db", "2", {"bind": True}, 0)
        assert "for 7 s" in str(caught.value) and "system.slice 93.5 %" in str(caught.value)
        assert "db" not in svc.ledger.allocations  # refused: nothing changed
        await svc.allocate("web", "1.5", {}, 0)  # unbound: takes nothing from the pool
        await svc.allocate("ops", "1", {"bind": True}, 0, force=True)  # root's override
        with pytest.raises(SharedPoolStarving):  # an unprivileged Resize that grows
            await svc.resize("before", "2", limited=True)
        await svc.resize("before", "2")  # root's (or manage's: the bus retries unlimited)
        clock.now += 10  # hold seconds after the last event: over
        await svc.allocate("db", "2", {"bind": True}, 0)
        assert svc.ledger.allocations["db"].held
        svc.host.disarm()
    run(body)


@needs_oob
def test_no_timer_runs_while_the_pool_is_not_starving(tmp_path: Path) -> None:
    """An idle daemon stays idle: the episode's end is the one timer, only while it lasts."""
    async def body() -> None:
        host = HostPressure(Guard(50.0, 2, 0.2), tmp_path)
        kernel = Kernel(tmp_path)
        host.opener = kernel.open
        ended: list[bool] = []
        host.on_change = lambda: ended.append(host.starving())
        assert host.start() and host._end is None
        kernel.signal("/cpuservice.slice/cpuservice-shared.slice")
        await _settle()
        assert host._end is not None and ended == [True]
        await asyncio.sleep(0.3)
        assert host._end is None and ended == [True, False] and not host.starving()
        kernel.remove("/system.slice")  # its slice stopped: armed again at the next request
        await _settle()
        assert "system.slice" not in host.triggers
        host.check(1, "Allocate 'x'")
        assert "system.slice" in host.triggers
        host.disarm()
    run(body)


def test_without_triggers_the_guard_is_unavailable_and_admits(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, admission_guard_percent=50)
        svc = assemble(host.cfg, host.fake, Store(host.cfg.state_file), host.kernel)
        kernel = Kernel(tmp_path / "cgroup")
        kernel.refuse = OSError(2, "No such file or directory")
        svc.host.root, svc.host.opener = kernel.root, kernel.open
        await svc.start()
        caps = svc.engine.capabilities.as_dbus()
        assert caps["PressureGuard"] == ("b", False)
        assert "No such file or directory" in caps["PressureGuardUnavailable"][1]
        await svc.allocate("db", "2", {"bind": True}, 0)
        reply = bus_statistics.host_reply(svc.host)
        guard = {k: v.value for k, v in reply[bus_statistics.GUARD].items()}
        assert guard["enabled"] and not guard["available"] and not guard["starving"]
    run(body)


def test_off_by_default_says_so(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        caps = svc.engine.capabilities.as_dbus()
        assert caps["PressureGuard"] == ("b", False)
        assert "off" in caps["PressureGuardUnavailable"][1]
    run(body)


def test_get_host_pressure_reads_the_holders_now(tmp_path: Path) -> None:
    kernel = Kernel(tmp_path)
    host = HostPressure(Guard(), tmp_path)
    kernel.pressure("/system.slice", 12.5)
    reply = bus_statistics.host_reply(host)
    assert set(reply) == {"cpuservice-shared.slice", "system.slice", bus_statistics.GUARD}
    assert reply["system.slice"]["cpu-pressure-some-avg10"].value == 12.5
    assert reply["system.slice"]["cpu-pressure-some-total-usec"].value == 123456
    kernel.pressure("/system.slice", 40.0)  # never a kept copy
    assert bus_statistics.host_reply(host)["system.slice"][
        "cpu-pressure-some-avg10"].value == 40.0
    (tmp_path / "system.slice/cpu.pressure").unlink()
    assert "cpu.pressure" in bus_statistics.host_reply(host)["system.slice"]["unreadable"].value


def test_option_force_is_the_calls_own_and_a_boolean() -> None:
    from dbus_fast import Variant
    options = {"bind": Variant("b", True), "force": Variant("b", True)}
    assert bus_statistics.force(options) and options == {"bind": Variant("b", True)}
    assert not bus_statistics.force({})
    with pytest.raises(InvalidArgument):
        bus_statistics.force({"force": Variant("s", "yes")})


def test_a_real_kernel_takes_the_trigger(tmp_path: Path) -> None:
    """Where this machine's kernel has PSI (/proc/pressure/cpu, writable by root with
    CAP_SYS_RESOURCE), the trigger is armed as written; a malformed one is refused."""
    path = Path("/proc/pressure/cpu")
    try:
        trigger = psi.Trigger(path, "some 1900000 2000000", lambda kind: None)
    except OSError as exc:
        pytest.skip(f"no PSI trigger here: {exc}")
    trigger.close()
    with pytest.raises(OSError):
        psi.Trigger(path, "some 0 2000000 junk", lambda kind: None)


def test_the_metrics_show_the_holders_and_the_guard(tmp_path: Path) -> None:
    from cpuservice.host import figure_metrics
    Kernel(tmp_path)
    figures = HostPressure(Guard(), tmp_path).read()
    text = figure_metrics.render_host(figures)
    assert ('cpuservice_host_cpu_pressure_seconds_total{cgroup="system.slice",kind="some"} '
            '0.123456') in text
    assert "cpuservice_admission_guard" not in text.replace("# ", "")  # off: no such series
    text = figure_metrics.render_host(figures, True, True)
    assert "cpuservice_admission_guard_starving 1" in text
    assert "cpuservice_admission_guard_available 1" in text


class Polkit:
    """Allows allocate to everyone, manage to uid 0 and ``managers``."""

    def __init__(self, managers: set[int]) -> None:
        self.managers = managers
        self.asked: list[tuple[int, str]] = []

    async def check(self, sender: str, uid: int, action: str, interactive: bool) -> None:
        from cpuservice.host.authz import MANAGE
        from cpuservice.model.errors import AccessDenied
        self.asked.append((uid, action))
        if action == MANAGE and uid != 0 and uid not in self.managers:
            raise AccessDenied(f"not authorized for {action}")


@needs_oob
def test_force_needs_manage_and_resize_spares_manage(tmp_path: Path) -> None:
    """Over the Manager's methods: option force is manage's (root's) override of the guard;
    a Resize that grows is refused to an unprivileged owner and allowed to a holder of
    manage (the bus retries it unlimited, as with the per-user limits)."""
    from dbus_fast import DBusError, Variant

    from cpuservice.bus.api import Manager
    from cpuservice.bus.objects import current_call

    async def body() -> None:
        svc, kernel, _ = await _service(tmp_path)
        polkit = Polkit({2000})
        manager = Manager(svc, None, polkit)  # type: ignore[arg-type]
        svc.events = Recorder()  # (no bus to export the objects on)
        uid = {"who": 1000}

        async def uid_of(sender: str) -> int:
            return uid["who"]

        manager.uid_of = uid_of  # type: ignore[method-assign]
        current_call.set((":1.5", False))
        allocate = Manager.Allocate.__wrapped__
        resize = Manager.Resize.__wrapped__
        await allocate(manager, "mine", "1", {"bind": Variant("b", True)})
        kernel.signal("/system.slice")
        await _settle()
        bind = {"bind": Variant("b", True)}
        with pytest.raises(DBusError) as caught:
            await allocate(manager, "db", "1", dict(bind))
        assert caught.value.type == SharedPoolStarving.dbus_name
        assert "option 'force'" in caught.value.text
        with pytest.raises(DBusError) as denied:  # force is not an unprivileged user's
            await allocate(manager, "db", "1", {**bind, "force": Variant("b", True)})
        assert denied.value.type == "org.freedesktop.DBus.Error.AccessDenied"
        with pytest.raises(DBusError) as grow:
            await resize(manager, "mine", "2")
        assert grow.value.type == SharedPoolStarving.dbus_name
        uid["who"] = 2000  # a holder of manage
        await allocate(manager, "db", "1", {**bind, "force": Variant("b", True)})
        await resize(manager, "db", "2")
        assert svc.ledger.allocations["db"].request.cpus == 2
        assert "force" not in str(svc.ledger.allocations["db"].request)  # never recorded
        reply = await Manager.GetHostPressure.__wrapped__(manager)
        assert reply["admission-guard"]["starving"].value is True
        assert reply["admission-guard"]["events"].value == 1
        svc.host.disarm()
    run(body)


def test_status_prints_the_host_and_the_guard() -> None:
    from cpuservice.cli import ctl_figures
    reply = {"cpuservice-shared.slice": {"cpu-pressure-some-avg10": 1.5,
                                         "cpu-pressure-some-avg60": 0.25},
             "system.slice": {"unreadable": ["cpu.pressure"]},
             "admission-guard": {"enabled": True, "available": True, "starving": True,
                                 "starving-usec": 12_400_000, "cgroups": ["system.slice"],
                                 "limit-percent": 50.0, "window-usec": 2_000_000}}
    lines = dict(ctl_figures.host_lines(reply))
    assert lines["Pressure"] == ("cpuservice-shared.slice some 1.50% 0.25%; system.slice "
                                 "unknown (avg10 avg60)")
    assert lines["Guard"].startswith("STARVING for 12 s (system.slice above 50% per 2 s)")
    reply["admission-guard"] |= {"starving": False}
    assert dict(ctl_figures.host_lines(reply))["Guard"].startswith("admitting")
    reply["admission-guard"] |= {"available": False, "unavailable": "no PSI"}
    assert "unavailable, admits everything: no PSI" in dict(ctl_figures.host_lines(reply))[
        "Guard"]
    reply["admission-guard"] |= {"enabled": False}
    assert dict(ctl_figures.host_lines(reply))["Guard"].startswith("off")


def test_the_unit_lets_the_daemon_write_just_the_triggers() -> None:
    """ProtectControlGroups= keeps the hierarchy read-only but for the watched cpu.pressure
    files (starvation.HOST_CGROUPS, their one home)."""
    unit = (Path(__file__).parents[2] / "systemd/cpuservice.service").read_text()
    assert "ProtectControlGroups=yes" in unit
    writable = [line.split("=", 1)[1] for line in unit.splitlines()
                if line.startswith("ReadWritePaths=-/sys/fs/cgroup")]
    assert writable == [f"-/sys/fs/cgroup{group}/cpu.pressure" for _, group in HOST_CGROUPS]
