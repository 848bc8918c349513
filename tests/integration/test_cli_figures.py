"""How each allocation fares (issue 39) through the real bus API on a private dbus-daemon (the
service of tests/integration/test_cli_private_bus.py, its cgroup root a fake tree): status,
show and top print what GetStatistics read from the files, and say "unknown" where there are
none (this build host's hybrid hierarchy has no cpu.pressure where a unit's cgroup is)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.test_cli_private_bus import PrivateService, svc  # noqa: F401
from tests.unit.test_figures import CPU_STAT, NUMA_STAT, PRESSURE, write_cgroup

WEB = "/cpuservice.slice/cpuservice-bound.slice/cpuservice-bound-web.slice"


def cgroups(svc: PrivateService, tmp_path: Path) -> Path:  # noqa: F811
    root = tmp_path / "cgroup"
    root.mkdir()
    svc.manager.statistics.root = root
    return root


def test_status_and_show_print_the_figures(svc: PrivateService, tmp_path: Path) -> None:  # noqa: F811
    root = cgroups(svc, tmp_path)
    assert svc.ctl("allocate", "web", "2", "--bind", "--memory-nodes").returncode == 0
    unknown = svc.ctl("status", "web").stdout
    assert "Pressure: unknown (cpu.pressure cannot be read" in unknown, unknown
    write_cgroup(root, WEB, {"cpu.pressure": PRESSURE, "cpu.stat": CPU_STAT,
                             "memory.numa_stat": NUMA_STAT})
    out = svc.ctl("status", "web").stdout
    assert "CPU: 5s (user 4s, system 1s)" in out, out
    assert "Pressure: some 12.50% 3.05%, full 1.00% 0.25%" in out, out
    assert "Throttled: 40 of 100 periods, 2s" in out, out
    assert "Remote memory: 50.0% (12.0K of 24.0K outside nodes 0)" in out, out
    js = json.loads(svc.ctl("status", "web", "-j").stdout)["Statistics"]
    assert js["cpu-throttled-usec"] == 2_000_000 and js["unreadable"] == []
    assert svc.ctl("show", "web", "-p", "CPUPressureSomeAvg10", "--value").stdout == "12.5\n"
    show = svc.ctl("show", "web").stdout.splitlines()
    assert "MemoryRemotePercent=50.0" in show and "CPUSet=0,8" in show and "Unreadable=" in show
    assert json.loads(svc.ctl("show", "web", "-p", "CPUThrottledPeriods", "-j").stdout) == {
        "CPUThrottledPeriods": 40}
    (root / WEB.lstrip("/") / "cpu.pressure").unlink()
    assert svc.ctl("show", "web", "-p", "CPUPressureSomeAvg10,Unreadable").stdout == \
        "CPUPressureSomeAvg10=[not set]\nUnreadable=cpu.pressure\n"


def test_top_batch_and_json(svc: PrivateService, tmp_path: Path) -> None:  # noqa: F811
    root = cgroups(svc, tmp_path)
    svc.ctl("allocate", "web", "2", "--bind")
    svc.ctl("allocate", "batch", "0.5")
    write_cgroup(root, WEB, {"cpu.pressure": PRESSURE, "cpu.stat": CPU_STAT})
    out = svc.ctl("top", "-b", "-n", "2", "-d", "0.2")
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.split("\n\n")
    assert first.splitlines()[0].split()[:4] == ["NAME", "CPUS", "CPUSET", "%CPU"]
    # the first refresh has no rates: both unknown, by name
    assert first.splitlines()[1].split()[0] == "batch"
    assert first.splitlines()[2].split() == ["web", "2", "0,8", "-", "12.50", "-", "-", "ok"]
    assert second.splitlines()[1].split()[:4] == ["web", "2", "0,8", "0.0"]
    assert second.splitlines()[2].split()[0] == "batch"  # nothing known: last
    docs = [json.loads(line) for line in
            svc.ctl("top", "-b", "-n", "2", "-d", "0.1", "-o", "json").stdout.splitlines()]
    assert len(docs) == 2
    assert [a["Name"] for a in docs[1]["allocations"]] == ["web", "batch"]
    assert docs[1]["allocations"][1]["PressureSomeAvg10"] is None


def test_status_prints_the_shared_pools_pressure_and_the_guard(
        svc: PrivateService, tmp_path: Path) -> None:  # noqa: F811
    """GetHostPressure over the bus (issue 39, the host's side): the shared pool's holders'
    figures read when asked, and the guard off by default."""
    root = tmp_path / "cgroup"
    svc.manager.service.host.root = root
    unknown = svc.ctl("status").stdout
    assert "Pressure:  cpuservice-shared.slice unknown; system.slice unknown" in unknown, unknown
    assert "Guard:     off (admission_guard_percent = 0)" in unknown, unknown
    write_cgroup(root, "/system.slice", {"cpu.pressure": PRESSURE, "cpu.stat": CPU_STAT})
    out = svc.ctl("status").stdout
    assert "system.slice some 12.50% 3.05% (avg10 avg60)" in out, out
    js = json.loads(svc.ctl("status", "-j").stdout)["HostPressure"]
    assert js["system.slice"]["cpu-pressure-some-total-usec"] > 0
    assert js["admission-guard"]["enabled"] is False
    assert "off" in js["admission-guard"]["unavailable"]
