"""Metrics (cpuservice.host.metrics): the Prometheus text rendered from the real service's state
(tests.unit.fake_systemd) and counters, checked line by line, and the textfile writer (atomic,
only on change, mode 0644, a missing directory skipped with one log line)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path

import pytest

from cpuservice.host import metrics
from cpuservice.shell.service import Service
from tests.unit.test_service_fake import BIND, Host, run

SAMPLE = re.compile(r'([a-z_]+)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf)')


def parse(text: str) -> dict[str, float]:
    """Sample name with labels -> value; every family has HELP and TYPE before its samples."""
    values: dict[str, float] = {}
    declared: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name.startswith("cpuservice_") and name not in declared, line
            declared[name] = ""
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("gauge", "counter", "histogram") and name in declared
            declared[name] = kind
        else:
            m = SAMPLE.fullmatch(line)
            assert m, line
            family = re.sub(r"_(bucket|sum|count)$", "", m[1]) \
                if declared.get(re.sub(r"_(bucket|sum|count)$", "", m[1])) == "histogram" \
                else m[1]
            assert declared.get(family), f"{line}: no TYPE before it"
            values[m[1] + (m[2] or "")] = float(m[3])
    return values


def text_of(svc: Service) -> str:
    return metrics.render(svc.topology, svc.state, svc.engine.counters, "9.9")


def test_metrics_follow_the_allocations(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        before = parse(text_of(svc))
        online = len(svc.ledger.online)
        assert before['cpuservice_info{version="9.9"}'] == 1
        assert before['cpuservice_pool_cpus{pool="shared"}'] == online
        assert before['cpuservice_allocations{bound="true",state="active"}'] == 0
        await svc.allocate("web", "2.5", BIND, 1000)
        await svc.allocate("batch", "1", {}, 0)
        held = svc.ledger.allocations["web"].held
        after = parse(text_of(svc))
        assert after['cpuservice_pool_cpus{pool="shared"}'] == online - len(held)
        assert after['cpuservice_pool_cpus{pool="exclusive"}'] == 2
        assert after['cpuservice_pool_cpus{pool="fragment"}'] == 1
        assert after['cpuservice_allocation_requested_cpus{allocation="web"}'] == 2.5
        assert after['cpuservice_allocation_cpus{allocation="web"}'] == 3
        assert after['cpuservice_allocation_cpus{allocation="batch"}'] == online - 3
        assert after[
            f'cpuservice_allocation_info{{allocation="web",cpus="{held.format()}",bound="true",'
            'unit="cpuservice-bound-web.slice",uid="1000",state="active",'
            'lifetime="persistent"}'] == 1
        assert after['cpuservice_allocations{bound="false",state="active"}'] == 1
        await svc.release("web")
        assert not any("web" in k for k in parse(text_of(svc)))
    run(body)


def test_requests_and_repairs_are_counted(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        counters = svc.engine.counters
        assert counters.repairs == {"startup": 1}
        counters.request("Allocate", "ok")
        counters.request("Allocate", "ok")
        counters.request("Allocate", "InsufficientCPUs")
        await svc.allocate("keep", "2", BIND, 0)
        host.offline(set(svc.ledger.allocations["keep"].whole))
        await svc.revalidate(full=False)
        values = parse(text_of(svc))
        assert values['cpuservice_requests_total{method="Allocate",result="ok"}'] == 2
        assert values[
            'cpuservice_requests_total{method="Allocate",result="InsufficientCPUs"}'] == 1
        assert values['cpuservice_repairs_total{trigger="hotplug"}'] == 1
        assert values['cpuservice_repaired_allocations_total{trigger="hotplug"}'] == 1
        assert values['cpuservice_repair_duration_seconds_count{trigger="hotplug"}'] == 1
        assert values['cpuservice_repair_duration_seconds_bucket{trigger="hotplug",le="+Inf"}'] \
            == 1
        assert values['cpuservice_repair_duration_seconds_bucket{trigger="hotplug",le="10"}'] == 1
    run(body)


def test_label_values_are_escaped() -> None:
    assert metrics._labels({"a": 'x"y\\z\nw'}) == '{a="x\\"y\\\\z\\nw"}'


def test_histogram_buckets_are_cumulative() -> None:
    h = metrics.Histogram()
    for v in (0.0005, 0.02, 3.0, 99.0):
        h.observe(v)
    counts = dict(zip(metrics.BUCKETS, h.counts, strict=True))
    assert (counts[0.001], counts[0.025], counts[5.0], counts[10.0], h.count) == (1, 2, 3, 3, 4)


def test_textfile_writes_atomically_and_only_on_change(tmp_path: Path) -> None:
    text = ["a 1\n"]
    path = tmp_path / "cpuservice.prom"
    out = metrics.Textfile(str(path), lambda: text[0])
    assert out.write()
    assert path.read_text() == "a 1\n" and path.stat().st_mode & 0o777 == 0o644
    inode = path.stat().st_ino
    assert out.write() and path.stat().st_ino == inode  # same text: not written again
    text[0] = "a 2\n"
    assert out.write() and path.stat().st_ino != inode  # renamed over, never rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpuservice.prom"]
    out.remove()
    assert not path.exists()


def test_textfile_coalesces_a_burst(tmp_path: Path) -> None:
    renders = []

    def render() -> str:
        renders.append(1)
        return "a 1\n"

    async def body() -> None:
        out = metrics.Textfile(str(tmp_path / "x.prom"), render, delay=0.01)
        for _ in range(10):
            out.changed()
        await asyncio.sleep(0.1)

    asyncio.run(body())
    assert len(renders) == 1 and (tmp_path / "x.prom").exists()


def test_writing_spends_a_budget_that_fills_at_a_small_share_of_the_time(tmp_path: Path) -> None:
    now, cpu, cost = [100.0], [0.0], [1.0]

    def render() -> str:  # rendering takes cost[0] s of CPU, and as long by the clock
        now[0] += cost[0]
        cpu[0] += cost[0]
        return f"a {now[0]}\n"

    async def body() -> list[float]:
        out = metrics.Textfile(str(tmp_path / "x.prom"), render, delay=0.2,
                               clock=lambda: now[0], cpu=lambda: cpu[0])
        loop = asyncio.get_running_loop()
        waits = []

        def change() -> None:
            out.changed()
            assert out._pending is not None
            waits.append(out._pending.when() - loop.time())
            out._pending.cancel()
            out._pending = None

        change()  # the first write: after the short delay, whatever it costs
        assert out.write()  # it cost 1 s, BUDGET (0.25 s) less: 0.75 s owed
        now[0] += 5.0  # 5 s later (0.25 s of it back) a change waits until it is paid
        change()
        now[0] += 100.0  # after a quiet while the budget is full again
        change()
        cost[0] = metrics.BUDGET / 20  # cheap writes, ten at once, stay within it
        for _ in range(10):
            assert out.write()
        change()
        cost[0] = 1.0  # no more than BUDGET was kept from the quiet while: a costly write
        assert out.write()  # is paid for again
        change()
        return waits

    first, second, third, fourth, fifth = asyncio.run(body())
    assert abs(first - 0.2) < 0.05
    assert abs(second - 0.5 / metrics.MAX_SHARE) < 0.05  # 10 s
    assert abs(third - 0.2) < 0.05 and abs(fourth - 0.2) < 0.05
    assert fifth > 0.75 / metrics.MAX_SHARE  # > 15 s


def test_a_missing_directory_is_skipped_with_one_line(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cpuservice.host.metrics")
    out = metrics.Textfile(str(tmp_path / "none/cpuservice.prom"), lambda: "a 1\n")
    assert not out.write() and not out.write()
    assert len(caplog.records) == 1 and "does not exist" in caplog.records[0].getMessage()
    (tmp_path / "none").mkdir()  # the node exporter was installed meanwhile
    assert out.write() and (tmp_path / "none/cpuservice.prom").exists()


def test_textfile_never_follows_a_planted_link(tmp_path: Path) -> None:
    """Issue 25 item 10: the temp file had a predictable name and was opened without O_EXCL or
    O_NOFOLLOW, so the owner of the textfile directory (prometheus on Debian 12) could make root
    truncate, overwrite and chmod 0644 any file through a symlink. Now every predictable name
    and the directory itself may be links to a victim: the victim stays as it was."""
    victim = tmp_path / "shadow"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    directory = tmp_path / "textfiles"
    directory.mkdir()
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old predictable names
        (directory / f".cpuservice.prom.{pid}.tmp").symlink_to(victim)
    out = metrics.Textfile(str(directory / "cpuservice.prom"), lambda: "a 1\n")
    assert out.write()
    assert victim.read_text() == "secret\n" and victim.stat().st_mode & 0o777 == 0o600
    assert (directory / "cpuservice.prom").read_text() == "a 1\n"
    (directory / "cpuservice.prom").unlink()
    (directory / "cpuservice.prom").symlink_to(victim)  # the target itself: replaced, not followed
    assert metrics.Textfile(str(directory / "cpuservice.prom"), lambda: "a 2\n").write()
    assert victim.read_text() == "secret\n" and not (directory / "cpuservice.prom").is_symlink()
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path)  # a directory swapped for a link: refused
    assert not metrics.Textfile(str(linked / "shadow"), lambda: "x\n").write()
    assert victim.read_text() == "secret\n" and victim.stat().st_mode & 0o777 == 0o600
