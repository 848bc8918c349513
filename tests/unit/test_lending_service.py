"""The lending controller in the service (issue 26, cpuservice.shell.lending) on the fake
systemd, with the owners' cgroup usage and the clock in the test's hands: idle owners lend after
lend_idle_seconds, a busy one is withdrawn in one transaction that shrinks the borrow slice
first, with AllocationChanged, a journal entry and the metrics; SetLending; a restart; an
unreadable cgroup; a full disk; hotplug; and random sequences of everything (hypothesis)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.apply import views
from cpuservice.apply.audit import Kind
from cpuservice.apply.audit import Recorder as AuditRecorder
from cpuservice.host import metrics
from cpuservice.model import lending
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import CPUServiceError, InvalidArgument
from cpuservice.shell.lending import Action
from cpuservice.shell.service import Service
from tests.props import examples
from tests.unit.fake_systemd import BORROW, Crash
from tests.unit.test_lending_apply import lent_map
from tests.unit.test_metrics import parse
from tests.unit.test_service_fake import Host, agree, check_window, run

LEND = {"bind": True, "lend": True}
SAMPLE = 0.0625  # the clock's step per sample (exact in binary: 32 make lend_idle_seconds)


def group(svc: Service, name: str) -> str:
    return "/" + svc.record(name).unit


async def tick(host: Host, svc: Service, busy: dict[str, float] | None = None,
               n: int = 1, threads: dict[str, dict[int, float]] | None = None) -> None:
    """``n`` samples, SAMPLE apart; each owner in ``busy`` used that many CPUs' worth in
    threads the loop cannot see (on any core, as far as it knows); in ``threads``, its thread
    on each CPU given (tid: the CPU + 1) ran that share of the sample there; the others
    nothing."""
    for _ in range(n):
        host.clock += SAMPLE
        for name, cpus in (busy or {}).items():
            key = group(svc, name)
            host.usage[key] = host.usage.get(key, 0) + int(cpus * SAMPLE * 1e6)
        for name, shares in (threads or {}).items():
            key = group(svc, name)
            table = host.threads.setdefault(key, {})
            for cpu, share in shares.items():
                ran = int(share * SAMPLE * 1e9)
                table[cpu + 1] = (table.get(cpu + 1, (0, cpu))[0] + ran, cpu)
                host.usage[key] = host.usage.get(key, 0) + ran // 1000
        await svc.lending.sample()


def idle_threads(host: Host, svc: Service, name: str) -> None:
    """One thread of ``name`` on each of its CPUs, idle so far (tid: the CPU + 1)."""
    host.usage.setdefault(group(svc, name), 0)
    host.threads[group(svc, name)] = {
        cpu + 1: (0, cpu) for cpu in svc.ledger.allocations[name].whole}


async def lender(host: Host, cpus: str = "4") -> Service:
    """Fixture b (CPU n and n+8 are siblings): o lends 4 CPUs (2 cores); b borrows."""
    svc = await host.service()
    await svc.allocate("o", cpus, LEND, 1000)
    await svc.allocate("b", "2", {"borrow": True}, 1000)
    idle_threads(host, svc, "o")
    return svc


def test_an_idle_owner_lends_and_a_busy_one_is_withdrawn(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        svc.engine.audit = rec = AuditRecorder()
        owner = svc.ledger.allocations["o"].whole
        fake, mark = host.fake, host.fake.mark()
        await tick(host, svc, n=33)  # the first reading, then 1.94 s of idle: not yet
        assert fake.cpus(BORROW) == svc.ledger.shared
        await tick(host, svc)  # 2 s
        assert fake.cpus(BORROW) == svc.ledger.shared | owner
        assert svc.record("o").lent == owner
        assert [(e.kind, e.allocation) for e in rec.events] == [(Kind.LENT, "o")]
        assert dict(rec.events[0].extra)["LENT"] == owner.format()
        assert ("changed", ("o", {"LentCPUs": owner.format()})) in host.events.seen
        manager = [v for k, v in host.events.seen if k == "manager"]
        assert manager[-1][0] == {"LentCPUs": owner.format()}
        values = views.allocation(svc.topology, svc.state, "b")
        assert CPUSet.parse(values["CPUSet"]) == svc.ledger.shared | owner
        first = svc.topology.siblings(min(owner))
        other = owner - first
        # 12 % of a CPU on one core: between the thresholds, stays lent
        await tick(host, svc, threads={"o": {max(other): 0.12}}, n=5)
        assert svc.record("o").lent == owner
        withdraw = fake.mark()
        await tick(host, svc, threads={"o": {min(owner): 1.0}})  # busy on one core: that one
        assert fake.writes[withdraw[1]].unit == BORROW  # one change, the borrow slice first
        assert fake.cpus(BORROW) == svc.ledger.shared | other
        assert svc.record("o").lent == other
        assert rec.events[-1].kind == Kind.WITHDRAWN
        assert dict(rec.events[-1].extra)["WITHDRAWN"] == first.format()
        assert "busy: load 100% of a CPU" in rec.events[-1].message
        assert ("changed", ("o", {"LentCPUs": other.format()})) in host.events.seen
        text = parse(metrics.render(svc.topology, svc.state, svc.engine.counters, "9"))
        assert text["cpuservice_lending_withdrawals_total"] == 1
        assert text["cpuservice_lending_withdraw_seconds_count"] == 1
        assert text["cpuservice_lent_cpus"] == 2
        assert text["cpuservice_lent_cpu_seconds_total"] == pytest.approx(4 * 6 * SAMPLE)
        await tick(host, svc, threads={"o": {min(owner): 1.0}}, n=40)  # it stays busy
        assert svc.record("o").lent == other
        await tick(host, svc, {"o": 1.0})  # a CPU's worth it cannot place: on every core
        assert svc.record("o").lent == EMPTY and fake.cpus(BORROW) == svc.ledger.shared
        await tick(host, svc, {"o": 1.0}, n=3)
        await tick(host, svc, n=33)  # idle again for 2 s: lent again
        assert svc.record("o").lent == owner
        agree(svc, fake)
        check_window(fake, mark, svc.ledger.exclusive, lent=lent_map(svc, "o"))
        again = await host.service()  # the checkpoint says what is lent
        assert again.record("o").lent == owner
        agree(again, fake)
    run(body)


def test_set_lending(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await tick(host, svc, n=34)
        owner = svc.ledger.allocations["o"].whole
        assert svc.record("o").lent == owner
        mark = host.fake.mark()
        await svc.set_lending("o", False)  # withdrawn at once
        assert host.fake.writes[mark[1]].unit == BORROW
        assert host.fake.cpus(BORROW) == svc.ledger.shared and svc.record("o").lent == EMPTY
        assert not svc.ledger.allocations["o"].request.options.lend
        assert ("changed", ("o", {"Lending": False, "LentCPUs": ""})) in host.events.seen
        await tick(host, svc, n=60)
        assert svc.record("o").lent == EMPTY  # no longer lends
        await svc.set_lending("o", True)
        await tick(host, svc, n=34)
        assert svc.record("o").lent == owner
        before = svc.state
        for name, value in (("b", True), ("nobody", True)):
            with pytest.raises(CPUServiceError):
                await svc.set_lending(name, value)
        assert svc.state is before
        await svc.set_lending("o", True)  # already so: nothing happens
        assert svc.state is before
        again = await host.service()
        assert again.ledger.allocations["o"].request.options.lend
    run(body)


def test_refused_options_change_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        before = svc.state
        for cpus, options in (("1", {"lend": True}), ("1", {"borrow": True, "bind": True}),
                              ("1", {"borrow": True, "unit": "app.service"})):
            with pytest.raises(InvalidArgument):
                await svc.allocate("x", cpus, options, 0)
        assert svc.state is before and not svc.lending.running()
    run(body)


def test_a_restart_keeps_what_is_lent_and_withdraws_a_busy_owner(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await tick(host, svc, n=34)
        owner = svc.ledger.allocations["o"].whole
        again = await host.service()
        assert host.fake.cpus(BORROW) == again.ledger.shared | owner
        assert again.lending.lenders == {}  # derived at the first sample
        await tick(host, again, {"o": 4.0})  # the first reading only
        assert again.record("o").lent == owner
        await tick(host, again, {"o": 4.0})
        assert again.record("o").lent == EMPTY
        agree(again, host.fake)
    run(body)


def test_an_owner_whose_load_cannot_be_read_is_withdrawn(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await tick(host, svc, n=34)
        assert svc.record("o").lent
        del host.usage[group(svc, "o")]
        await tick(host, svc)
        assert svc.record("o").lent == EMPTY
        await tick(host, svc, n=100)
        assert svc.record("o").lent == EMPTY  # never lent while it cannot be read
    run(body)


def test_a_withdrawal_is_applied_when_the_checkpoint_cannot_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from cpuservice.host import checkpoint

    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await tick(host, svc, n=34)
        assert svc.record("o").lent

        def full(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        real = os.write
        monkeypatch.setattr(checkpoint.os, "write", full)
        await tick(host, svc, {"o": 4.0})
        assert svc.record("o").lent == EMPTY and host.fake.cpus(BORROW) == svc.ledger.shared
        assert svc.engine.store.write_error
        await tick(host, svc, n=60)  # lending needs the checkpoint: not lent again
        assert svc.record("o").lent == EMPTY
        monkeypatch.setattr(checkpoint.os, "write", real)
        await tick(host, svc, n=34)  # its idle time starts again at each failed attempt
        assert svc.record("o").lent
    run(body)


def test_hotplug_repair_of_a_lending_owner(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await tick(host, svc, n=34)
        owner = svc.ledger.allocations["o"].whole
        mark, lent = host.fake.mark(), lent_map(svc, "o")
        host.offline({min(owner)})
        await svc.revalidate(full=False)
        now = svc.ledger.allocations["o"].whole
        assert lending.lent(svc.topology, svc.state, "o") <= now
        agree(svc, host.fake)
        check_window(host.fake, mark, owner | now, lent=lent)
        await tick(host, svc, n=33)  # lent again in full: its cores as they are now, idle
        assert lending.lent(svc.topology, svc.state, "o") == lending.lendable(
            svc.topology, svc.ledger.allocations["o"])
        agree(svc, host.fake)
    run(body)


def test_the_loop_runs_only_while_something_lends(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, lend_sample_ms=10, lend_idle_seconds=0)
        svc = await host.service()
        svc.lending.sleep = asyncio.sleep
        svc.lending.clock = __import__("time").monotonic
        assert not svc.lending.running()
        await svc.allocate("o", "2", LEND, 0)
        host.usage[group(svc, "o")] = 0
        assert svc.lending.running()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if svc.record("o").lent:
                break
        assert svc.record("o").lent == svc.ledger.allocations["o"].whole
        await svc.release("o")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not svc.lending.running():
                break
        assert not svc.lending.running()
        assert BORROW not in host.fake.units  # nobody borrows: no borrow slice at all
    run(body)


def test_a_stopping_daemon_leaves_nothing_lent(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        svc.engine.audit = rec = AuditRecorder()
        await tick(host, svc, n=34)
        assert svc.record("o").lent
        await svc.lending.shutdown()
        assert host.fake.cpus(BORROW) == svc.ledger.shared and not svc.lending.running()
        assert rec.events[-1].kind == Kind.WITHDRAWN
        assert rec.events[-1].reason == "the daemon stops"
        assert svc.engine.counters.withdrawals == 0  # not an owner that got busy
        again = await host.service()  # the checkpoint says so: lent again once idle
        assert again.record("o").lent == EMPTY
        await tick(host, again, n=34)
        assert again.record("o").lent
    run(body)


def test_a_stop_during_a_lend_in_flight_leaves_nothing_lent(tmp_path: Path) -> None:
    """Review of issue 26: SIGTERM while the loop's lend waits for systemd's reply (systemd
    has done it, the checkpoint says lent): the drain waits for that commit, then withdraws."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        owner = svc.ledger.allocations["o"].whole
        fake, original = host.fake, host.fake.set_properties
        reply, applied = asyncio.Event(), asyncio.Event()

        async def slow(unit: str, props: Any, *args: Any, **kwargs: Any) -> None:
            await original(unit, props, *args, **kwargs)
            if unit == BORROW:
                applied.set()
                await reply.wait()  # the reply is on its way

        fake.set_properties = slow  # type: ignore[method-assign]
        loop = svc.lending
        if loop._task is not None:
            loop._task.cancel()
        loop._task = asyncio.create_task(loop.commit({"o": owner}, Action.LEND, host.clock, {}))
        await applied.wait()
        stopping = asyncio.create_task(loop.shutdown())  # the daemon's drain
        await asyncio.sleep(0.01)
        reply.set()
        await stopping
        assert not fake.cpus(BORROW) & owner, "still lent after the drain"
        loop.ensure()  # an Allocate or SetLending during the drain starts nothing
        assert not loop.running()
        again = await host.service()
        assert not again.record("o").lent, "the checkpoint says lent after a clean stop"
    run(body)


def test_a_new_allocation_of_the_same_name_waits_its_own_idle_time(tmp_path: Path) -> None:
    """Review of issue 26: o idles without being lent yet, is released and allocated again (a
    new allocation): it must be idle lend_idle_seconds of its own before it lends."""
    async def body() -> None:
        host = Host(tmp_path)
        svc = await lender(host)
        await svc.allocate("p", "2", LEND, 1000)  # another lender: the loop goes on
        host.usage[group(svc, "p")] = 0
        await tick(host, svc, n=21)  # the first reading and 1.25 s idle
        assert not svc.record("o").lent
        await svc.release("o")
        await svc.allocate("o", "4", LEND, 1000)
        born = host.clock
        await tick(host, svc, n=30)
        assert host.clock - born < 2.0
        assert not svc.record("o").lent
        await tick(host, svc, n=4)
        assert svc.record("o").lent
    run(body)


def test_the_loop_acts_in_nobody_s_name(tmp_path: Path) -> None:
    """Review of issue 26: the loop started by uid 4242's SetLending writes its later entries
    without a caller (they are the daemon's, not 4242's)."""
    from cpuservice.host import journal

    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        gate: asyncio.Queue[None] = asyncio.Queue()

        async def step_sleep(_: float) -> None:
            await gate.get()

        svc.lending.sleep = step_sleep
        svc.engine.audit = rec = AuditRecorder()

        async def as_caller() -> None:
            journal.CALLER.set(4242)
            await svc.set_lending("o", True)

        await svc.allocate("o", "4", {"bind": True}, 1000)
        await asyncio.create_task(as_caller())
        host.usage[group(svc, "o")] = 0
        for _ in range(40):
            host.clock += SAMPLE
            gate.put_nowait(None)
            for _ in range(5):
                await asyncio.sleep(0)
        lent = [e for e in rec.events if e.kind == Kind.LENT]
        assert lent and dict(lent[0].extra).get("CALLER_UID") is None, lent
        await svc.lending.shutdown()
    run(body)


# ---- random sequences ----

OPTIONS = {"bind": {"bind": True}, "lend": LEND, "borrow": {"borrow": True}, "unbound": {}}


def sequence(seed: int, length: int = 20) -> list[tuple[Any, ...]]:
    """A random sequence of actions (tests/README.md: from a seed, so that a falsifying
    example is a line to paste), weighted so that owners lend and get busy often."""
    rng = random.Random(seed)
    names = "abcd"
    out: list[tuple[Any, ...]] = []
    for _ in range(length):
        kind = rng.choices(["allocate", "release", "resize", "set-lending", "idle", "busy",
                            "thread", "offline", "fail", "crash"],
                           [6, 2, 2, 2, 6, 4, 3, 1, 1, 1])[0]
        if kind == "allocate":
            out.append((kind, rng.choice(names), rng.choice(["1", "2", "4", "0.5", "2.5"]),
                        rng.choices(list(OPTIONS), [1, 4, 2, 1])[0]))
        elif kind == "release":
            out.append((kind, rng.choice(names)))
        elif kind == "busy":  # the n-th allocation that lends, when the action runs
            out.append((kind, rng.randint(0, 3)))
        elif kind == "thread":  # a thread of the n-th lender busy on its k-th CPU
            out.append((kind, rng.randint(0, 3), rng.randint(0, 7)))
        elif kind == "resize":
            out.append((kind, rng.choice(names), rng.choice(["1", "2", "4"])))
        elif kind == "set-lending":
            out.append((kind, rng.choice(names), rng.random() < 0.6))
        elif kind == "idle":
            out.append((kind, rng.randint(2, 6)))
        elif kind == "offline":
            out.append((kind, set(rng.sample(range(1, 16), rng.randint(0, 3)))))
        else:
            out.append((kind, rng.randint(1, 3)))
    return out


def lent_units(svc: Service) -> dict[int, str]:
    """cpu -> unit, for every CPU an allocation may lend now."""
    return lent_map(svc, *lending.lenders(svc.state))


@settings(max_examples=examples(30))
@given(seed=st.integers(0, 2**32 - 1))
def test_random_lending_sequences(tmp_path_factory: Any, seed: int) -> None:
    """Whatever happens (requests, lending on and off, idle and busy owners, busy threads,
    hotplug, failures, crashes): systemd holds the state, the borrow slice exists exactly while a
    borrower does and holds exactly the shared pool and what is lent now, and at no instant is a
    CPU in the borrow slice and a unit other than the one of the allocation that may lend it."""
    tmp = tmp_path_factory.mktemp("lending")
    actions = sequence(seed)

    async def body() -> None:
        host = Host(tmp, lend_idle_seconds=0.1)  # 3 samples of idle after the first reading
        svc = await host.service()
        for action in actions:
            mark, exclusive, lent = host.fake.mark(), svc.ledger.exclusive, lent_units(svc)
            kind = action[0]
            if kind in ("fail", "crash"):
                host.fake.fail_at(action[1], Crash() if kind == "crash" else None)
                continue
            try:
                if kind == "allocate":
                    await svc.allocate(action[1], action[2], OPTIONS[action[3]], 0)
                elif kind == "release":
                    await svc.release(action[1])
                elif kind == "resize":
                    await svc.resize(action[1], action[2])
                elif kind == "set-lending":
                    await svc.set_lending(action[1], action[2])
                elif kind == "idle":
                    await tick(host, svc, n=action[1])
                elif kind == "busy":
                    owners = lending.lenders(svc.state)
                    busy = {owners[action[1] % len(owners)]: 4.0} if owners else {}
                    await tick(host, svc, busy, n=2)
                elif kind == "thread":
                    owners = lending.lenders(svc.state)
                    name = owners[action[1] % len(owners)] if owners else ""
                    cpus = list(svc.ledger.allocations[name].whole) if name else []
                    if cpus:
                        cpu = cpus[action[2] % len(cpus)]
                        await tick(host, svc, threads={name: {cpu: 1.0}}, n=2)
                        if svc.ledger.allocations.get(name) is not None:  # its core: never
                            assert not (lending.lent(svc.topology, svc.state, name)
                                        & svc.topology.siblings(cpu))
                else:
                    host.offline(action[1])
                    await svc.revalidate(full=False)
            except CPUServiceError:
                pass
            except Crash:
                host.fake.fail_at(10**6)
                svc = await host.service()
            host.fake.fail_at(10**6)
            for name in svc.ledger.allocations:
                host.usage.setdefault(group(svc, name), 0)
            check_window(host.fake, mark, exclusive | svc.ledger.exclusive,
                         lent={**lent, **lent_units(svc)})
            agree(svc, host.fake)
            borrowers = any(a.request.options.borrow for a in svc.ledger.allocations.values())
            if borrowers:
                assert host.fake.cpus(BORROW) == lending.borrowed(svc.topology, svc.state)
            else:  # the borrow slice exists only while a borrower does
                assert BORROW not in host.fake.units
            for name in lending.lent_by(svc.topology, svc.state).values():
                assert svc.ledger.allocations[name].request.options.lend
    run(body)
