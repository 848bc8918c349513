"""Units that wait for each other's exclusive CPUs (cpuservice.apply.reconcile, step 3): the
extra steps that let them through without a CPU in two units at any instant. Pure.

Either one of them passes through CPUs no unit holds exclusively (``park``: the shared pool's,
when some of them stay shared), or, when there are none, units give up CPUs for a moment
(``narrow``): the units holding CPUs another one waits for shrink off them (to what they keep of
their own, else to one CPU: a unit never holds nothing), and the one waiting takes what is free
of its target, leaving its old CPUs to the others. A narrowing is safe; a double holding is
not. A cycle of units holding one CPU each with nothing to pass through has no safe order at
all (neither ``park`` nor ``narrow`` finds a step): the change is refused."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from cpuservice.apply.ops import CPUS, NOT_PARTITION, PARTITION, Kind, Op, UnitSpec, mask
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import InsufficientCPUs


class NoSafeOrder(InsufficientCPUs):
    """The units cannot reach their CPUs without an exclusive CPU in two of them at once: the
    change is refused before anything is touched (a caller sees InsufficientCPUs)."""

    def __init__(self, units: Sequence[str]) -> None:
        super().__init__(
            f"units {', '.join(units)} would have to swap CPUs with no CPU free to pass "
            "through, and each holds one CPU only: no order keeps every exclusive CPU in one "
            "unit at a time")
        self.units = tuple(units)


def park(pending: Sequence[str], wants: Mapping[str, CPUSet | None],
         now: dict[str, UnitSpec], holding: dict[str, CPUSet], exclusive: CPUSet,
         parking: CPUSet) -> list[Op] | None:
    """Break a cycle of units waiting for each other's exclusive CPUs: the first unit that holds
    exclusive CPUs another one waits for (one that is not a partition, when there is one) moves
    to ``parking`` (non-exclusive CPUs); ``now`` and ``holding`` follow. None: nothing to
    park on."""
    if not parking:
        return None
    blocking = [u for u in pending if u in holding and _waited_for(u, pending, wants, holding,
                                                                    exclusive)]
    if not blocking:
        return None
    unit = next((u for u in blocking if not is_partition(now[u])), blocking[0])
    ops = []
    had = now[unit].props
    if is_partition(now[unit]):
        ops.append(Op(Kind.SET, unit, {PARTITION: ("s", "member")}, {PARTITION: had[PARTITION]}))
        had = {**had, PARTITION: ("s", "member")}
    ops.append(Op(Kind.SET, unit, {CPUS: mask(parking)}, {CPUS: had[CPUS]}))
    now[unit] = replace(now[unit], props={**had, CPUS: mask(parking)})
    holding[unit] = parking
    return ops


def narrow(pending: Sequence[str], wants: Mapping[str, CPUSet | None],
           now: dict[str, UnitSpec], holding: dict[str, CPUSet], exclusive: CPUSet,
           claim: Callable[[str, CPUSet], CPUSet]) -> list[Op] | None:
    """Break a cycle with nothing to park on: for one unit ``v`` that holds CPUs another waits
    for, the units holding exclusive CPUs of its target shrink off them (to the rest of what
    they hold, else to their highest CPU), and ``v``, unless that left it nothing to wait for,
    moves to what is free of its target (so it no longer holds what others wait for). Of the
    candidates, the step that needs no such partial move, then shrinks the fewest of
    cpuservice's own slices (the shared pool's holders narrow before an allocation's slice
    does), then shrinks no unit to one CPU, then the first by name. ``now`` and ``holding``
    follow. None: no unit can give up a CPU (each holds one)."""
    best: tuple[tuple[int, int, int], list[Op], dict[str, CPUSet]] | None = None
    for v in pending:
        if v not in holding or not _waited_for(v, pending, wants, holding, exclusive):
            continue
        step = _unblock(v, pending, wants, now, holding, exclusive, claim)
        if step is not None and (best is None or step[0] < best[0]):
            best = step
    if best is None:
        return None
    _, ops, holds = best
    for op in ops:
        now[op.unit] = replace(now[op.unit], props={**now[op.unit].props, **op.props})
    holding.update(holds)
    return ops


def _unblock(v: str, pending: Sequence[str], wants: Mapping[str, CPUSet | None],
             now: Mapping[str, UnitSpec], holding: Mapping[str, CPUSet], exclusive: CPUSet,
             claim: Callable[[str, CPUSet], CPUSet]
             ) -> tuple[tuple[int, int, int], list[Op], dict[str, CPUSet]] | None:
    """The step that lets ``v`` move (see narrow), its rank, and what the units it changes
    hold after it; None when a unit that must give up CPUs holds one only."""
    want = (wants[v] or EMPTY) & exclusive
    ops: list[Op] = []
    holds: dict[str, CPUSet] = {}
    to_one = own = 0  # units shrunk to one CPU, cpuservice's own slices shrunk
    for u in pending:
        if u == v or u not in holding or not holding[u] & want:
            continue
        keep = holding[u] - want
        if not keep:
            if len(holding[u]) < 2:
                return None
            keep, to_one = CPUSet((max(holding[u]),)), to_one + 1
        own += now[u].own
        had = now[u].cpus or EMPTY
        cpus = had - (holding[u] - keep)
        ops.append(Op(Kind.SET, u, {CPUS: mask(cpus)}, {CPUS: mask(had)}))
        holds[u] = claim(u, cpus)
    blocked = want & CPUSet.union_all(
        holds.get(u, holding[u]) for u in pending if u != v and u in holding)
    if blocked == want:
        return None
    partial = bool(blocked)
    if partial:  # v takes what is free of its target and leaves its old CPUs to the others
        cpus = (wants[v] or EMPTY) - blocked  # not empty: blocked is less than want
        ops.append(Op(Kind.SET, v, {CPUS: mask(cpus)}, {CPUS: mask(now[v].cpus or EMPTY)}))
        holds[v] = claim(v, cpus)
    return (int(partial), own, int(to_one > 0)), ops, holds


def _waited_for(unit: str, pending: Sequence[str], wants: Mapping[str, CPUSet | None],
                holding: Mapping[str, CPUSet], exclusive: CPUSet) -> bool:
    """Whether another pending unit waits for exclusive CPUs ``unit`` holds."""
    held = holding[unit] & exclusive
    return any(v != unit and (wants[v] or EMPTY) & held for v in pending)


def is_partition(spec: UnitSpec) -> bool:
    value = spec.props.get(PARTITION)
    return value is not None and value[1] not in NOT_PARTITION
