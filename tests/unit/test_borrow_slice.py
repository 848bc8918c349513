"""The borrow slice exists only while a borrower does (issue 40): a host that never borrows has
one holder of the shared pool less to write on every change of it. It is started with the first
borrower, before the borrower's own slice, and stopped with the last, in the same transactions;
a failure undoes it with the rest, a restart finds it and stops it when nobody borrows."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.apply import units
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import SystemdFailure
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import Request
from tests.props import examples
from tests.unit.fake_systemd import BORROW, Crash, Unit
from tests.unit.test_service_fake import Host, agree, run

CHILD = "cpuservice-borrow-b.slice"


def test_no_borrower_no_borrow_slice_and_no_write_of_it(tmp_path: Path) -> None:
    """A bound Allocate and Release with nobody borrowing write the shared slice and the
    allocation's slice, nothing else."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        mark = host.fake.mark()
        await svc.allocate("a", "2", {"bind": True}, 0)
        await svc.release("a")
        touched = {w.unit for w in host.fake.writes[mark[1]:]}
        assert touched == {"cpuservice-shared.slice", "cpuservice-bound-a.slice"}
        assert BORROW not in host.fake.units
    run(body)


def test_the_first_borrower_starts_it_first_and_the_last_stops_it(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        await svc.allocate("o", "2", {"bind": True, "lend": True}, 0)
        mark = host.fake.mark()
        await svc.allocate("b", "1", {"borrow": True}, 0)
        starts = [w.unit for w in host.fake.writes[mark[1]:] if w.member == "StartTransientUnit"]
        assert starts == [BORROW, CHILD]  # the parent first: systemd would make it bare
        unit = host.fake.units[BORROW]
        assert unit.transient and unit.props["CPUWeight"] == units.CPU_WEIGHT_IDLE
        assert host.fake.cpus(BORROW) == svc.ledger.shared
        await svc.allocate("b2", "1", {"borrow": True}, 0)
        mark = host.fake.mark()
        await svc.release("b")
        assert BORROW in host.fake.units  # b2 still borrows
        assert not [w for w in host.fake.writes[mark[1]:] if w.unit == BORROW]
        mark = host.fake.mark()
        await svc.release("b2")
        stops = [w.unit for w in host.fake.writes[mark[1]:] if w.member == "StopUnit"]
        assert stops[-2:] == ["cpuservice-borrow-b2.slice", BORROW], stops  # release: twice
        assert BORROW not in host.fake.units
        # and a change of the shared pool with nobody borrowing writes nothing to it
        mark = host.fake.mark()
        await svc.resize("o", "3")
        assert BORROW not in {w.unit for w in host.fake.writes[mark[1]:]}
        agree(svc, host.fake)
    run(body)


def test_a_failed_first_borrower_leaves_no_borrow_slice(tmp_path: Path) -> None:
    """systemd refuses the borrower's slice: the borrow slice started for it is stopped again."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        plan = svc.engine.plan((svc.topology, svc.state), (svc.topology, svc.state), ())
        assert all(op.unit != BORROW for op in plan.ops)
        host.fake.fail_at(2, SystemdFailure("systemd refused StartTransientUnit: injected"))
        with pytest.raises(SystemdFailure):
            await svc.allocate("b", "1", {"borrow": True}, 0)
        assert "b" not in svc.ledger.allocations
        assert BORROW not in host.fake.units
        agree(svc, host.fake)
    run(body)


def test_a_restart_keeps_it_while_somebody_borrows_and_stops_a_leftover(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        await svc.allocate("b", "1", {"borrow": True}, 0)
        mark = host.fake.mark()
        svc = await host.service()  # a restart finds it as it should be: nothing to write
        assert not [w for w in host.fake.writes[mark[1]:] if w.unit in (BORROW, CHILD)]
        await svc.release("b")
        # a borrow slice left by a daemon killed between the two stops, or an older install's
        host.fake.units[BORROW] = Unit(BORROW, {"AllowedCPUs": b"\xff\xff"}, transient=True)
        svc = await host.service()
        assert BORROW not in host.fake.units
        agree(svc, host.fake)
    run(body)


def test_a_crash_between_the_starts_recovers(tmp_path: Path) -> None:
    """kill -9 after the borrow slice started, before the borrower's: the restart stops it (the
    checkpoint has no borrower) or the borrower is there and it stays."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        host.fake.fail_at(2, Crash())
        with pytest.raises(Crash):
            await svc.allocate("b", "1", {"borrow": True}, 0)
        host.fake.fail_at(10**6)
        svc = await host.service()
        borrows = "b" in svc.ledger.allocations
        assert (BORROW in host.fake.units) == borrows
        agree(svc, host.fake)
    run(body)


@settings(max_examples=examples(200))
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["borrow", "unbound", "bound", "-"])),
                max_size=40))
def test_the_carried_borrower_count_is_a_recount(steps: list[tuple[int, str]]) -> None:
    """Ledger.borrowers, carried from ledger to ledger, equals a count over a fresh ledger."""
    ledger = Ledger(CPUSet.parse("0-7"))
    _ = ledger.borrowers  # computed once, then carried
    for n, kind in steps:
        name = f"a{n}"
        if kind == "-":
            if name in ledger.allocations:
                ledger = ledger.without(name)
            continue
        options = {"borrow": True} if kind == "borrow" else {"bind": kind == "bound"}
        held = CPUSet([n]) if kind == "bound" else CPUSet()
        if kind == "bound" and any(n in a.whole for a in ledger.bound.values()
                                   if a.name != name):
            continue
        ledger = ledger.with_allocation(Allocation(name, Request.parse("1", options), held))
        assert "borrowers" in ledger.__dict__
        fresh = Ledger(ledger.online, allocations=ledger.allocations)
        assert ledger.borrowers == fresh.borrowers
