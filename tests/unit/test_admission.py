"""Burst admission (cpuservice.shell.admission): Allocates that arrive together are placed one
after another and committed as one change, and every caller gets exactly the answer serial
processing would give; fairness between owners; failures and crashes inside a group."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.apply import reconcile
from cpuservice.apply.audit import Recorder as AuditRecorder
from cpuservice.host import journal
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import SystemdFailure
from cpuservice.model.pools import Allocation
from cpuservice.model.request import Request
from cpuservice.shell.admission import GROUP_MAX, Ask, take_group
from cpuservice.shell.service import Service
from tests.props import examples
from tests.unit.fake_systemd import Crash
from tests.unit.test_service_fake import BIND, Host, agree, check_window, run


async def _asks(owners: list[int]) -> list[Ask]:
    return [Ask(f"a{i}", owner, Request.parse("1"), False) for i, owner in enumerate(owners)]


def test_a_group_takes_every_owner_first_then_round_robin() -> None:
    async def body() -> None:
        waiting = await _asks([1] * 100 + [2, 3, 2])
        group = take_group(waiting, limit=8)
        # the oldest of each owner, then one more of each in turn, up to the limit
        assert [a.owner for a in group] == [1, 2, 3, 1, 2, 1, 1, 1]
        assert [a.name for a in group if a.owner == 1] == ["a0", "a1", "a2", "a3", "a4"]
        assert len(waiting) == 103 - 8
        assert [a.name for a in waiting[:2]] == ["a5", "a6"]  # the rest keep their order
    run(body)


def test_every_waiting_owner_is_in_the_next_group_whatever_the_limit() -> None:
    async def body() -> None:
        waiting = await _asks(list(range(GROUP_MAX + 10)) + [0] * 50)
        group = take_group(waiting)
        assert {a.owner for a in group} == set(range(GROUP_MAX + 10))
        assert len(group) == GROUP_MAX + 10 and len(waiting) == 50
    run(body)


def test_a_caller_that_gave_up_is_not_placed() -> None:
    async def body() -> None:
        waiting = await _asks([1, 1, 2])
        waiting[1].future.cancel()
        assert [a.name for a in take_group(waiting)] == ["a0", "a2"]
        assert waiting == []
    run(body)


def _saves(svc: Service) -> list[int]:
    """Count the checkpoint writes from now on."""
    count = [0]
    store = svc.engine.store
    save = store.save

    def counted(*args: Any, **kw: Any) -> None:
        count[0] += 1
        save(*args, **kw)

    store.save = counted  # type: ignore[method-assign]
    return count


def test_a_burst_is_committed_as_one_change(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, "c")
        svc = await host.service()
        await svc.allocate("first", "1", BIND, 0)
        saves, mark = _saves(svc), host.fake.mark()
        host.events.seen.clear()
        svc.admission.order = []
        results = await asyncio.gather(*(svc.allocate(f"b{i}", "1", BIND, 0) for i in range(32)))
        assert all(isinstance(r, Allocation) for r in results)
        assert [a.name for a in svc.admission.order] == [f"b{i}" for i in range(32)]
        assert saves[0] == 1  # one checkpoint write
        writes = host.fake.writes[mark[1]:]
        assert [w.unit for w in writes if w.unit == "cpuservice-shared.slice"] == [
            "cpuservice-shared.slice"]  # one change of the shared pool
        assert sum(w.member == "StartTransientUnit" for w in writes) == 32
        kinds = [k for k, _ in host.events.seen]
        assert kinds.count("added") == 32 and kinds.count("pools") == 1
        assert kinds.count("manager") <= 1
        held = [r.held for r in results]
        assert len(CPUSet.union_all(held)) == 32  # nothing double-booked
        agree(svc, host.fake)
        check_window(host.fake, mark, svc.ledger.exclusive)
        again = await host.service()  # the checkpoint has all of them
        assert again.ledger.allocations == svc.ledger.allocations
    run(body)


def test_a_burst_that_arrives_over_several_turns_is_one_group(tmp_path: Path) -> None:
    """The bus hands calls over a buffer at a time: a burst reaches the queue over several
    turns of the loop, and is still one group (not one of the first turns' and another that
    waits for its jobs); a lone Allocate does not wait for a turn."""
    async def body() -> None:
        host = Host(tmp_path, "c")
        svc = await host.service()
        await svc.allocate("first", "1", BIND, 0)
        groups = svc.admission.groups

        async def late(i: int) -> Allocation:
            for _ in range(i // 8):  # 8 calls a turn
                await asyncio.sleep(0)
            return await svc.allocate(f"b{i}", "1", BIND, 0)

        await asyncio.gather(*(late(i) for i in range(32)))
        assert svc.admission.groups == groups + 1
        turns = 0

        async def count() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.ensure_future(count())
        await asyncio.sleep(0)
        before = turns
        await svc.allocate("lone", "1", BIND, 0)
        counter.cancel()
        alone = turns - before
        svc.admission.order = None
        await svc.release("lone")
        # the fake's calls never wait: an Allocate is the admission's turns and its reply's
        assert alone <= 3, alone
    run(body)


def test_the_new_slices_of_a_group_start_at_once() -> None:
    ops = [reconcile.Op(reconcile.Kind.SET, "cpuservice-shared.slice"),
           *(reconcile.Op(reconcile.Kind.START, f"s{i}.slice") for i in range(3)),
           reconcile.Op(reconcile.Kind.START, "s0.slice"),
           reconcile.Op(reconcile.Kind.SET, "x.slice")]

    class Effector:
        async def start_transient(self, unit: str, props: Any) -> None: ...
        async def set_properties(self, unit: str, props: Any, missing_ok: bool = False
                                 ) -> None: ...
        async def stop(self, unit: str) -> None: ...
        async def remove_overrides(self, unit: str, names: Any) -> None: ...

    assert [len(g) for g in reconcile.groups(ops, Effector())] == [1, 3, 1, 1]


def test_starts_issued_together_are_undone_together() -> None:
    """One of three concurrent starts fails: the two that started are stopped again."""
    started: list[str] = []
    stopped: list[str] = []

    class Effector:
        async def start_transient(self, unit: str, props: Any) -> None:
            await asyncio.sleep(0)
            if unit == "bad.slice":
                raise SystemdFailure("refused")
            started.append(unit)

        async def set_properties(self, unit: str, props: Any, missing_ok: bool = False
                                 ) -> None: ...

        async def stop(self, unit: str) -> None:
            stopped.append(unit)

        async def remove_overrides(self, unit: str, names: Any) -> None: ...

    tx = reconcile.Transaction(tuple(reconcile.Op(reconcile.Kind.START, u)
                                     for u in ("a.slice", "bad.slice", "c.slice")))
    with pytest.raises(reconcile.Failed) as info:
        asyncio.run(reconcile.execute(tx, Effector()))
    assert info.value.step.unit == "bad.slice" and info.value.clean
    assert started == ["a.slice", "c.slice"] and stopped == ["c.slice", "a.slice"]


def _refuse(unit: str) -> Callable[[int, str, str], Exception | None]:
    def fail(call: int, member: str, target: str) -> Exception | None:
        if member == "StartTransientUnit" and target == unit:
            raise SystemdFailure(f"systemd refused {member}: injected failure")
        return None
    return fail


def test_a_failed_part_fails_alone(tmp_path: Path) -> None:
    """systemd refuses one slice of a group: the group is undone, its other requests are
    committed one by one and succeed; the refused one gets the error and leaves nothing."""
    async def body() -> None:
        host = Host(tmp_path, "c")
        svc = await host.service()
        await svc.allocate("first", "1", BIND, 0)
        mark = host.fake.mark()
        host.fake.fail = _refuse("cpuservice-bound-b3.slice")
        results = await asyncio.gather(*(svc.allocate(f"b{i}", "2", BIND, 0) for i in range(6)),
                                       return_exceptions=True)
        assert isinstance(results[3], SystemdFailure)
        assert all(isinstance(r, Allocation) for i, r in enumerate(results) if i != 3)
        assert "b3" not in svc.ledger.allocations
        assert "cpuservice-bound-b3.slice" not in host.fake.units
        host.fake.fail = lambda *a: None
        agree(svc, host.fake)
        check_window(host.fake, mark, svc.ledger.exclusive)
        again = await host.service()
        assert again.ledger.allocations == svc.ledger.allocations
    run(body)


def _burst_calls(tmp: Path) -> int:
    async def body() -> int:
        host = Host(tmp, "c")
        svc = await host.service()
        await svc.allocate("first", "1", BIND, 0)
        before = host.fake.calls
        await asyncio.gather(*(svc.allocate(f"b{i}", n, BIND, 0)
                               for i, n in enumerate(("1", "2", "1.5", "3"))))
        return host.fake.calls - before
    return asyncio.run(body())


def test_a_crash_at_every_step_of_a_group_recovers(tmp_path: Path) -> None:
    steps = _burst_calls(tmp_path / "count")
    assert steps >= 5
    for n in range(1, steps + 1):
        async def body(n: int = n) -> None:
            host = Host(tmp_path / f"crash{n}", "c")
            svc = await host.service()
            await svc.allocate("first", "1", BIND, 0)
            mark, exclusive = host.fake.mark(), svc.ledger.exclusive
            host.fake.fail_at(n, Crash())
            with pytest.raises(Crash):
                await asyncio.gather(*(svc.allocate(f"b{i}", a, BIND, 0)
                                       for i, a in enumerate(("1", "2", "1.5", "3"))))
            host.fake.fail_at(10**6)
            restarted = await host.service()
            agree(restarted, host.fake)
            # the checkpoint was written before systemd was touched: all four come back
            assert {f"b{i}" for i in range(4)} <= restarted.ledger.allocations.keys()
            check_window(host.fake, mark, exclusive | restarted.ledger.exclusive)
        run(body)


def test_each_caller_is_named_in_the_audit_trail(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, "c")
        svc = await host.service()
        svc.engine.audit = rec = AuditRecorder()

        async def as_caller(uid: int, name: str) -> Allocation:
            journal.CALLER.set(uid)
            return await svc.allocate(name, "1", BIND, uid)

        await asyncio.gather(*(asyncio.create_task(as_caller(uid, f"by{uid}"),
                                                   context=contextvars.Context())
                               for uid in (1000, 1001, 1002)))
        callers = {e.allocation: dict(e.extra).get("CALLER_UID") for e in rec.events}
        assert callers == {"by1000": "1000", "by1001": "1001", "by1002": "1002"}
    run(body)


REQUESTS = st.tuples(
    st.sampled_from(["a", "b", "c", "d", "e", "f"]),  # names repeat: AllocationExists
    st.sampled_from(["0.5", "1", "1.3", "2", "3", "9"]),
    st.sampled_from([{}, BIND, {**BIND, "policy": "full-pcpus"},
                     {**BIND, "numa-alignment": "single-numa-node"},
                     {**BIND, "exclusive": "pcpu"}]),
    st.sampled_from([0, 1000, 1001]),  # 1000 and 1001 are held to the per-user limits
)


async def _outcomes(host: Host, burst: list[tuple[str, str, dict[str, Any], int]],
                    order: list[int] | None) -> tuple[Service, list[Any]]:
    """Answers to ``burst``: all at once (order None) or one after another in ``order``."""
    svc = await host.service()
    await svc.allocate("old", "2", BIND, 1000)

    async def one(i: int) -> Any:
        name, cpus, options, owner = burst[i]
        try:
            a = await svc.allocate(name, cpus, options, owner, limited=owner != 0)
        except Exception as exc:
            return (type(exc).__name__, str(exc))
        return (a.whole.format(), a.fragment)

    if order is None:
        svc.admission.order = []
        return svc, list(await asyncio.gather(*(one(i) for i in range(len(burst)))))
    answers: list[Any] = [None] * len(burst)
    for i in order:
        answers[i] = await one(i)
    return svc, answers


@settings(max_examples=examples(25))
@given(burst=st.lists(REQUESTS, min_size=2, max_size=10))
def test_a_group_answers_as_serial_processing_would(tmp_path_factory: Any,
                                                    burst: list[Any]) -> None:
    tmp = tmp_path_factory.mktemp("burst")
    settings_ = {"max_cpus_per_user": "6", "max_allocations_per_user": 3}

    async def body() -> None:
        together = Host(tmp / "together", "b", **settings_)
        svc, answers = await _outcomes(together, burst, None)
        assert svc.admission.order is not None
        # which request each placed one was (two alike are interchangeable)
        pending = dict(enumerate(burst))
        order = []
        for ask in svc.admission.order:
            i = next(i for i, (name, cpus, _, owner) in pending.items()
                     if (name, owner) == (ask.name, ask.owner) and Request.parse(
                         cpus, burst[i][2]).options == ask.request.options
                     and ask.request.cpus == Request.parse(cpus).cpus)
            order.append(i)
            del pending[i]
        one_by_one = Host(tmp / "serial", "b", **settings_)
        serial, expected = await _outcomes(one_by_one, burst, order)
        assert answers == expected
        assert svc.ledger.allocations == serial.ledger.allocations
        agree(svc, together.fake)
    run(body)


def test_a_serial_handed_out_while_its_group_commits_stays_valid(tmp_path: Path) -> None:
    """A client sees b1 appear and calls Release(b1) while the group is still being applied
    (the bus asks for the allocation's serial outside the lock): the release acts on b1 and is
    not refused as if b1 had been allocated again (found by review)."""
    async def body() -> None:
        host = Host(tmp_path, "c")
        svc = await host.service()
        observe = svc.engine.observe_partitions
        released: list[Any] = []

        async def slow_observe(names: Any = None) -> set[str]:
            out = await observe(names)
            if "b1" in svc.ledger.allocations and not released:
                serial = svc.serial("b1")

                async def client_release() -> None:
                    try:
                        await svc.release("b1", serial=serial)
                        released.append("ok")
                    except Exception as exc:
                        released.append(exc)
                asyncio.get_running_loop().create_task(client_release())
                await asyncio.sleep(0)  # a D-Bus round trip
            return out

        svc.engine.observe_partitions = slow_observe  # type: ignore[method-assign]
        await asyncio.gather(*(svc.allocate(f"b{i}", "1", BIND, 0) for i in range(3)))
        for _ in range(20):
            await asyncio.sleep(0)
        assert released == ["ok"], released
        # a name allocated again gets a new identity: the old serial no longer acts on it
        old = svc.serial("b2")
        await svc.release("b2")
        await svc.allocate("b2", "1", BIND, 0)
        assert svc.serial("b2") != old
    run(body)
