"""Lending through the one transaction (issue 26): the borrow slice is a holder of the shared
pool whose AllowedCPUs also has the CPUs lent now; lending grows it, withdrawing shrinks it
first; the fake systemd's timeline never sees a CPU in the borrow slice and any bound slice but
its lender's; a failure and a crash at every step of lend, withdraw and release-while-lent."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from cpuservice.apply import reconcile
from cpuservice.apply.change import Change
from cpuservice.apply.reconcile import UnitSpec, plan
from cpuservice.model import lending
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import SystemdFailure
from cpuservice.model.state import State
from cpuservice.shell.service import Service
from tests.unit.fake_systemd import BORROW, Crash, Unit, violations
from tests.unit.test_reconcile import Recorder
from tests.unit.test_service_fake import Host, agree, check_window, run

LEND = {"bind": True, "lend": True}
OWNER = "cpuservice-bound-o.slice"


def _spec(cpus: str, own: bool = True) -> UnitSpec:
    return UnitSpec({"AllowedCPUs": ("ay", CPUSet.parse(cpus).to_mask())}, own=own)


def test_lending_grows_the_borrow_slice_alone() -> None:
    before = {"cpuservice-shared.slice": _spec("0-3", False), BORROW: _spec("0-3", False),
              OWNER: _spec("4-7")}
    after = {**before, BORROW: _spec("0-7", False)}
    tx = plan(before, after, CPUSet.parse("4-7"), CPUSet.parse("4-7"), BORROW)
    assert [str(op) for op in tx.ops] == [f"set {BORROW} AllowedCPUs=0-7"]


def test_withdrawing_shrinks_the_borrow_slice_first() -> None:
    before = {"cpuservice-shared.slice": _spec("0-1", False), BORROW: _spec("0-1,4-7", False),
              OWNER: _spec("4-7"), "cpuservice-bound-n.slice": _spec("2")}
    # the owner busy again, and a new allocation on CPU 3 in the same change
    after = {**before, BORROW: _spec("0-1", False), "cpuservice-shared.slice": _spec("0-1", False),
             "cpuservice-bound-n.slice": _spec("2-3")}
    before = {**before, "cpuservice-shared.slice": _spec("0-1,3", False),
              BORROW: _spec("0-1,3-7", False)}
    exclusive = CPUSet.parse("2-7")
    tx = plan(before, after, exclusive, CPUSet.parse("4-7"), BORROW)
    assert tx.ops[0].unit in (BORROW, "cpuservice-shared.slice")
    assert [op.unit for op in tx.ops].index(BORROW) < [op.unit for op in tx.ops].index(
        "cpuservice-bound-n.slice")
    rec = Recorder(before)
    asyncio.run(reconcile.execute(tx, rec))
    assert rec.timeline[-1][BORROW] == CPUSet.parse("0-1")


def test_no_unit_passes_through_a_lent_cpu() -> None:
    """Two bound slices swap CPUs while CPUs 6-7 are lent: they pass through the shared
    pool's CPUs, never through a lent one (its owner holds it)."""
    before = {"cpuservice-shared.slice": _spec("0", False), BORROW: _spec("0,6-7", False),
              "cpuservice-bound-a.slice": _spec("1-2"), "cpuservice-bound-b.slice": _spec("3-4"),
              OWNER: _spec("6-7")}
    after = {**before, "cpuservice-bound-a.slice": _spec("3-4"),
             "cpuservice-bound-b.slice": _spec("1-2")}
    def passes_through_lent(tx: reconcile.Transaction) -> bool:
        rec = Recorder(before)
        asyncio.run(reconcile.execute(tx, rec))
        return any(now[u] & CPUSet.parse("6-7") for now in rec.timeline
                   for u in ("cpuservice-bound-a.slice", "cpuservice-bound-b.slice"))

    assert not passes_through_lent(plan(before, after, CPUSet.parse("1-4,6-7"),
                                        CPUSet.parse("6-7"), BORROW))
    # what plan() guards against: lent CPUs taken for CPUs nobody holds exclusively
    assert passes_through_lent(plan(before, after, CPUSet.parse("1-4")))


def test_a_lent_cpu_is_shared_with_the_borrow_slice_only() -> None:
    """Review of issue 26: the owner moves off its lent core (which goes back to the shared
    pool) and a foreign unit that follows the pool, sorting before the owner's slice, gains
    it: it waits for the owner to give it up. Only the borrow slice may hold a lent CPU
    together with its owner."""
    before = {"app.service": _spec("0-1", False), "cpuservice-shared.slice":
              _spec("0-1", False), BORROW: _spec("0-1,4-5", False), OWNER: _spec("4-5")}
    after = {"app.service": _spec("0-1,4-5", False), "cpuservice-shared.slice":
             _spec("0-1,4-5", False), BORROW: _spec("0-1,4-5", False), OWNER: _spec("2-3")}
    tx = plan(before, after, CPUSet.parse("2-5"), CPUSet.parse("4-5"), BORROW)
    rec = Recorder(before)
    asyncio.run(reconcile.execute(tx, rec))
    for now in rec.timeline:
        for cpu in CPUSet.parse("4-5"):
            holders = {u for u, cpus in now.items() if cpu in cpus} - {BORROW}
            assert len(holders) <= 1 or OWNER not in holders, [str(op) for op in tx.ops]


# ---- through the engine, on the fake systemd ----


async def lender(host: Host, cpus: str = "4") -> Service:
    """Fixture b (CPU n and n+8 are siblings): allocation o lends (4 CPUs: cores 0 and 1),
    a borrower b runs on the shared pool."""
    svc = await host.service()
    await svc.allocate("o", cpus, LEND, 0)
    await svc.allocate("b", "2", {"borrow": True}, 0)
    agree(svc, host.fake)
    return svc


def lent_map(svc: Service, *names: str) -> dict[int, str]:
    """cpu -> the unit of the allocation that may lend it (what the timeline may show)."""
    out: dict[int, str] = {}
    for name in names:
        a = svc.ledger.allocations[name]
        out.update(dict.fromkeys(lending.lendable(svc.topology, a), svc.record(name).unit))
    return out


async def lend(svc: Service, name: str = "o") -> None:
    async with svc.lock:
        a = svc.ledger.allocations[name]
        new = lending.with_lent(svc.state, {name: lending.lendable(svc.topology, a)})
        await svc.engine.apply(Change(new, frozenset({name}), {name: "lent"}))


async def withdraw(svc: Service, name: str = "o") -> None:
    async with svc.lock:
        new = lending.with_lent(svc.state, {name: EMPTY})
        await svc.engine.apply(Change(new, frozenset({name}), {name: "withdrawn"}))


def test_the_borrow_slice_holds_the_shared_pool_and_what_is_lent(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        fake = host.fake
        assert svc.record("b").unit == "cpuservice-borrow-b.slice"
        assert "cpuservice-borrow-b.slice" in fake.units
        assert fake.cpus(BORROW) == svc.ledger.shared
        o = svc.ledger.allocations["o"]
        assert lending.lendable(svc.topology, o) == o.whole
        mark, exclusive = fake.mark(), svc.ledger.exclusive
        await lend(svc)
        assert fake.cpus(BORROW) == svc.ledger.shared | o.whole
        assert fake.writes[mark[1]:] and {w.unit for w in fake.writes[mark[1]:]} == {BORROW}
        agree(svc, fake)
        assert violations(fake.timeline[mark[0]:], exclusive)  # the owner's and borrowed
        check_window(fake, mark, exclusive, lent=lent_map(svc, "o"))
        mark = fake.mark()
        await withdraw(svc)
        assert fake.writes[mark[1]].unit == BORROW  # the borrow slice shrinks first
        assert fake.cpus(BORROW) == svc.ledger.shared
        agree(svc, fake)
        assert not violations(fake.timeline[mark[0] + 1:], exclusive)
    run(body)


def test_releasing_a_lending_owner_never_lends_to_the_next_owner(tmp_path: Path) -> None:
    """The owner is released while its cores are lent, and a new bound allocation takes the
    same CPUs: at no instant is a CPU in the borrow slice and the new owner's slice."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await lend(svc)
        cpus = svc.ledger.allocations["o"].whole
        mark = host.fake.mark()
        lent = lent_map(svc, "o")
        await svc.release("o")
        assert host.fake.cpus(BORROW) == svc.ledger.shared  # no longer lent: shared
        await svc.allocate("n", str(len(cpus)), {"bind": True}, 0)
        assert svc.ledger.allocations["n"].whole == cpus
        assert not host.fake.cpus(BORROW) & cpus
        agree(svc, host.fake)
        # the old owner's unit may share them with the borrow slice, nobody else
        check_window(host.fake, mark, cpus, lent=lent)
        assert svc.record("n").lent == EMPTY
    run(body)


def test_a_resize_needs_no_special_case(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await lend(svc)
        mark, before = host.fake.mark(), svc.ledger.allocations["o"].whole
        lent = lent_map(svc, "o")
        await svc.resize("o", "2")  # one core left: the other is shared again
        after = svc.ledger.allocations["o"].whole
        assert lending.lent(svc.topology, svc.state, "o") == after
        assert host.fake.cpus(BORROW) == svc.ledger.shared | after
        await svc.resize("o", "4")  # grows again: what its record says it lent is lent
        assert lending.lent(svc.topology, svc.state, "o") <= svc.ledger.allocations["o"].whole
        agree(svc, host.fake)
        check_window(host.fake, mark, before | svc.ledger.exclusive, lent=lent)
    run(body)


def _steps(tmp: Path, what: str) -> int:
    async def body() -> int:
        host = Host(tmp)
        svc = await lender(host)
        if what != "lend":
            await lend(svc)
        before = host.fake.calls
        await OPS[what](svc)
        return host.fake.calls - before
    return asyncio.run(body())


OPS = {"lend": lend, "withdraw": withdraw, "release": lambda svc: svc.release("o")}


@pytest.mark.parametrize("what", sorted(OPS))
def test_a_failure_or_a_crash_at_every_step(tmp_path: Path, what: str) -> None:
    steps = _steps(tmp_path / "count", what)
    assert steps >= 1
    for n in range(1, steps + 1):
        for crash in (False, True):
            async def body(n: int = n, crash: bool = crash) -> None:
                host = Host(tmp_path / f"{'crash' if crash else 'fail'}{n}")
                svc = await lender(host)
                if what != "lend":
                    await lend(svc)
                owner = svc.ledger.allocations["o"].whole
                lent = lent_map(svc, "o")
                before, mark = svc.state, host.fake.mark()
                exclusive = svc.ledger.exclusive
                host.fake.fail_at(n, Crash() if crash else None)
                with pytest.raises(Crash if crash else SystemdFailure):
                    await OPS[what](svc)
                host.fake.fail_at(10**6)
                if crash:
                    svc = await host.service()  # the checkpoint was written first
                else:
                    assert svc.state == before
                agree(svc, host.fake)
                assert host.fake.cpus(BORROW) == lending.borrowed(svc.topology, svc.state)
                if "o" not in svc.ledger.allocations:  # never lent once released
                    assert not lending.all_lent(svc.topology, svc.state)
                    assert not host.fake.cpus(BORROW) - svc.ledger.shared
                check_window(host.fake, mark, exclusive | owner, lent=lent)
            run(body)

def test_moving_a_lent_owner_wholly_keeps_the_ordering_rule(tmp_path: Path) -> None:
    """Review of issue 26: a lending owner moved off its lent core (defragment, repack), the
    core back to the shared pool: a foreign unit following the pool (app.service sorts before
    the owner's slice) must not get the old core while the owner still holds it."""
    async def body() -> None:
        host = Host(tmp_path)
        host.fake.units["app.service"] = Unit("app.service")
        svc = await host.service()
        await svc.allocate("app", "1", {"unit": "app.service"}, 0)
        await svc.allocate("o", "2", {**LEND, "movable": "anywhere"}, 0)
        await lend(svc)
        o = svc.ledger.allocations["o"]
        old, free = o.whole, svc.ledger.shared
        core = next(svc.topology.siblings(c) for c in free
                    if svc.topology.siblings(c) <= free and not svc.topology.siblings(c) & old)
        mark = host.fake.mark()
        async with svc.lock:  # what a defragment/repack move commits
            ledger = svc.ledger.without("o").with_allocation(replace(o, whole=core))
            await svc.engine.apply(Change(State(ledger, svc.state.records), frozenset({"o"}),
                                          {"o": "moved"}))
        agree(svc, host.fake)
        bad = [(i, sorted(units)) for i, now in enumerate(host.fake.timeline[mark[0]:])
               for cpu in old
               if len(units := {u for u, cpus in now.items() if cpu in cpus} - {BORROW}) > 1
               and OWNER in units]
        assert bad == []
    run(body)
