"""How each allocation fares (issue 39), step 2, without a bus: the Manager's GetStatistics
(bounded, in turn, unknown names left out), what ``status``, ``show`` and ``top`` make of the
figures, and that the interface description, the man pages and the completion name them all.
The same against a real dbus-daemon: tests/integration/test_cli_figures.py."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import DBusError

from cpuservice.bus.api import Manager
from cpuservice.cli import ctl_figures, ctl_top
from cpuservice.cli.ctl import parse
from cpuservice.cli.ctl_output import JsonMode
from cpuservice.model.figures import FIGURES, MAX_NAMES, show_name
from tests.unit.test_figures import CPU_STAT, NUMA_STAT, PRESSURE, write_cgroup
from tests.unit.test_service_fake import Host

ROOT = Path(__file__).parents[2]


def test_get_statistics_reads_the_named_allocations(tmp_path: Path) -> None:
    host = Host(tmp_path)

    async def body() -> dict[str, Any]:
        svc = await host.service()
        await svc.allocate("web", "2", {"bind": True, "memory-nodes": True}, 0)
        manager = Manager(svc, None, None)  # type: ignore[arg-type]

        async def uid_of(sender: str) -> int:  # (no bus to ask whose turn it is)
            return 0

        manager.uid_of = uid_of  # type: ignore[method-assign]
        manager.statistics.root = tmp_path / "cgroup"
        write_cgroup(manager.statistics.root,
                     "/cpuservice.slice/cpuservice-bound.slice/cpuservice-bound-web.slice",
                     {"cpu.pressure": PRESSURE, "cpu.stat": CPU_STAT,
                      "memory.numa_stat": NUMA_STAT})
        call = Manager.GetStatistics.__wrapped__  # (dbus-fast's wrapper answers on the bus)
        got = await call(manager, ["web", "nope"])
        with pytest.raises(DBusError) as refused:
            await call(manager, ["web"] * (MAX_NAMES + 1))
        assert refused.value.type == "org.cpuservice1.Error.InvalidArgument"
        assert f"at most {MAX_NAMES}" in refused.value.text
        assert manager.reads.turns.served == 2  # each call had its turn
        return got  # type: ignore[no-any-return]

    got = asyncio.run(body())
    assert list(got) == ["web"]
    web = got["web"]
    assert web["cpu-pressure-some-avg10"].signature == "d"
    assert web["cpu-pressure-some-avg10"].value == 12.5
    assert web["cpu-throttled-periods"].value == 40
    assert web["memory-remote-percent"].value == 50.0
    assert web["unreadable"].value == []


def test_status_says_what_is_known_and_what_is_not() -> None:
    f = {"monotonic-usec": 1, "cpu-usage-usec": 5_000_000, "cpu-user-usec": 4_000_000,
         "cpu-system-usec": 1_000_000, "cpu-periods": 100, "cpu-throttled-periods": 40,
         "cpu-throttled-usec": 2_000_000, "cpu-pressure-some-avg10": 12.5,
         "cpu-pressure-some-avg60": 3.05, "cpu-pressure-some-total-usec": 1_234_567,
         "cpu-pressure-full-avg10": 1.0, "cpu-pressure-full-avg60": 0.25,
         "cpu-pressure-full-total-usec": 23_456, "memory-local-bytes": 12288,
         "memory-remote-bytes": 12288, "memory-remote-percent": 50.0, "unreadable": []}
    lines = dict(ctl_figures.status_lines(f, "1"))
    assert lines["CPU"] == "5s (user 4s, system 1s)"
    assert lines["Pressure"] == ("some 12.50% 3.05%, full 1.00% 0.25% (avg10 avg60; waited "
                                 "1.235s in all)")
    assert lines["Throttled"] == "40 of 100 periods, 2s"
    assert lines["Remote memory"] == "50.0% (12.0K of 24.0K outside nodes 1)"
    no_quota = dict(ctl_figures.status_lines(f | {"cpu-periods": 0, "cpu-throttled-periods": 0},
                                             "1"))
    assert no_quota["Throttled"] == "never (no CPU quota)"
    unknown = dict(ctl_figures.status_lines(
        {"monotonic-usec": 1, "unreadable": ["cpu.pressure", "cpu.stat", "memory.numa_stat"]},
        "0"))
    assert unknown["Pressure"].startswith("unknown") and "Throttled" not in unknown
    assert unknown["Remote memory"].startswith("unknown")


def test_show_names_every_figure_in_systemds_manner() -> None:
    names = ctl_figures.SHOW_NAMES
    assert len(names) == len(FIGURES)
    assert names["CPUThrottledUSec"] == "cpu-throttled-usec"
    assert names["CPUPressureSomeAvg10"] == "cpu-pressure-some-avg10"
    assert ctl_figures.shown({"cpu-usage-usec": 3})["CPUUsageUSec"] == 3
    assert ctl_figures.shown(None)["MemoryRemotePercent"] is None


# ---- top ----

ALLOCATIONS = [
    {"Name": "a", "CPUs": "2", "CPUSet": "0-1", "LentCPUs": "", "Health": "ok"},
    {"Name": "b", "CPUs": "0.5", "CPUSet": "2-7", "LentCPUs": "", "Health": "ok"},
    {"Name": "c", "CPUs": "1", "CPUSet": "8", "LentCPUs": "8", "Health": "degraded",
     "HealthReason": "holds none"},
]


def reading(at: int, usage: dict[str, int], throttled: dict[str, int]) -> dict[str, Any]:
    return {n: {"monotonic-usec": at, "cpu-usage-usec": u, "cpu-periods": at // 100_000,
                "cpu-throttled-periods": throttled.get(n, 0),
                "cpu-pressure-some-avg10": {"a": 1.0, "b": 30.0}.get(n)}
            for n, u in usage.items()}


def test_top_rows_rates_and_orders() -> None:
    before = reading(1_000_000, {"a": 0, "b": 0, "c": 0}, {})
    after = reading(2_000_000, {"a": 1_500_000, "b": 500_000, "c": 10}, {"b": 5})
    rows = ctl_top.rows(ALLOCATIONS, before, after)
    by = {r.name: r for r in rows}
    assert by["a"].cpu_percent == 150.0 and by["b"].throttled == 50.0
    assert by["c"].pressure is None and by["c"].health == "degraded"
    assert [r.name for r in ctl_top.ordered(rows, "cpu")] == ["a", "b", "c"]
    assert [r.name for r in ctl_top.ordered(rows, "pressure")] == ["b", "a", "c"]
    assert [r.name for r in ctl_top.ordered(rows, "throttled")] == ["b", "a", "c"]
    assert [r.name for r in ctl_top.ordered(rows, "cpus")] == ["a", "c", "b"]
    first = ctl_top.rows(ALLOCATIONS, {}, after)
    assert all(r.cpu_percent is None and r.throttled is None for r in first)
    text = ctl_top.text(ctl_top.ordered(rows, "cpu")).splitlines()
    assert text[0].split() == ["NAME", "CPUS", "CPUSET", "%CPU", "PRESSURE%", "THROTTLED%",
                               "LENT", "HEALTH"]
    assert text[1].split() == ["a", "2", "0-1", "150.0", "1.00", "0.0", "-", "ok"]
    assert text[3].split() == ["c", "1", "8", "0.0", "-", "0.0", "8", "degraded"]


class FakeClient:
    """GetManagedObjects and GetStatistics as a daemon answers them, one reading per call."""

    def __init__(self) -> None:
        self.readings = [reading(1_000_000, {"a": 0, "b": 0, "c": 0}, {}),
                         reading(2_000_000, {"a": 2_000_000, "b": 0, "c": 0}, {})]
        self.calls: list[str] = []

    async def allocations(self) -> list[dict[str, Any]]:
        self.calls.append("GetManagedObjects")
        return ALLOCATIONS

    async def call(self, member: str, signature: str = "", body: Any = ()) -> list[Any]:
        self.calls.append(member)
        found = self.readings.pop(0)
        return [{n: v for n, v in found.items() if n in body[0]}]


def run_top(argv: list[str]) -> tuple[str, FakeClient, list[float]]:
    args = parse(["top", *argv])
    client, slept = FakeClient(), list[float]()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    out = io.StringIO()
    with redirect_stdout(out):
        assert asyncio.run(ctl_top.top(client, args, sleep)) == 0  # type: ignore[arg-type]
    return out.getvalue(), client, slept


def test_top_batch_prints_n_refreshes_delay_apart() -> None:
    out, client, slept = run_top(["-b", "-n", "2", "-d", "0.5"])
    tables = out.split("\n\n")
    assert len(tables) == 2 and slept == [0.5]
    assert client.calls == ["GetManagedObjects", "GetStatistics"] * 2
    assert tables[0].splitlines()[1].split()[3] == "-"  # no rate at the first refresh
    assert tables[1].splitlines()[1].split()[:4] == ["a", "2", "0-1", "200.0"]


def test_top_json_is_one_object_per_refresh() -> None:
    out, _, _ = run_top(["-b", "-n", "2", "-o", "json"])
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) == 2 and "realtime_usec" in docs[0]
    assert docs[0]["allocations"][0]["CPUPercent"] is None
    assert docs[1]["allocations"][0] == {
        "Name": "a", "CPUs": "2", "CPUSet": "0-1", "CPUPercent": 200.0,
        "PressureSomeAvg10": 1.0, "ThrottledPercent": 0.0, "LentCPUs": "", "Health": "ok",
        "HealthReason": ""}


@pytest.mark.parametrize("argv", [["-n", "0"], ["-d", "0"], ["-d", "x"], ["--order", "io"]])
def test_top_refuses_nonsense(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc, redirect_stdout(io.StringIO()):
        parse(["top", *argv])
    assert exc.value.code == 2


def test_top_names_the_health_reasons() -> None:
    from cpuservice.model import health
    text = health.describe(("pressured", "memory-remote"))
    assert ctl_top.health_word("degraded", text) == "pressured,memory-remote"
    assert ctl_top.health_word("degraded", "holds none of its 2 CPUs; " + text) == \
        "pressured,memory-remote,degraded"
    assert ctl_top.health_word("degraded", "holds none of its 2 CPUs") == "degraded"
    assert ctl_top.health_word("ok", "") == "ok"


def test_top_defaults() -> None:
    args = parse(["top"])
    assert (args.batch, args.iterations, args.delay, args.order) == (False, None, 1.0, "cpu")
    assert args.json_mode is JsonMode.OFF
    assert isinstance(args, argparse.Namespace)


# ---- the docs name them all ----

def test_the_interface_and_the_pages_name_every_figure() -> None:
    xml = (ROOT / "dbus/org.cpuservice1.xml").read_text()
    doc = re.search(r'<method name="GetStatistics">\s*<annotation [^>]*value="([^"]*)"', xml)
    assert doc, "GetStatistics is not described"
    api = (ROOT / "docs/man/org.cpuservice1.5.scd").read_text()
    completion = (ROOT / "scripts/completion/cpuservicectl").read_text()
    for key, sig, _ in FIGURES:
        assert f"{key} {sig} (" in doc[1], key
        assert f"*{key}*" in api, key
        assert re.search(rf"\b{show_name(key)}\b", completion), key
    assert f"At most {MAX_NAMES} names" in doc[1] and f"At most {MAX_NAMES} names" in api


@pytest.mark.parametrize("line,want", [
    ("cpuservicectl to", "top"),
    ("cpuservicectl top --o", "--order"),
    ("cpuservicectl top --order ", "pressure"),
    ("cpuservicectl show x -p CPUPress", "CPUPressureSomeAvg10"),
])
def test_completion_offers_top_and_the_figures(line: str, want: str) -> None:
    from tests.unit.test_docs import test_completion_completes
    test_completion_completes(line, want)
