"""What an administrator sees of cpuserviced through systemd's own tools, in the container host
(real systemd, journald, dbus-daemon): the audit trail in the journal, the unit's StatusText,
Type=notify and the watchdog, a bad configuration that fails once, --check-config, and the
metrics file."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cpuservice import daemon as daemon_mod
from cpuservice.host.journal import MESSAGE_IDS, Kind
from tests.integration.service_env import DEST, ServiceHost, eventually

DROPIN_DIR = "/etc/cpuservice/cpuservice.toml.d"
METRICS_DIR = "/var/lib/prometheus/node-exporter"


def entries(daemon: ServiceHost, *matches: str) -> list[dict[str, Any]]:
    out = daemon.c.run(["journalctl", "--no-pager", "-o", "json", *matches], check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def show(daemon: ServiceHost, *props: str) -> dict[str, str]:
    return daemon.show("cpuservice.service", *props)


def test_changes_are_audited_in_the_journal(daemon: ServiceHost) -> None:
    daemon.allocate("audited", "2", bind=True)
    cpus = daemon.call("ListAllocations")[0][0][3]
    found: list[dict[str, Any]] = []

    def logged() -> bool:
        found[:] = entries(daemon, f"MESSAGE_ID={MESSAGE_IDS[Kind.ALLOCATED]}",
                           "CPUSERVICE_ALLOCATION=audited")
        return bool(found)

    eventually(logged)
    entry = found[-1]
    assert (entry["CPUSERVICE_UID"], entry["CPUSERVICE_CPUS"], entry["CPUSERVICE_BOUND"]) == (
        "0", cpus, "yes")
    assert entry["CPUSERVICE_UNIT"] == "cpuservice-bound-audited.slice"
    assert entry["SYSLOG_IDENTIFIER"] == "cpuserviced" and entry["PRIORITY"] == "5"
    assert entry["_SYSTEMD_UNIT"] == "cpuservice.service"
    assert entry["MESSAGE"].startswith("allocation audited allocated: uid 0, 2 bound CPUs on")
    # the slice's own journal shows who took its CPUs (OBJECT_SYSTEMD_UNIT from root)
    eventually(lambda: any(e.get("CPUSERVICE_ALLOCATION") == "audited" for e in entries(
        daemon, "-u", "cpuservice-bound-audited.slice")))
    daemon.call("Resize", "ss", "audited", "1")
    daemon.call("Release", "s", "audited")
    eventually(lambda: [e["CPUSERVICE_EVENT"] for e in entries(
        daemon, "CPUSERVICE_ALLOCATION=audited")][-3:] == ["allocated", "resized", "released"])
    released = entries(daemon, f"MESSAGE_ID={MESSAGE_IDS[Kind.RELEASED]}",
                       "CPUSERVICE_ALLOCATION=audited")
    assert len(released) == 1 and released[0]["CPUSERVICE_REASON"] == "released"


def test_status_text_follows_the_pools(daemon: ServiceHost) -> None:
    unit = show(daemon, "Type", "NotifyAccess", "WatchdogUSec", "StatusText")
    assert (unit["Type"], unit["NotifyAccess"], unit["WatchdogUSec"]) == ("notify", "main", "1min")
    assert unit["StatusText"] == "0 allocations, 0 bound CPUs, shared 0-7"
    daemon.allocate("st", "2", bind=True)
    shared = daemon.prop("SharedCPUs")
    eventually(lambda: show(daemon, "StatusText")["StatusText"]
               == f"1 allocation, 2 bound CPUs, shared {shared}")
    daemon.call("Release", "s", "st")
    eventually(lambda: show(daemon, "StatusText")["StatusText"]
               == "0 allocations, 0 bound CPUs, shared 0-7")


@pytest.fixture
def short_watchdog(daemon: ServiceHost) -> Iterator[ServiceHost]:
    path = daemon.c.root / "run/systemd/system/cpuservice.service.d/50-watchdog.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[Service]\nWatchdogSec=2s\n")
    daemon.c.run(["systemctl", "daemon-reload"])
    try:
        yield daemon
    finally:
        path.unlink()
        daemon.c.run(["systemctl", "daemon-reload"])
        daemon.stop()


def test_the_watchdog_is_fed(short_watchdog: ServiceHost) -> None:
    daemon = short_watchdog
    daemon.stop()
    daemon.start()
    assert show(daemon, "WatchdogUSec")["WatchdogUSec"] == "2s"
    time.sleep(5)  # without pings systemd would have killed it twice by now
    unit = show(daemon, "ActiveState", "NRestarts", "Result")
    assert unit == {"ActiveState": "active", "NRestarts": "0", "Result": "success"}


@pytest.fixture
def bad_dropin(daemon: ServiceHost) -> Iterator[str]:
    path = daemon.c.root / DROPIN_DIR.lstrip("/") / "90-bad.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("granularity = 7\n")
    try:
        yield f"{DROPIN_DIR}/90-bad.toml"
    finally:
        path.unlink()
        daemon.stop()
        daemon.start()


def test_a_config_error_fails_once_and_names_the_dropin(daemon: ServiceHost,
                                                        bad_dropin: str) -> None:
    result = daemon.c.run(["cpuserviced", "--check-config"], check=False)
    assert result.returncode == daemon_mod.EXIT_CONFIG
    assert f"{bad_dropin}: granularity" in result.stderr
    assert daemon.c.run(["systemctl", "is-active", "cpuservice"], check=False).stdout.strip() \
        == "active"  # checking changed nothing
    daemon.stop()
    started = daemon.c.run(["systemctl", "start", "cpuservice.service"], check=False)
    assert started.returncode != 0
    time.sleep(3)  # RestartSec=1s: a restart loop would have begun
    unit = show(daemon, "ActiveState", "NRestarts", "ExecMainStatus", "StatusText")
    assert (unit["ActiveState"], unit["NRestarts"], unit["ExecMainStatus"]) == (
        "failed", "0", str(daemon_mod.EXIT_CONFIG))
    errors = daemon.c.run(["journalctl", "-u", "cpuservice", "-p", "err", "--no-pager", "-o",
                           "cat", "-n", "5"], check=False).stdout
    assert f"{bad_dropin}: granularity" in errors
    assert errors.count(f"{bad_dropin}: granularity") == 1 or "90-bad" in errors


def test_check_config_accepts_a_good_config(daemon: ServiceHost) -> None:
    result = daemon.c.run(["cpuserviced", "--check-config"], check=False)
    assert result.returncode == 0, result.stderr
    assert "/etc/cpuservice/cpuservice.toml" in result.stdout


@pytest.fixture
def textfile_dir(daemon: ServiceHost) -> Iterator[ServiceHost]:
    directory = daemon.c.root / METRICS_DIR.lstrip("/")
    existed = directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    daemon.stop()
    daemon.start()  # ReadWritePaths=- takes the directory only when it exists at start
    try:
        yield daemon
    finally:
        daemon.stop()
        if not existed:
            directory.rmdir()


def test_metrics_file_follows_an_allocation(textfile_dir: ServiceHost) -> None:
    daemon = textfile_dir
    prom = daemon.c.root / METRICS_DIR.lstrip("/") / "cpuservice.prom"
    eventually(prom.exists)
    assert prom.stat().st_mode & 0o777 == 0o644
    assert 'cpuservice_pool_cpus{pool="shared"} 8' in prom.read_text()
    daemon.allocate("m1", "2", bind=True)
    eventually(lambda: 'cpuservice_allocation_cpus{allocation="m1"} 2' in prom.read_text())
    text = prom.read_text()
    assert 'cpuservice_pool_cpus{pool="shared"} 6' in text
    assert 'cpuservice_requests_total{method="Allocate",result="ok"} 1' in text
    daemon.stop()
    assert not prom.exists()  # a stopped service: no stale metrics


def test_the_audit_names_the_owner_and_who_released_it(granted: ServiceHost) -> None:
    daemon = granted
    out = daemon.busctl("call", *DEST, "Allocate", "ssa{sv}", "theirs", "1", "1", "bind", "b",
                        "true", user="65534")
    assert not isinstance(out, Exception), out
    daemon.call("Release", "s", "theirs")  # root releases nobody's allocation
    found: list[dict[str, Any]] = []

    def logged() -> bool:
        found[:] = entries(daemon, "CPUSERVICE_ALLOCATION=theirs")
        return [e["CPUSERVICE_EVENT"] for e in found][-2:] == ["allocated", "released"]

    eventually(logged)
    allocated, released = found[-2:]
    assert allocated["CPUSERVICE_UID"] == allocated["CPUSERVICE_CALLER_UID"] == "65534"
    assert released["CPUSERVICE_UID"] == "65534" and released["CPUSERVICE_CALLER_UID"] == "0"
    assert ", by uid 0 (released)" in released["MESSAGE"]


def test_journalctl_x_explains_the_entries(daemon: ServiceHost) -> None:
    daemon.allocate("explained", "1", bind=True)
    eventually(lambda: "Subject: CPUs allocated: explained" in daemon.c.run(
        ["journalctl", "--no-pager", "-x", "CPUSERVICE_ALLOCATION=explained"]).stdout)
