"""How each allocation fares (issue 39), step 1: the parsers of cpu.pressure, cpu.stat and
memory.numa_stat (cpuservice.model.figures), their reader on a fake cgroup tree
(cpuservice.host.figures) and the allocations' cgroups (cpuservice.shell.statistics). Every
figure equals a recomputation from the files; a file that is missing or malformed makes its
figures unknown, never an error."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.host import figures as reader
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.figures import (
    FIGURES,
    SIGNATURES,
    CPUStat,
    Pressure,
    parse_cpu_stat,
    parse_numa_stat,
    parse_pressure,
    rates,
    slice_cgroup,
)
from cpuservice.shell.statistics import Statistics
from tests.props import examples
from tests.unit.fake_systemd import Unit
from tests.unit.test_service_fake import Host, run

# as Linux 6.1 writes them (the VM lab's kernel)
PRESSURE = ("some avg10=12.50 avg60=3.05 avg300=0.70 total=1234567\n"
            "full avg10=1.00 avg60=0.25 avg300=0.05 total=23456\n")
CPU_STAT = ("usage_usec 5000000\nuser_usec 4000000\nsystem_usec 1000000\n"
            "core_sched.force_idle_usec 0\nnr_periods 100\nnr_throttled 40\n"
            "throttled_usec 2000000\nnr_bursts 0\nburst_usec 0\n")
NUMA_STAT = ("anon N0=4096 N1=12288\nfile N0=8192 N1=0\nkernel_stack N0=16384 N1=0\n"
             "shmem N0=0 N1=0\n")


def write_cgroup(root: Path, group: str, files: dict[str, str]) -> Path:
    path = root / group.lstrip("/")
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_the_parsers_read_the_kernels_files() -> None:
    assert parse_pressure(PRESSURE) == (Pressure(12.5, 3.05, 1234567), Pressure(1.0, 0.25, 23456))
    assert parse_cpu_stat(CPU_STAT) == CPUStat(5000000, 4000000, 1000000, 100, 40, 2000000)
    assert parse_numa_stat(NUMA_STAT) == {0: 12288, 1: 12288}


def test_a_cgroup_without_the_cpu_controller_has_no_periods() -> None:
    stat = parse_cpu_stat("usage_usec 10\nuser_usec 6\nsystem_usec 4\n")
    assert stat == CPUStat(10, 6, 4, None, None, None)


@pytest.mark.parametrize("text", [
    "", "some avg10=x avg60=0.00 avg300=0.00 total=1\n", "some avg10=0.00 total=1\n",
    "some avg10=101.00 avg60=0.00 avg300=0.00 total=1\n",
    "some avg10=1.00 avg60=0.00 avg300=0.00 total=-1\n", "garbage\n\0\n"])
def test_a_malformed_pressure_line_is_unknown(text: str) -> None:
    assert parse_pressure(text) == (None, None)


@pytest.mark.parametrize("text", ["", "anon N0=1\n", "anon N0=1 N1=x\nfile N0=1\n",
                                  "anon 0=1\nfile N0=1\n", "anon N0=1 Nx=2\nfile N0=1\n"])
def test_a_malformed_numa_stat_is_unknown(text: str) -> None:
    assert parse_numa_stat(text) is None


def test_the_reader_reads_a_fake_cgroup(tmp_path: Path) -> None:
    write_cgroup(tmp_path, "/a.slice/a-b.slice",
                 {"cpu.pressure": PRESSURE, "cpu.stat": CPU_STAT, "memory.numa_stat": NUMA_STAT})
    got = reader.read("/a.slice/a-b.slice", CPUSet([1]), tmp_path, lambda: 77)
    values = got.values()
    assert values["monotonic-usec"] == 77 and values["unreadable"] == []
    assert values["cpu-usage-usec"] == 5000000 and values["cpu-throttled-periods"] == 40
    assert values["cpu-pressure-some-avg10"] == 12.5
    assert values["cpu-pressure-full-total-usec"] == 23456
    assert (values["memory-local-bytes"], values["memory-remote-bytes"]) == (12288, 12288)
    assert values["memory-remote-percent"] == 50.0
    # without memory nodes, memory.numa_stat is not even read
    assert "memory-remote-percent" not in reader.read("/a.slice/a-b.slice", None,
                                                      tmp_path).values()
    assert set(values) <= set(SIGNATURES)


def test_missing_files_are_unknown_figures(tmp_path: Path) -> None:
    """A cgroup v1 or hybrid host (no cpu.pressure where the unit's cgroup is), a unit not
    yet realised (no directory), a memory controller not enabled (no memory.numa_stat)."""
    write_cgroup(tmp_path, "/hybrid.slice", {"cpu.stat": "usage_usec 5\n"})
    got = reader.read("/hybrid.slice", CPUSet([0]), tmp_path).values()
    assert got["cpu-usage-usec"] == 5 and "cpu-pressure-some-avg10" not in got
    assert got["unreadable"] == ["cpu.pressure", "memory.numa_stat"]
    none = reader.read("/not-yet.slice", CPUSet([0]), tmp_path).values()
    assert none["unreadable"] == ["cpu.pressure", "cpu.stat", "memory.numa_stat"]
    assert set(none) == {"monotonic-usec", "unreadable"}
    assert reader.read(None, None, tmp_path).values()["unreadable"] == ["cpu.pressure",
                                                                        "cpu.stat"]


@pytest.mark.parametrize("group", ["../etc", "/a/../../etc", "relative", "/a\0b"])
def test_a_path_that_leaves_the_hierarchy_is_not_read(tmp_path: Path, group: str) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/cpu.stat").write_text("usage_usec 1\n")
    root = tmp_path / "root"
    root.mkdir()
    assert "cpu-usage-usec" not in reader.read(group, None, root).values()


def test_a_link_in_place_of_a_file_is_not_followed(tmp_path: Path) -> None:
    write_cgroup(tmp_path, "/x.slice", {})
    (tmp_path / "secret").write_text("usage_usec 1\n")
    os.symlink(tmp_path / "secret", tmp_path / "x.slice/cpu.stat")
    assert "cpu-usage-usec" not in reader.read("/x.slice", None, tmp_path).values()


def test_slices_have_the_cgroups_systemd_gives_them() -> None:
    assert slice_cgroup("cpuservice-bound-web.slice") == \
        "/cpuservice.slice/cpuservice-bound.slice/cpuservice-bound-web.slice"
    assert slice_cgroup("cpuservice-shared-a\\x2db.slice") == \
        "/cpuservice.slice/cpuservice-shared.slice/cpuservice-shared-a\\x2db.slice"
    assert slice_cgroup("cpuservice_partition_x.slice") == "/cpuservice_partition_x.slice"
    for unit in ("app.service", "-.slice", "a--b.slice", "a/b.slice", "-a.slice"):
        assert slice_cgroup(unit) is None, unit


def test_rates_between_two_readings() -> None:
    before = {"monotonic-usec": 1_000_000, "cpu-usage-usec": 500_000, "cpu-periods": 10,
              "cpu-throttled-periods": 2, "cpu-throttled-usec": 0}
    after = {"monotonic-usec": 3_000_000, "cpu-usage-usec": 3_500_000, "cpu-periods": 30,
             "cpu-throttled-periods": 12, "cpu-throttled-usec": 400_000}
    r = rates(before, after)
    assert (r.cpus_used, r.throttled_percent, r.throttled_per_second) == (1.5, 50.0, 0.2)
    assert rates(None, after).cpus_used is None
    made_again = rates(after, before | {"monotonic-usec": 4_000_000})
    assert made_again.cpus_used is None and made_again.throttled_percent is None
    assert rates(after, after).cpus_used is None  # no time passed
    no_quota = rates(before | {"cpu-periods": 0, "cpu-throttled-periods": 0},
                     after | {"cpu-periods": 0, "cpu-throttled-periods": 0})
    assert no_quota.throttled_percent is None


def test_every_figure_has_one_signature() -> None:
    keys = [k for k, _, _ in FIGURES]
    assert len(keys) == len(set(keys)) and all(re.fullmatch(r"[a-z0-9-]+", k) for k in keys)


# ---- every figure equals a recomputation from the files ----

COUNT = st.integers(0, 2**63 - 1)
AVG = st.integers(0, 10000)  # hundredths of a percent, as the kernel prints them
NODES = st.integers(1, 4)


@st.composite
def cgroup_files(draw: Any) -> tuple[dict[str, str], CPUSet]:
    nodes = draw(NODES)
    files: dict[str, str] = {}
    if draw(st.booleans()):
        lines = [f"{kind} avg10={draw(AVG) / 100:.2f} avg60={draw(AVG) / 100:.2f} "
                 f"avg300={draw(AVG) / 100:.2f} total={draw(COUNT)}"
                 for kind in ("some", "full")[:draw(st.integers(1, 2))]]
        files["cpu.pressure"] = "\n".join(lines) + "\n"
    if draw(st.booleans()):
        keys = ["usage_usec", "user_usec", "system_usec"] + (
            ["nr_periods", "nr_throttled", "throttled_usec", "nr_bursts", "burst_usec"]
            if draw(st.booleans()) else [])
        files["cpu.stat"] = "".join(f"{k} {draw(COUNT)}\n" for k in keys)
    if draw(st.booleans()):
        files["memory.numa_stat"] = "".join(
            f"{k} " + " ".join(f"N{n}={draw(st.integers(0, 2**40))}" for n in range(nodes))
            + "\n" for k in ("anon", "file", "kernel_stack", "slab"))
    own = CPUSet(draw(st.sets(st.integers(0, nodes - 1), min_size=1)))
    return files, own


def recompute(files: dict[str, str], own: CPUSet) -> dict[str, Any]:
    """The figures, worked out from the files another way (regular expressions)."""
    out: dict[str, Any] = {}
    for kind in ("some", "full"):
        m = re.search(rf"^{kind} avg10=([\d.]+) avg60=([\d.]+) avg300=[\d.]+ total=(\d+)$",
                      files.get("cpu.pressure", ""), re.M)
        if m:
            out[f"cpu-pressure-{kind}-avg10"] = float(m[1])
            out[f"cpu-pressure-{kind}-avg60"] = float(m[2])
            out[f"cpu-pressure-{kind}-total-usec"] = int(m[3])
    names = {"usage_usec": "cpu-usage-usec", "user_usec": "cpu-user-usec",
             "system_usec": "cpu-system-usec", "nr_periods": "cpu-periods",
             "nr_throttled": "cpu-throttled-periods", "throttled_usec": "cpu-throttled-usec"}
    for key, value in re.findall(r"^(\w+) (\d+)$", files.get("cpu.stat", ""), re.M):
        if key in names:
            out[names[key]] = int(value)
    if "memory.numa_stat" in files:
        local = remote = 0
        for _, rest in re.findall(r"^(anon|file) (.*)$", files["memory.numa_stat"], re.M):
            for node, value in re.findall(r"N(\d+)=(\d+)", rest):
                if int(node) in own:
                    local += int(value)
                else:
                    remote += int(value)
        out["memory-local-bytes"], out["memory-remote-bytes"] = local, remote
        out["memory-remote-percent"] = 100 * remote / (local + remote) if local + remote else 0.0
    return out


@settings(max_examples=examples(80))
@given(cases=st.lists(cgroup_files(), min_size=1, max_size=4))
def test_every_figure_equals_a_recomputation_from_the_files(
        tmp_path_factory: pytest.TempPathFactory,
        cases: list[tuple[dict[str, str], CPUSet]]) -> None:
    root = tmp_path_factory.mktemp("cgroup")
    for i, (files, own) in enumerate(cases):
        write_cgroup(root, f"/g{i}.slice", files)
        got = reader.read(f"/g{i}.slice", own, root, lambda: 5).values()
        unreadable = got.pop("unreadable")
        assert got.pop("monotonic-usec") == 5
        want = recompute(files, own)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12), key
        assert ("cpu.pressure" in unreadable) == ("cpu.pressure" not in files)
        assert ("memory.numa_stat" in unreadable) == ("memory.numa_stat" not in files)


# ---- the allocations' cgroups ----

def test_statistics_reads_own_slices_and_foreign_units(tmp_path: Path) -> None:
    host = Host(tmp_path)
    cgroups = tmp_path / "cgroup"

    async def body() -> dict[str, dict[str, Any]]:
        svc = await host.service()
        await svc.allocate("web", "2", {"bind": True, "memory-nodes": True}, 0)
        await svc.allocate("batch", "0.5", {}, 0)
        host.fake.units["app.service"] = Unit("app.service")
        await svc.allocate("app", "1", {"bind": True, "unit": "app.service"}, 0)
        stats = Statistics(svc.engine, cgroups)
        write_cgroup(cgroups, slice_cgroup(svc.record("web").unit) or "",
                     {"cpu.stat": "usage_usec 7\n", "memory.numa_stat": NUMA_STAT,
                      "cpu.pressure": PRESSURE})
        write_cgroup(cgroups, "/app.service", {"cpu.stat": "usage_usec 9\n"})
        reads = host.fake.reads
        got = await stats.read(["web", "batch", "app", "nope", "web"])
        again = await stats.read(["app"])
        assert host.fake.reads - reads == 1  # the foreign unit's cgroup, asked once
        assert again["app"].values()["cpu-usage-usec"] == 9
        return {n: f.values() for n, f in got.items()}

    got = asyncio.run(body())
    assert sorted(got) == ["app", "batch", "web"]
    assert got["web"]["cpu-usage-usec"] == 7 and got["web"]["memory-remote-percent"] == 50.0
    assert got["app"]["cpu-usage-usec"] == 9
    assert got["batch"]["unreadable"] == ["cpu.pressure", "cpu.stat"]  # not realised yet


def test_a_foreign_units_cgroup_is_asked_again_when_it_cannot_be_read(tmp_path: Path) -> None:
    host = Host(tmp_path)

    async def body() -> None:
        svc = await host.service()
        host.fake.units["app.service"] = Unit("app.service")
        await svc.allocate("app", "1", {"bind": True, "unit": "app.service"}, 0)
        stats = Statistics(svc.engine, tmp_path / "cgroup")
        reads = host.fake.reads
        await stats.read(["app"])
        await stats.read(["app"])
        assert host.fake.reads - reads == 2

    run(body)
