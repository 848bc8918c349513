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
from cpuservice.model.pools import Allocation, Ledger
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


async def _pool_swap(host: Host) -> Service:
    """Fixture d (CPUs 0-2, 4-5, 16, 18-21; cores {0,1} {2} {4,5} {16} {18,19} {20,21};
    20-21 isolated): a13 on 0-1 (not movable), a14 (spread-pcpus, movable) on 2 and 5, a15 on
    18-19, a2 on 20; the shared pool is 4 and 16, CPU 21 is free and isolated. A whole core
    for "x" (full-pcpus, 2) is made by moving a14 to 16 and 21: x takes 4-5 and the shared
    pool, which had 4 and 16, ends with 2 alone. The pool and a14 each wait for a CPU the
    other holds, and nothing else is free to pass through (found by a random run, issue 37
    item 2)."""
    svc = await host.service()
    ledger = ledger_for(svc.topology)
    records = {}
    for name, cpus, options in (("a13", "0-1", {}), ("a14", "2,5", {"movable": "anywhere",
                                                                      "policy": "spread-pcpus"}),
                                ("a15", "18-19", {"policy": "full-pcpus"}),
                                ("a2", "20", {})):
        held = CPUSet.parse(cpus)
        ledger = ledger.with_allocation(Allocation(name, bind(str(len(held)), **options), held))
        records[name] = Record(0, units.slice_name(name, True, "none"))
    await svc.engine.apply(Change(State(ledger, records), None))
    agree(svc, host.fake)
    assert svc.ledger.shared == CPUSet.parse("4,16")
    return svc


@pytest.mark.parametrize("confine", [False, True])
def test_a_move_that_swaps_cpus_with_the_shared_pool_never_double_books(
        tmp_path: Path, confine: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37 item 2: the moved allocation lands on the shared pool's CPUs and the pool takes
    its old ones, with no CPU free to pass through. The transaction used to be applied in name
    order (the new slice started on a CPU a14 still held; with confine_host, the host's slices
    kept a14's new CPU). Now the pool's holders first narrow to one CPU the move does not
    need, and no instant has an exclusive CPU in two units."""
    async def body() -> None:
        host = Host(tmp_path, machine="d", confine_host=confine)
        svc = await _pool_swap(host)
        mark, exclusive = host.fake.mark(), svc.ledger.exclusive
        big = await svc.allocate("x", "2", FULL2, 0)
        assert big.whole == CPUSet.parse("4-5")
        assert svc.ledger.allocations["a14"].whole == CPUSet.parse("16,21")
        assert svc.ledger.shared == CPUSet.parse("2")
        agree(svc, host.fake)
        check_window(host.fake, mark, exclusive | svc.ledger.exclusive)
        assert "pass through" not in caplog.text
    run(body)


def test_a_repack_passes_over_moves_with_no_safe_order(tmp_path: Path) -> None:
    """The service asks the engine whether each re-pack result can be applied in an order
    that keeps the ordering rule (Engine.orderable): a result it cannot is passed over for
    other moves; with none left the request is refused and nothing changes."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lone_threads(host)
        asked: list[int] = []
        real = svc.engine.orderable

        def p0_stays(ledger: Ledger, records: Any = None) -> bool:  # p0: the first choice
            asked.append(1)
            return real(ledger, records) and ledger.allocations["p0"].whole == CPUSet((0,))

        svc.engine.orderable = p0_stays  # type: ignore[method-assign]
        await svc.allocate("big", "2", FULL2, 0)
        assert asked and svc.ledger.allocations["p0"].whole == CPUSet((0,))
        assert any(svc.ledger.allocations[f"p{c}"].whole != CPUSet((c,)) for c in range(8))
        agree(svc, host.fake)
        svc.engine.orderable = lambda ledger, records=None: False  # type: ignore[method-assign]
        before, mark = svc.state, host.fake.mark()
        with pytest.raises(InsufficientCPUs):
            await svc.allocate("big2", "2", FULL2, 0)
        assert svc.state is before and host.fake.mark() == mark
    run(body)
