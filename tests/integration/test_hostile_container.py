"""The security review's defects on real systemd, dbus-daemon and polkitd (container host)."""

from __future__ import annotations

import time

from tests.integration.service_env import DEST, BusctlError, ServiceHost, eventually
from tests.integration.test_access import as_nobody
from tests.integration.test_service import _check_consistent, allocations


def test_per_user_limits_for_an_unprivileged_user(granted: ServiceHost) -> None:
    daemon = granted
    daemon.configure("b", max_allocations_per_user=3, max_cpus_per_user="25%")  # 4 of 16
    out = as_nobody(daemon, "Allocate", "ssa{sv}", "n1", "3", "1", "bind", "b", "true")
    assert not isinstance(out, BusctlError), out
    over = as_nobody(daemon, "Allocate", "ssa{sv}", "n2", "2", "1", "bind", "b", "true")
    assert isinstance(over, BusctlError) and "max_cpus_per_user" in over.text
    assert isinstance(as_nobody(daemon, "Resize", "ss", "n1", "5"), BusctlError)
    for name in ("n2", "n3"):  # unbound amounts count too: 3 + 0.5 + 0.5 = 4
        assert not isinstance(as_nobody(daemon, "Allocate", "ssa{sv}", name, "0.5", "0"),
                              BusctlError)
    over = as_nobody(daemon, "Allocate", "ssa{sv}", "n4", "1", "0")
    assert isinstance(over, BusctlError) and "max_allocations_per_user=3" in over.text
    daemon.allocate("root-big", "8", bind=True)  # root is not limited
    assert sorted(allocations(daemon)) == ["n1", "n2", "n3", "root-big"]
    _check_consistent(daemon)


def test_a_users_slice_inside_an_allocation_survives_restarts(daemon: ServiceHost) -> None:
    daemon.configure("b")
    daemon.allocate("db", "2", bind=True)
    child = "cpuservice-bound-db-batch.slice"
    daemon.c.run(["systemd-run", f"--slice={child}", "--unit=batch-worker", "sleep", "300"])
    try:
        daemon.c.run(["systemctl", "restart", "cpuservice.service"])
        daemon.call("Revalidate")
        assert daemon.show(child, "ActiveState")["ActiveState"] == "active"
        assert daemon.show("batch-worker.service", "ActiveState")["ActiveState"] == "active"
    finally:
        daemon.c.run(["systemctl", "stop", "batch-worker.service", child], check=False)


def test_a_lost_checkpoint_stops_nothing(daemon: ServiceHost) -> None:
    daemon.configure("b")
    daemon.allocate("keep", "2", bind=True)
    daemon.allocate("frac", "1.5", bind=True)
    before = allocations(daemon)
    daemon.stop()
    daemon.c.run(["rm", "-f", "/var/lib/cpuservice/state.json",
                  "/var/lib/cpuservice/state.json.journal"])
    daemon.start()
    assert allocations(daemon) == before
    assert daemon.show("cpuservice-bound-keep.slice", "ActiveState")["ActiveState"] == "active"
    _check_consistent(daemon)


def test_confine_host_off_gives_the_host_every_cpu(daemon: ServiceHost) -> None:
    daemon.configure("b", confine_host=True)
    daemon.allocate("x", "4", bind=True)
    shared = daemon.prop("SharedCPUs")
    assert daemon.show("system.slice", "AllowedCPUs")["AllowedCPUs"] == shared
    daemon.configure("b", wipe=False, confine_host=False)
    for unit in ("system.slice", "user.slice", "init.scope"):
        assert daemon.show(unit, "AllowedCPUs")["AllowedCPUs"] == "", unit
    assert "x" in allocations(daemon)


def test_a_vanished_foreign_unit_never_stops_startup(daemon: ServiceHost) -> None:
    daemon.configure("b")
    daemon.c.run(["systemd-run", "--unit=vanishing", "sleep", "300"])
    daemon.allocate("v", "1", bind=True, unit="vanishing.service")
    daemon.allocate("w", "1", bind=True)
    daemon.stop()
    daemon.c.run(["systemctl", "stop", "vanishing.service"])
    eventually(lambda: daemon.c.run(["systemctl", "show", "-P", "LoadState",
                                     "vanishing.service"]).stdout.strip() == "not-found")
    daemon.start()
    assert sorted(allocations(daemon)) == ["w"]
    _check_consistent(daemon)


def test_no_sender_no_traceback_and_limits_on_cpuset_text(daemon: ServiceHost) -> None:
    daemon.configure("b")
    huge = ",".join(["0-8191"] * 14000)  # 96 KiB (one argument may hold 128 KiB)
    began = time.monotonic()
    err = daemon.error("Plan", "sa{sv}", "1", "2", "bind", "b", "true", "cpuset", "s", huge)
    assert "cpuset" in err and "internal error" not in err
    assert time.monotonic() - began < 5
    assert as_nobody(daemon, "ListAllocations")["data"] == [[]]
    assert DEST[0] == "org.cpuservice1"


def test_release_removes_the_runtime_overrides_it_made(daemon: ServiceHost) -> None:
    """A unit file's own CPUWeight rules again after release, also once the file changes: the
    old value is not frozen in a runtime drop-in."""
    daemon.configure("b")
    unit_file = daemon.c.root / "etc/systemd/system/persist.service"
    unit_file.write_text("[Service]\nExecStart=/bin/sleep 600\nCPUWeight=70\n")
    daemon.c.run(["systemctl", "daemon-reload"])
    daemon.c.run(["systemctl", "start", "persist.service"])
    control = daemon.c.root / "run/systemd/system.control/persist.service.d"
    try:
        daemon.allocate("p", "1.5", bind=True, unit="persist.service")
        assert (control / "50-AllowedCPUs.conf").exists()
        assert daemon.show("persist.service", "CPUWeight")["CPUWeight"] != "70"
        daemon.call("Release", "s", "p")
        assert daemon.show("persist.service", "CPUWeight", "AllowedCPUs") == {
            "CPUWeight": "70", "AllowedCPUs": ""}
        left = sorted(p.name for p in control.glob("*.conf")) if control.exists() else []
        assert left == [], left
        unit_file.write_text("[Service]\nExecStart=/bin/sleep 600\nCPUWeight=80\n")
        daemon.c.run(["systemctl", "daemon-reload"])
        assert daemon.show("persist.service", "CPUWeight")["CPUWeight"] == "80"
    finally:
        daemon.c.run(["systemctl", "stop", "persist.service"], check=False)
        unit_file.unlink()
        daemon.c.run(["systemctl", "daemon-reload"])


def test_the_journal_knows_priorities_and_the_daemons_name(daemon: ServiceHost) -> None:
    daemon.configure("b")
    daemon.stop()
    daemon.c.run(["sh", "-c", "echo garbage > /var/lib/cpuservice/state.json"])
    daemon.start()  # logs an error: the checkpoint is set aside

    def journal(*args: str) -> str:
        return daemon.c.run(["journalctl", "-u", "cpuservice.service", "--no-pager", "-o",
                             "cat", "-t", "cpuserviced", *args]).stdout

    assert "serving" in journal("-p", "info") and "serving" not in journal("-p", "err")
    assert "set aside" in journal("-p", "err") or "kept it as" in journal("-p", "err")


def test_attach_with_an_impossible_pid_leaks_no_descriptor(granted: ServiceHost) -> None:
    """Issue 25 item 1 on the real bus: as uid 65534 with only the allocate grant, Attach lists
    that also hold 4294967295 (above 2**31-1) get InvalidArgument and leave the daemon's
    descriptor count as it was; Allocate and Release keep working."""
    daemon = granted
    daemon.configure("b")
    assert not isinstance(as_nobody(daemon, "Allocate", "ssa{sv}", "n1", "1", "0"), BusctlError)
    pid = daemon.c.run(["systemctl", "show", "-P", "MainPID", "cpuservice.service"]
                       ).stdout.strip()

    def fds() -> int:
        return int(daemon.c.run(["sh", "-c", f"ls /proc/{pid}/fd | wc -l"]).stdout)

    before = fds()
    for _ in range(25):
        out = as_nobody(daemon, "Attach", "sau", "n1", "3", "1", str(int(pid)), "4294967295")
        assert isinstance(out, BusctlError) and "no process 4294967295" in out.text, out
    assert fds() <= before + 1
    assert not isinstance(as_nobody(daemon, "Allocate", "ssa{sv}", "n2", "1", "0"), BusctlError)
    assert not isinstance(as_nobody(daemon, "Release", "s", "n2"), BusctlError)


def test_a_daemon_reload_does_not_undo_the_confinement(daemon: ServiceHost) -> None:
    """Issue 25, seen by the review: cpuservice sets AllowedCPUs at runtime; a persistent
    `systemctl set-property system.slice AllowedCPUs=...` of an administrator masks that at the
    next daemon-reload (every package upgrade runs one), and system.slice had its old CPUs back
    until the next Revalidate. The daemon follows Reloading and asserts the shared pool again."""
    daemon.configure("b", confine_host=True)
    daemon.allocate("x", "4", bind=True)
    shared = daemon.prop("SharedCPUs")
    try:
        daemon.c.run(["systemctl", "set-property", "system.slice", "AllowedCPUs=0-15"])
        daemon.c.run(["systemctl", "daemon-reload"])
        eventually(lambda: daemon.show("system.slice", "AllowedCPUs")["AllowedCPUs"] == shared,
                   seconds=15)
    finally:
        daemon.c.run(["rm", "-rf", "/etc/systemd/system.control/system.slice.d"], check=False)
        daemon.c.run(["systemctl", "daemon-reload"], check=False)
