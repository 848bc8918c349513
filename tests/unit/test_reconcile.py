"""The reconcile transaction's ordering rule, for doing and for undoing: random before/after
unit sets over 8 CPUs (the shared slice, two bound slices that may be partitions, a foreign
unit), a failure injected at every step, and the AllowedCPUs of every unit checked at every
instant (an empty AllowedCPUs is every CPU, as systemd reads it)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpuservice.apply import reconcile
from cpuservice.apply.reconcile import UnitSpec, plan
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.props import Props
from tests.props import examples
from tests.unit.fake_systemd import FakeSystemd, Unit
from tests.unit.fake_systemd import violations as fake_violations

ALL = CPUSet(range(8))


def _mask(cpus: list[int]) -> tuple[str, bytes]:
    return ("ay", CPUSet(cpus).to_mask())


def _cpus(props: Mapping[str, tuple[str, Any]]) -> CPUSet | None:
    value = props.get("AllowedCPUs")
    if value is None:
        return None
    return CPUSet.from_mask(bytes(value[1])) or ALL


def units(rng: random.Random) -> tuple[dict[str, UnitSpec], set[int]]:
    """Each CPU to the shared slice, slice A or B, or the foreign app.service; and the CPUs
    the last three hold (exclusive)."""
    owners: dict[str, list[int]] = {"shared": [0]}
    for c in range(1, 8):
        owners.setdefault(rng.choice(["shared", "A", "B", "app"]), []).append(c)
    out = {}
    for name, cpus in owners.items():
        if name == "shared":
            out["cpuservice-shared.slice"] = UnitSpec({"AllowedCPUs": _mask(cpus)}, own=False)
        elif name == "app":
            out["app.service"] = UnitSpec(
                {"AllowedCPUs": _mask(cpus), "CPUWeight": ("t", 50)}, own=False,
                restore={"AllowedCPUs": _mask([]), "CPUWeight": ("t", 100)})
        else:
            props = {"AllowedCPUs": _mask(cpus)}
            if rng.random() < 0.3:
                props["CPUSetPartition"] = ("s", "root")
            out[f"cpuservice-bound-{name}.slice"] = UnitSpec(props, own=True)
    return out, {c for name, cpus in owners.items() if name != "shared" for c in cpus}


class Recorder:
    """An effector that keeps every unit's AllowedCPUs at every instant and fails at call
    ``fail_at``; a unit given back to its owner (a restore) is no longer checked."""

    def __init__(self, before: Mapping[str, UnitSpec], fail_at: int = 0) -> None:
        self.now = {u: c for u, s in before.items() if (c := _cpus(s.props)) is not None}
        self.timeline = [dict(self.now)]
        self.fail_at, self.calls, self.restored = fail_at, 0, set[str]()

    def _step(self, unit: str, cpus: CPUSet | None, stop: bool = False) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        if stop:
            self.now.pop(unit, None)
        elif cpus is not None:
            self.now[unit] = cpus
        self.timeline.append(dict(self.now))

    async def start_transient(self, unit: str, props: Props) -> None:
        self._step(unit, _cpus(props) or ALL)

    async def set_properties(self, unit: str, props: Props,
                             missing_ok: bool = False) -> None:
        if missing_ok:  # a restore
            self.restored.add(unit)
        self._step(unit, _cpus(props))

    async def stop(self, unit: str) -> None:
        self._step(unit, None, stop=True)

    async def remove_overrides(self, unit: str, names: Any) -> None:
        pass

    def violations(self, exclusive: CPUSet) -> list[str]:
        found = []
        for i, now in enumerate(self.timeline):
            for cpu in exclusive:
                holders = [u for u, cs in now.items() if cpu in cs and u not in self.restored]
                if len(holders) > 1:
                    found.append(f"instant {i}: CPU {cpu} in {holders}")
        return found


def failed_at_every_step(tx: reconcile.Transaction, before: Mapping[str, UnitSpec],
                         exclusive: CPUSet) -> list[Recorder]:
    """The transaction failed at each of its steps in turn: each undo is clean and keeps the
    ordering rule; the recorders, for more checks."""
    out = []
    for step in range(1, len(tx.ops) + 1):
        failing = Recorder(before, fail_at=step)
        try:
            asyncio.run(reconcile.execute(tx, failing))
        except reconcile.Failed as exc:
            assert exc.clean
        assert failing.violations(exclusive) == [], (step, [str(op) for op in tx.ops])
        out.append(failing)
    return out


@settings(max_examples=examples(300))
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=2)  # the undo of the shared pool's growth wrote its CPUs from before the change
@example(seed=13)  # undoing the adoption of a foreign unit set its values, not a restore
def test_undo_keeps_the_ordering_rule_at_every_failure(seed: int) -> None:
    """Issue 25 item 9: an operation's undo wrote the unit's values from before the whole
    change, so undoing in reverse regrew units (partition slices, foreign units, bound slices)
    onto CPUs another unit still held. Each undo now writes what the unit held just before
    that operation, and undoing a foreign unit's adoption is a restore."""
    rng = random.Random(seed)
    (before, had), (after, has) = units(rng), units(rng)
    exclusive = CPUSet(had | has)
    tx = plan(before, after, exclusive)
    whole = Recorder(before)
    asyncio.run(reconcile.execute(tx, whole))
    assert whole.violations(exclusive) == [], [str(op) for op in tx.ops]
    for failing in failed_at_every_step(tx, before, exclusive):
        assert {u: c for u, c in failing.now.items() if u not in failing.restored} == {
            u: c for u, s in before.items() if (c := _cpus(s.props)) is not None
            and u not in failing.restored}, failing.fail_at


def _slices(cpus: Mapping[str, list[int]], partitions: frozenset[str] = frozenset()
            ) -> dict[str, UnitSpec]:
    out = {"cpuservice-shared.slice": UnitSpec({"AllowedCPUs": _mask([0])}, own=False)}
    for name, held in cpus.items():
        props = {"AllowedCPUs": _mask(held)}
        if name in partitions:
            props["CPUSetPartition"] = ("s", "isolated")
        out[f"cpuservice-bound-{name}.slice"] = UnitSpec(props)
    return out


def test_a_swap_passes_through_a_shared_cpu() -> None:
    """Two slices exchange their CPUs (re-packing does this): one of them waits on the shared
    pool's CPU while the other moves, so no CPU is ever in both."""
    before = _slices({"a": [1, 2], "b": [3, 4]})
    after = _slices({"a": [3, 4], "b": [1, 2]})
    tx = plan(before, after, CPUSet(range(1, 5)))
    recorder = Recorder(before)
    asyncio.run(reconcile.execute(tx, recorder))
    assert recorder.violations(CPUSet(range(1, 5))) == []
    assert [str(op) for op in tx.ops] == [
        "set cpuservice-bound-a.slice AllowedCPUs=0",
        "set cpuservice-bound-b.slice AllowedCPUs=1-2",
        "set cpuservice-bound-a.slice AllowedCPUs=3-4"]


def test_a_cycle_of_partitions_ends_one_partition_before_it_moves() -> None:
    """a -> b's CPUs -> c's CPUs -> a's CPUs, every slice an isolated partition: the one that
    passes through the shared CPU is a member while it does, and a partition again after."""
    before = _slices({"a": [1], "b": [2], "c": [3]}, frozenset("abc"))
    after = _slices({"a": [2], "b": [3], "c": [1]}, frozenset("abc"))
    tx = plan(before, after, CPUSet(range(1, 4)))
    recorder = Recorder(before)
    asyncio.run(reconcile.execute(tx, recorder))
    assert recorder.violations(CPUSet(range(1, 4))) == []
    shown = [str(op) for op in tx.ops]
    assert shown[:2] == ["set cpuservice-bound-a.slice CPUSetPartition=member",
                         "set cpuservice-bound-a.slice AllowedCPUs=0"]
    assert shown[-1] == "set cpuservice-bound-a.slice CPUSetPartition=isolated"
    # on the shared CPU, a is never a partition
    partition = "isolated"
    for op in tx.ops:
        if op.unit.endswith("-a.slice") and "CPUSetPartition" in op.props:
            partition = op.props["CPUSetPartition"][1]
        if op.unit.endswith("-a.slice") and "AllowedCPUs" in op.props:
            on_shared = CPUSet.from_mask(bytes(op.props["AllowedCPUs"][1])) == CPUSet([0])
            assert not (on_shared and partition != "member"), shown


@settings(max_examples=examples(300))
@given(seed=st.integers(0, 2**32 - 1), slices=st.integers(2, 6))
def test_generated_permutations_never_put_a_cpu_in_two_slices(seed: int, slices: int) -> None:
    """Slices that hand their CPUs round (any permutation of who holds what, some partitions,
    some CPUs freed or taken from the shared pool): at no instant is an exclusive CPU in two
    slices, done whole or undone from any failing step."""
    rng = random.Random(seed)
    cpus = list(range(1, 2 * slices + 1))
    rng.shuffle(cpus)
    names = [chr(ord("a") + i) for i in range(slices)]
    held = {n: sorted(cpus[2 * i: 2 * i + rng.randint(1, 2)]) for i, n in enumerate(names)}
    order = names[:]
    rng.shuffle(order)
    gets = {n: held[m] for n, m in zip(names, order, strict=True)}
    partitions = frozenset(n for n in names if rng.random() < 0.4)
    before, after = _slices(held, partitions), _slices(gets, partitions)
    exclusive = CPUSet(c for cs in held.values() for c in cs)
    tx = plan(before, after, exclusive)
    whole = Recorder(before)
    asyncio.run(reconcile.execute(tx, whole))
    assert whole.violations(exclusive) == [], [str(op) for op in tx.ops]
    assert whole.now == {u: c for u, s in after.items() if (c := _cpus(s.props)) is not None}
    # the same on the fake systemd (partitions known), checked by its own timeline checker
    fake = FakeSystemd(units=())
    fake.partitions = True
    for unit, spec in before.items():
        fake.units[unit] = Unit(unit, {k: v for k, (_, v) in spec.props.items()})
    fake.timeline = [fake.snapshot()]
    asyncio.run(reconcile.execute(tx, fake))
    assert fake_violations(fake.timeline, exclusive) == [], [str(op) for op in tx.ops]
    for _ in failed_at_every_step(tx, before, exclusive):
        pass


class Batched(Recorder):
    """A recorder that writes the kernel-like units ``k1``/``k2`` together, and fails that
    write after doing its first unit (a partial write)."""

    def batched(self, unit: str) -> bool:
        return unit.startswith("k")

    async def set_many(self, writes: Mapping[str, Props]) -> None:
        first = sorted(writes)[0]
        await self.set_properties(first, writes[first])
        raise RuntimeError("the second half failed")


def test_a_batched_write_that_fails_is_not_clean() -> None:
    """The oneshot writes interrupts, then workqueues: when it fails, the first half may be done,
    so the transaction is not clean and the engine makes systemd match what it observes."""
    before = {u: UnitSpec({"AllowedCPUs": _mask([0, 1, 2, 3])}, own=False) for u in ("k1", "k2")}
    after = {u: UnitSpec({"AllowedCPUs": _mask([0, 1])}, own=False) for u in ("k1", "k2")}
    tx = plan(before, after, CPUSet([2, 3]))
    effector = Batched(before)
    assert [len(g) for g in reconcile.groups(tx.ops, effector)] == [2]
    try:
        asyncio.run(reconcile.execute(tx, effector))
    except reconcile.Failed as exc:
        assert not exc.clean
    else:
        raise AssertionError("the failure was not raised")


@settings(max_examples=examples(300))
@given(seed=st.integers(0, 2**32 - 1))
def test_sets_issued_together_keep_the_rule_in_any_order(seed: int) -> None:
    """SETs that reconcile issues at once (the shrinking holders of the shared pool, say) reach
    systemd in any order: every order of every such group keeps the ordering rule."""
    rng = random.Random(seed)
    (before, had), (after, has) = units(rng), units(rng)
    exclusive = CPUSet(had | has)
    tx = plan(before, after, exclusive)
    shuffled = []
    for group in reconcile.groups(tx.ops, Recorder(before)):
        if len(group) > 1 and group[0].kind is reconcile.Kind.SET:
            group = rng.sample(group, len(group))
        shuffled += group
    recorder = Recorder(before)
    asyncio.run(reconcile.execute(reconcile.Transaction(tuple(shuffled)), recorder))
    assert recorder.violations(exclusive) == [], [str(op) for op in shuffled]


def _held(cpus: Mapping[str, list[int]]) -> dict[str, UnitSpec]:
    return {u: UnitSpec({"AllowedCPUs": _mask(c)}, own=u.startswith("cpuservice-bound"))
            for u, c in cpus.items()}


def test_independent_sets_go_together_dependent_ones_do_not() -> None:
    """Two holders of the shared pool shrinking go together; a unit growing onto a CPU another
    gives up waits for it; a partition's SET is alone."""
    before = _held({"cpuservice-shared.slice": [0, 1, 2, 3], "cpuservice-borrow.slice":
                      [0, 1, 2, 3], "cpuservice-bound-a.slice": [4]})
    after = _held({"cpuservice-shared.slice": [0, 1], "cpuservice-borrow.slice": [0, 1],
                     "cpuservice-bound-a.slice": [2, 3, 4]})
    tx = plan(before, after, CPUSet([2, 3, 4]))
    got = [[(o.kind.value, o.unit) for o in g] for g in reconcile.groups(tx.ops, Recorder(before))]
    assert got == [[("set", "cpuservice-borrow.slice"), ("set", "cpuservice-shared.slice")],
                   [("set", "cpuservice-bound-a.slice")]]
    grow = reconcile.Op(reconcile.Kind.SET, "x", {"AllowedCPUs": _mask([1, 2])},
                        {"AllowedCPUs": _mask([1])})
    shrink = reconcile.Op(reconcile.Kind.SET, "y", {"AllowedCPUs": _mask([3])},
                          {"AllowedCPUs": _mask([2, 3])})
    weight = reconcile.Op(reconcile.Kind.SET, "z", {"CPUWeight": ("t", 5)}, {})
    partition = reconcile.Op(reconcile.Kind.SET, "p", {"CPUSetPartition": ("s", "root")},
                             {"CPUSetPartition": ("s", "member")})
    sizes = [len(g) for g in reconcile.groups([shrink, grow, weight, partition],
                                              Recorder({}))]
    assert sizes == [1, 2, 1]


def test_a_failed_set_of_a_group_undoes_the_others() -> None:
    """One of two SETs issued at once fails: the one that was done is set back."""
    before = _held({"cpuservice-shared.slice": [0, 1, 2, 3], "cpuservice-borrow.slice":
                      [0, 1, 2, 3]})
    after = _held({"cpuservice-shared.slice": [0, 1], "cpuservice-borrow.slice": [0, 1]})
    tx = plan(before, after, CPUSet([2, 3]))
    for fail_at in (1, 2):
        failing = Recorder(before, fail_at=fail_at)
        try:
            asyncio.run(reconcile.execute(tx, failing))
        except reconcile.Failed as exc:
            assert exc.clean
        else:
            raise AssertionError("the failure was not raised")
        assert failing.now == {u: _cpus(s.props) for u, s in before.items()}

