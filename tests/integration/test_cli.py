"""cpuservicectl and cpuservice-run against the daemon in the container host."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests.integration.service_env import CONFIG, ServiceHost, eventually
from tests.integration.test_service import allocations
from tests.unit.test_topoview import SCENES

GOLDEN = Path(__file__).parents[1] / "unit/golden"


def ctl(daemon: ServiceHost, *args: str) -> subprocess.CompletedProcess[str]:
    """cpuservicectl in the container, in a UTF-8 locale whatever the caller's."""
    return daemon.c.run(["env", "-u", "LC_ALL", "-u", "LC_CTYPE", "LANG=C.UTF-8",
                         "cpuservicectl", "--no-ask-password", *args], check=False)


def test_allocate_list_show_release_text_and_json(daemon: ServiceHost) -> None:
    out = ctl(daemon, "allocate", "web", "2", "--bind", "--policy", "packed")
    assert out.returncode == 0 and out.stdout.startswith("web: 2 CPU(s) bound to 0-1")
    assert ctl(daemon, "allocate", "batch", "1.5").returncode == 0
    listing = ctl(daemon, "list").stdout
    assert listing.splitlines()[0].split() == ["NAME", "CPUS", "BOUND", "CPUSET", "QUOTA",
                                               "WEIGHT", "STATE", "USER", "UNIT"]
    assert "root(0)" in listing
    assert "batch  1.5   no     2-7" in listing and "150%" in listing
    rows = json.loads(ctl(daemon, "--json", "list").stdout)
    assert {r["Name"]: r["CPUSet"] for r in rows} == {"web": "0-1", "batch": "2-7"}
    show = ctl(daemon, "show", "web").stdout
    assert "CPUSet=0-1" in show and "Shares=0:100,1:100" in show and "Bound=yes" in show
    assert json.loads(ctl(daemon, "--json", "show", "web").stdout)["Unit"] == (
        "cpuservice-bound-web.slice")
    assert ctl(daemon, "resize", "web", "3").returncode == 0
    assert json.loads(ctl(daemon, "--json", "show", "web").stdout)["CPUSet"] == "0-2"
    assert ctl(daemon, "release", "web").returncode == 0
    assert sorted(allocations(daemon)) == ["batch"]


def test_status_plan_capacity(daemon: ServiceHost) -> None:
    ctl(daemon, "allocate", "a", "2", "--bind")
    status = ctl(daemon, "status").stdout
    assert "8 CPUs online" in status and "Shared:    2-7" in status and "degraded: none" in status
    s = json.loads(ctl(daemon, "--json", "status").stdout)
    assert s["SharedCPUs"] == "2-7" and s["Allocations"] == 1 and s["Degraded"] == []
    plan = ctl(daemon, "plan", "1.5", "--bind").stdout
    assert "cpuset=2-3" in plan and "cpu-quota-per-sec-usec=150%" in plan
    assert json.loads(ctl(daemon, "--json", "plan", "2", "--bind").stdout)["cpuset"] == "2-3"
    assert ctl(daemon, "capacity", "2", "--bind").stdout.strip() == "2"
    assert ctl(daemon, "capacity", "1").stdout.strip() == "unlimited"
    assert json.loads(ctl(daemon, "--json", "capacity", "1", "--bind").stdout) == {
        "capacity": 5, "unlimited": False}
    assert json.loads(ctl(daemon, "-j", "capacity", "1").stdout) == {
        "capacity": None, "unlimited": True}
    assert sorted(allocations(daemon)) == ["a"]


def test_exit_codes(daemon: ServiceHost) -> None:
    assert ctl(daemon, "release", "nobody").returncode == 4
    assert ctl(daemon, "allocate", "big", "9", "--bind").returncode == 5
    bad = ctl(daemon, "allocate", "x", "1e9")
    assert bad.returncode == 2 and bad.stderr.startswith("cpuservicectl: ")
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert ctl(daemon, "frobnicate").returncode == 2
    nobody = daemon.c.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "cpuservicectl", "--no-ask-password", "allocate", "n", "1"],
                          check=False)
    assert nobody.returncode == 13, nobody.stderr
    unreachable = ctl(daemon, "--bus-address", "unix:path=/nonexistent", "status")
    assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr


def test_topology_pictures_match_the_expected_output(daemon: ServiceHost) -> None:
    for name in ("a", "c"):
        reserved, steps = SCENES[name]
        daemon.configure(name, reserved_cpus=reserved)
        for alloc, cpus, bind in steps:
            assert ctl(daemon, "allocate", alloc, cpus, *(["--bind"] if bind else [])
                       ).returncode == 0
        picture = ctl(daemon, "topology").stdout
        assert picture == (GOLDEN / f"topology-{name}.txt").read_text(), name
        assert "\033[" not in picture
        assert len(json.loads(ctl(daemon, "--json", "topology").stdout)["topology"]) == (
            8 if name == "a" else 128)


def test_watch_prints_one_line_per_event(daemon: ServiceHost) -> None:
    watcher = subprocess.Popen(
        ["nsenter", "-t", str(daemon.c.pid1), "-a", "timeout", "6", "cpuservicectl", "watch"],
        stdout=subprocess.PIPE, text=True)
    time.sleep(2.5)
    ctl(daemon, "allocate", "w", "1", "--bind")
    ctl(daemon, "release", "w")
    out, _ = watcher.communicate(timeout=20)
    lines = [line.split(" ", 2)[2] for line in out.splitlines()[1:]]  # after the timestamp
    assert lines[0] == "AllocationAdded w /org/cpuservice1/allocation/w"
    assert "PoolsChanged 1-7 0 " in lines
    assert "AllocationRemoved w /org/cpuservice1/allocation/w" in lines


def test_status_of_one_allocation_from_systemd(daemon: ServiceHost) -> None:
    """The unit's state, tasks and CPU usage as systemd's own D-Bus properties report them."""
    assert ctl(daemon, "allocate", "st", "2", "--bind").returncode == 0
    daemon.c.run(["systemd-run", "--slice=cpuservice-bound-st.slice", "--unit=st-worker",
                  "sleep", "300"])
    try:
        status = ctl(daemon, "status", "st").stdout
        assert status.startswith("st - 2 CPU(s), bound, active"), status
        assert "Unit: cpuservice-bound-st.slice: active (active)" in status, status
        assert "NUMA nodes: 0" in status, status
        js = json.loads(ctl(daemon, "-j", "status", "st").stdout)
        assert js["UnitState"]["ActiveState"] == "active"
        # this container's hybrid cgroups count no tasks or CPU time: null, not 2^64-1 (the
        # VM lab shows them, tests/lab/test_lab_agent.py)
        assert "TasksCurrent" in js["UnitState"] and "CPUUsageNSec" in js["UnitState"]
        assert js["UnitState"]["TasksCurrent"] in (None, 1)
    finally:
        daemon.c.run(["systemctl", "stop", "st-worker"], check=False)


def test_service_not_running_names_the_fix(daemon: ServiceHost) -> None:
    """The service cannot start (a config error): the bus's activation fails, and the message
    says so and where to look, as soon as the unit has failed. dbus-daemon itself never hears
    that the unit failed (systemd issue 28877) and would answer only after its activation
    timeout, 25 s; the client watches the unit meanwhile."""
    daemon.stop()
    (daemon.c.root / CONFIG.lstrip("/")).write_text("no_such_key = 1\n")
    started = time.monotonic()
    out = ctl(daemon, "status")
    took = time.monotonic() - started
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1, out.stderr
    assert "cpuserviced is not running" in out.stderr, out.stderr
    assert "cpuservice.service failed as it started (result: exit-code)" in out.stderr, \
        out.stderr
    assert "systemctl status cpuservice" in out.stderr, out.stderr
    assert took < 15, f"{took:.1f} s: the bus's activation timeout, not the unit's failure"


def test_revalidate(daemon: ServiceHost) -> None:
    assert ctl(daemon, "revalidate").returncode == 0


def test_cpuservice_run(daemon: ServiceHost) -> None:
    run = daemon.c.run(["cpuservice-run", "--cpus", "2", "--bind", "--name", "job", "--",
                        "sh", "-c", "cat /proc/self/cgroup; exit 7"], check=False)
    assert run.returncode == 7, run.stderr
    assert "/cpuservice.slice/cpuservice-bound.slice/cpuservice-bound-job.slice/" in run.stdout
    eventually(lambda: "job" not in allocations(daemon))
    assert daemon.prop("SharedCPUs") == "0-7"


def test_cpuservice_run_released_after_kill9(daemon: ServiceHost) -> None:
    """In --scope mode the wrapper becomes systemd-run, which becomes the command: one PID."""
    pidfile = daemon.c.root / "run/k9.pid"
    wrapper = subprocess.Popen(
        ["nsenter", "-t", str(daemon.c.pid1), "-a", "cpuservice-run", "--cpus", "1", "--bind",
         "--name", "k9", "--", "sh", "-c", "echo $$ > /run/k9.pid; exec sleep 300"],
        stdout=subprocess.DEVNULL)
    eventually(pidfile.exists)
    assert "k9" in allocations(daemon)
    daemon.c.run(["kill", "-9", pidfile.read_text().strip()])
    wrapper.wait(10)
    eventually(lambda: "k9" not in allocations(daemon))
