"""Movable allocations in the service (issue 27): a request refused only for fragmentation is
placed after moving movable allocations, in one transaction with it (the fake systemd's
timeline: no CPU in two bound slices at any instant; a failure and a crash at every step);
AllocationMoved and the journal announce each move; the per-hour limit; Defragment and
SetMovable."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cpuservice.apply import units
from cpuservice.apply.audit import Kind
from cpuservice.apply.audit import Recorder as AuditRecorder
from cpuservice.apply.change import Change
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs, InvalidArgument, SystemdFailure
from cpuservice.model.pools import Allocation
from cpuservice.model.state import Record, State
from cpuservice.placement.defrag import whole_free_cores
from cpuservice.shell.service import Service
from tests.unit.fake_systemd import Crash
from tests.unit.helpers import bind, ledger_for
from tests.unit.test_service_fake import Host, agree, check_window, run

FULL2 = {"bind": True, "policy": "full-pcpus"}


async def lone_threads(host: Host, movable: str = "node", **settings: Any) -> Service:
    """Fixture b (2 nodes x 4 cores x 2 threads; CPU n and n+8 are siblings): movable one-CPU
    allocations p0-p7 on CPUs 0-7, one thread of every core, as systemd holds them. CPUs
    8-15 are free (the shared pool), no core is."""
    svc = await host.service()
    ledger = ledger_for(svc.topology)
    records = {}
    for cpu in range(8):
        name = f"p{cpu}"
        ledger = ledger.with_allocation(Allocation(name, bind("1", movable=movable),
                                                   CPUSet((cpu,))))
        records[name] = Record(0, units.slice_name(name, True, "none"))
    await svc.engine.apply(Change(State(ledger, records), None))
    agree(svc, host.fake)
    return svc


def test_a_request_refused_for_fragmentation_is_placed_after_a_move(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lone_threads(host)
        svc.engine.audit = rec = AuditRecorder()
        before = dict(svc.ledger.allocations)
        mark, exclusive = host.fake.mark(), svc.ledger.exclusive
        host.events.seen.clear()
        big = await svc.allocate("big", "2", FULL2, 0)
        assert svc.topology.whole_cores(big.whole) == big.whole and len(big.whole) == 2
        moved = [n for n, a in svc.ledger.allocations.items()
                 if n in before and a.whole != before[n].whole]
        assert len(moved) == 1  # the fewest: one CPU of one allocation
        (name,) = moved
        old, new = before[name].whole.format(), svc.ledger.allocations[name].whole.format()
        kinds = [k for k, _ in host.events.seen]
        assert ("moved", (name, old, new)) in host.events.seen
        assert kinds.index("moved") < kinds.index("changed")
        assert ("changed", (name, {"CPUSet": new})) in host.events.seen or any(
            k == "changed" and v[0] == name and v[1].get("CPUSet") == new
            for k, v in host.events.seen)
        journal = {(e.kind, e.allocation): dict(e.extra) for e in rec.events}
        assert journal[(Kind.MOVED, name)] == {"OLD": old, "NEW": new}
        assert (Kind.ALLOCATED, "big") in journal
        agree(svc, host.fake)
        check_window(host.fake, mark, exclusive | svc.ledger.exclusive)
        again = await host.service()  # the checkpoint has the moves too
        assert again.ledger.allocations == svc.ledger.allocations
    run(body)


def test_nothing_moves_that_is_not_movable(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lone_threads(host, movable="no")
        before = svc.state
        with pytest.raises(InsufficientCPUs):
            await svc.allocate("big", "2", FULL2, 0)
        assert svc.state is before
    run(body)


def test_the_moves_per_hour_are_limited(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, max_moves_per_allocation_per_hour=0)
        svc = await lone_threads(host)
        with pytest.raises(InsufficientCPUs):
            await svc.allocate("big", "2", FULL2, 0)
        host2 = Host(tmp_path / "one", max_moves_per_allocation_per_hour=1)
        svc = await lone_threads(host2)
        await svc.allocate("big", "2", FULL2, 0)
        (moved,) = svc.admission.moves._moves
        assert not svc.admission.moves.allowed(moved)
        assert svc.admission.moves.allowed("p0" if moved != "p0" else "p1")
    run(body)


def _steps(tmp: Path) -> int:
    async def body() -> int:
        host = Host(tmp)
        svc = await lone_threads(host)
        before = host.fake.calls
        await svc.allocate("big", "2", FULL2, 0)
        return host.fake.calls - before
    return asyncio.run(body())


def test_a_failure_or_a_crash_at_every_step_of_a_repack(tmp_path: Path) -> None:
    steps = _steps(tmp_path / "count")
    assert steps >= 3  # the shared pool, the moved slice, the new slice
    for n in range(1, steps + 1):
        for crash in (False, True):
            async def body(n: int = n, crash: bool = crash) -> None:
                host = Host(tmp_path / f"{'crash' if crash else 'fail'}{n}")
                svc = await lone_threads(host)
                before, mark = svc.state, host.fake.mark()
                exclusive = svc.ledger.exclusive | CPUSet(range(16))  # whatever moves
                host.fake.fail_at(n, Crash() if crash else None)
                with pytest.raises(Crash if crash else SystemdFailure):
                    await svc.allocate("big", "2", FULL2, 0)
                host.fake.fail_at(10**6)
                if crash:
                    svc = await host.service()
                    assert "big" in svc.ledger.allocations  # durable before systemd
                else:
                    assert svc.state == before
                agree(svc, host.fake)
                check_window(host.fake, mark, exclusive - svc.ledger.shared)
            run(body)


def test_defragment(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lone_threads(host)
        assert whole_free_cores(svc.topology, svc.ledger) == []
        state, mark = svc.state, host.fake.mark()
        planned = await svc.defragment(dry_run=True)
        assert planned and svc.state is state and host.fake.mark() == mark
        exclusive = svc.ledger.exclusive
        host.events.seen.clear()
        moves = await svc.defragment(dry_run=False)
        assert [(m.name, m.new) for m in moves] == [(m.name, m.new) for m in planned]
        assert len(whole_free_cores(svc.topology, svc.ledger)) >= len(moves)
        assert sum(k == "moved" for k, _ in host.events.seen) == len(moves)
        agree(svc, host.fake)
        check_window(host.fake, mark, exclusive | svc.ledger.exclusive)
        await svc.allocate("big", "2", FULL2, 0)  # now without a move
        assert svc.ledger.allocations.keys() - {"big"} == {f"p{c}" for c in range(8)}
    run(body)


def test_set_movable(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lone_threads(host)
        await svc.set_movable("p3", "anywhere")
        assert svc.ledger.allocations["p3"].request.options.movable == "anywhere"
        assert ("changed", ("p3", {"Movable": "anywhere"})) in host.events.seen
        for bad in ("sometimes", ""):
            with pytest.raises(InvalidArgument):
                await svc.set_movable("p3", bad)
        await svc.allocate("u", "1", {}, 0)
        with pytest.raises(InvalidArgument):
            await svc.set_movable("u", "node")  # unbound: nothing to move
        for cpu in range(8):
            await svc.set_movable(f"p{cpu}", "no")
        with pytest.raises(InsufficientCPUs):
            await svc.allocate("big", "2", FULL2, 0)
        again = await host.service()
        assert again.ledger.allocations["p3"].request.options.movable == "no"
    run(body)
