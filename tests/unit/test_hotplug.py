"""The debouncer that turns a burst of CPU uevents into one repair."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from pathlib import Path

from cpuservice.host.hotplug import Debouncer
from cpuservice.host.sysfs import discover
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixtures import MACHINES, write_sysfs


def _run(scenario, repair_seconds: float = 0.03) -> list[float]:  # type: ignore[no-untyped-def]
    calls: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def settled() -> None:
            calls.append(loop.time())
            await asyncio.sleep(repair_seconds)

        await scenario(Debouncer(settled, delay=0.02))
        await asyncio.sleep(1.0)

    asyncio.run(main())
    return calls


def test_a_burst_settles_once() -> None:
    async def burst(d: Debouncer) -> None:
        for _ in range(50):
            d.notify()
            await asyncio.sleep(0)

    assert len(_run(burst)) == 1


def test_quiet_gaps_make_separate_repairs() -> None:
    async def spaced(d: Debouncer) -> None:
        d.notify()
        await asyncio.sleep(0.1)
        d.notify()

    assert len(_run(spaced)) == 2


def test_events_during_a_repair_make_one_more() -> None:
    async def overlapping(d: Debouncer) -> None:
        d.notify()
        await asyncio.sleep(0.1)  # the repair (20 ms to 420 ms) is running
        for _ in range(5):
            d.notify()
            await asyncio.sleep(0)
        await asyncio.sleep(0.1)
        d.notify()

    calls = _run(overlapping, repair_seconds=0.4)
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.4


def test_fixture_rewrite_follows_offline_and_online(tmp_path: Path) -> None:
    machine = MACHINES["b"]
    write_sysfs(tmp_path, machine)
    before = discover(tmp_path)
    write_sysfs(tmp_path, dataclasses.replace(machine, offline=frozenset({3, 11})))
    down = discover(tmp_path, previous=before)
    assert down.online == CPUSet.parse("0-2,4-10,12-15")
    assert down.cpus[11].core == before.cpus[11].core and not down.cpus[11].online
    write_sysfs(tmp_path, machine)
    assert discover(tmp_path, previous=down) == before


def test_refresh_reads_little_and_matches_discover(tmp_path: Path) -> None:
    from cpuservice.host.sysfs import refresh

    machine = MACHINES["c"]
    write_sysfs(tmp_path, machine)
    before = discover(tmp_path)
    for offline in ({5, 69}, {1}, set()):
        write_sysfs(tmp_path, dataclasses.replace(machine, offline=frozenset(offline)))
        fast = refresh(tmp_path, before)
        assert fast == discover(tmp_path, previous=before)
        before = fast


def test_refresh_falls_back_when_a_cpu_comes_back_elsewhere(tmp_path: Path) -> None:
    from cpuservice.host.sysfs import refresh

    write_sysfs(tmp_path, dataclasses.replace(MACHINES["b"], offline=frozenset({3})))
    down = discover(tmp_path)
    write_sysfs(tmp_path, MACHINES["b"])
    (tmp_path / "devices/system/cpu/cpu3/topology/physical_package_id").write_text("1\n")
    assert refresh(tmp_path, down) == discover(tmp_path, previous=down)


def test_a_failed_repair_is_tried_again_with_backoff() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        calls: list[float] = []

        async def settled() -> None:
            calls.append(loop.time())
            if len(calls) < 4:
                raise RuntimeError("systemd refused")

        d = Debouncer(settled, delay=0.01, retry=0.05, retry_max=0.1)
        d.notify()
        await asyncio.sleep(0.6)
        return calls

    calls = asyncio.run(main())
    assert len(calls) == 4  # three failures, then success, then nothing more
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.1
