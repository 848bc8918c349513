"""How each allocation fares (issue 39), step 3: the figures in the metrics file, labelled by
allocation, read from the kernel by the sampler only (every statistics_seconds), never
when the file is written for another change."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from cpuservice.daemon import metrics_file
from cpuservice.host import figure_metrics
from cpuservice.model import config as config_mod
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.figures import Figures, figures
from cpuservice.shell.statistics import Sampler, Statistics
from tests.unit.test_figures import CPU_STAT, NUMA_STAT, PRESSURE, write_cgroup
from tests.unit.test_service_fake import Host

WEB = "/cpuservice.slice/cpuservice-bound.slice/cpuservice-bound-web.slice"


def sample(nodes: CPUSet | None = None) -> Figures:
    texts = {"cpu.pressure": PRESSURE, "cpu.stat": CPU_STAT}
    if nodes is not None:
        texts["memory.numa_stat"] = NUMA_STAT
    return figures(1, texts, nodes)


def test_the_figures_are_labelled_by_allocation() -> None:
    text = figure_metrics.render({"web": sample(CPUSet([1])), "job": sample(),
                                  "gone": sample()}, ["web", "job", "new"], 0.25)
    lines = set(text.splitlines())
    assert 'cpuservice_allocation_cpu_usage_seconds_total{allocation="web"} 5' in lines
    assert 'cpuservice_allocation_cpu_periods_total{allocation="job"} 100' in lines
    assert 'cpuservice_allocation_cpu_throttled_periods_total{allocation="web"} 40' in lines
    assert 'cpuservice_allocation_cpu_throttled_seconds_total{allocation="web"} 2' in lines
    assert ('cpuservice_allocation_cpu_pressure_seconds_total{allocation="web",kind="some"} '
            '1.234567') in lines
    assert ('cpuservice_allocation_cpu_pressure_seconds_total{allocation="job",kind="full"} '
            '0.023456') in lines
    assert 'cpuservice_allocation_memory_remote_ratio{allocation="web"} 0.5' in lines
    assert not any('allocation="job"' in line for line in lines if "remote" in line)
    assert "gone" not in text  # released since the reading: gone from the file at once
    assert "cpuservice_statistics_read_seconds 0.25" in lines
    # six series per allocation, seven with memory nodes
    samples = [line for line in lines if line.startswith("cpuservice_allocation_")]
    assert len(samples) == 13


def test_unknown_figures_are_left_out() -> None:
    nothing = figures(1, {"cpu.pressure": None, "cpu.stat": None})
    text = figure_metrics.render({"a": nothing}, ["a"])
    assert not [line for line in text.splitlines() if not line.startswith("#")]
    assert "# TYPE cpuservice_allocation_cpu_usage_seconds_total counter" in text


def test_the_metrics_file_reads_the_kernel_only_when_the_sampler_does(tmp_path: Path) -> None:
    host = Host(tmp_path, metrics_file=str(tmp_path / "m" / "cpuservice.prom"))
    (tmp_path / "m").mkdir()
    root = tmp_path / "cgroup"

    async def body() -> tuple[str, str, int]:
        svc = await host.service()
        await svc.allocate("web", "2", {"bind": True}, 0)
        stats = Statistics(svc.engine, root)
        reads = []
        real = stats.read

        async def counted(names: object) -> dict[str, Figures]:
            reads.append(names)
            return await real(names)  # type: ignore[arg-type]

        stats.read = counted  # type: ignore[method-assign]
        sampler = Sampler(stats, host.cfg.statistics_seconds)
        textfile = metrics_file(host.cfg, svc, sampler)
        assert textfile is not None
        write_cgroup(root, WEB, {"cpu.pressure": PRESSURE, "cpu.stat": CPU_STAT})
        for _ in range(50):  # a burst of changes: the file is written, nothing read
            textfile.write()
        before = textfile.path.read_text()
        assert reads == []
        await sampler.sample()
        textfile.write()
        return before, textfile.path.read_text(), len(reads)

    before, after, reads = asyncio.run(body())
    assert reads == 1
    assert "cpuservice_allocation_cpu_usage_seconds_total{" not in before
    assert 'cpuservice_allocation_cpu_usage_seconds_total{allocation="web"} 5' in after
    assert re.search(r"^cpuservice_statistics_read_seconds [0-9.e-]+$", after, re.M)


def test_the_sampler_reads_every_interval_until_stopped(tmp_path: Path) -> None:
    host = Host(tmp_path)

    async def body() -> tuple[list[float], int]:
        svc = await host.service()
        await svc.allocate("a", "1", {}, 0)
        told: list[int] = []
        slept: list[float] = []
        sampler = Sampler(Statistics(svc.engine, tmp_path / "cg"), 15,
                          lambda: told.append(len(sampler.latest)))

        async def sleep(seconds: float) -> None:
            slept.append(seconds)
            if len(slept) == 3:
                await asyncio.Event().wait()

        sampler.sleep = sleep
        sampler.start()
        for _ in range(10):
            await asyncio.sleep(0)
        await sampler.shutdown()
        return slept, len(told)

    slept, told = asyncio.run(body())
    assert slept == [15, 15, 15] and told == 3


def test_zero_turns_the_figures_off(tmp_path: Path) -> None:
    cfg = config_mod.validate({"statistics_seconds": 0,
                               "state_file": str(tmp_path / "s.json")})
    assert cfg.statistics_seconds == 0
    assert config_mod.validate({"state_file": str(tmp_path / "s.json")}
                               ).statistics_seconds == 10
    text = (Path(__file__).parents[2] / "systemd/cpuservice.toml").read_text()
    assert "#statistics_seconds = 10\n" in text
