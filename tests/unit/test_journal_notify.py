"""sd_notify (cpuservice.host.notify): the STATUS= line, $NOTIFY_SOCKET (paths and abstract names,
against real datagram sockets), the watchdog's interval and pings."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from cpuservice import placement
from cpuservice.host import notify
from cpuservice.host.sysfs import discover
from cpuservice.model.request import Request
from tests.unit.helpers import ledger_for
from tests.unit.test_service_fake import Host


def test_status_text_follows_the_pools(tmp_path: Path) -> None:
    host = Host(tmp_path)
    topology = discover(host.cfg.sysfs_root)
    ledger = ledger_for(topology)
    assert notify.status_text(ledger) == f"0 allocations, 0 bound CPUs, shared {ledger.online}"
    ledger, a = placement.allocate(topology, ledger, "a", Request.parse("2", {"bind": True}))
    ledger, _ = placement.allocate(topology, ledger, "b", Request.parse("0.5", {"bind": True}))
    ledger, _ = placement.allocate(topology, ledger, "u", Request.parse("1", {}))
    assert notify.status_text(ledger) == (
        f"3 allocations, 3 bound CPUs, shared {ledger.shared.format()}")
    ledger = ledger.with_allocation(replace(a, degraded=True))
    assert notify.status_text(ledger).endswith(", 1 degraded")


def test_socket_addresses() -> None:
    assert notify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify.socket_address("@abstract/name") == b"\0abstract/name"
    assert notify.socket_address("") is None and notify.socket_address("relative") is None


def receive(server: socket.socket) -> str:
    return server.recv(4096).decode()


def test_notifications_reach_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(5)
        n = notify.Notifier(path)
        n.ready("1 allocation")
        assert receive(server) == "READY=1\nSTATUS=1 allocation\n"
        n.status("1 allocation")  # unchanged: not sent again
        n.status("2 allocations")
        assert receive(server) == "STATUS=2 allocations\n"
        n.stopping()
        assert receive(server).startswith("STOPPING=1\n")


def test_notifications_reach_an_abstract_socket() -> None:
    name = f"cpuservice-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(b"\0" + name.encode())
        server.settimeout(5)
        assert notify.Notifier("@" + name).send(status="x")
        assert receive(server) == "STATUS=x\n"


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify.Notifier().send(ready="1")


def test_watchdog_interval() -> None:
    me = str(os.getpid())
    assert notify.watchdog_interval({}) is None
    assert notify.watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert notify.watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": me}) == 30.0
    assert notify.watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}) is None
    assert notify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None


def test_watchdog_pings_from_the_loop(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.setblocking(False)

        async def body() -> int:
            n = notify.Notifier(path)
            n.start_watchdog(0.05)
            await asyncio.sleep(0.28)
            n.stop_watchdog()
            await asyncio.sleep(0.1)
            pings = 0
            while True:
                try:
                    assert server.recv(100) == b"WATCHDOG=1\n"
                except BlockingIOError:
                    return pings
                pings += 1

        assert 4 <= asyncio.run(body()) <= 7
