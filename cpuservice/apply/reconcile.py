"""The reconcile transaction: from the units systemd holds before a change and the units it must
hold after it, the ordered systemd operations, each with its undo. Pure; ``execute`` runs one
through a three-method effector and undoes what was done, in reverse, when a step fails.

Every path that changes systemd goes through here: requests, their rollbacks, startup recovery,
Revalidate and hotplug repair. The ordering rule, stated once:

    At no instant may a CPU that is exclusive (a whole CPU of a bound allocation, before or
    after the change) be in the AllowedCPUs of two units, and no cpuset partition may cover
    CPUs it is not meant to have. So, in this order:
      0. a slice that stops being a partition (CPUSetPartition -> member) does so first, alone,
         before any AllowedCPUs moves;
      1. every unit that loses CPUs shrinks to the CPUs it keeps: the shared pool's holders
         (the shared slice, confined host units, foreign units that follow the pool) as much
         as bound units;
      2. units that are no longer ours are stopped (our slices) or restored (foreign units);
      3. units that gain CPUs get them, and every other property that changed; new units
         start. A unit that moves to CPUs another unit still holds waits for that unit. A
         slice that becomes a partition gets its AllowedCPUs first and its partition after.
         Units that wait for each other (two that swap CPUs, a longer cycle) pass through the
         non-exclusive CPUs (the shared pool's): one of them moves there first (a partition
         stops being one before), the others follow, it goes last. When there are none (a
         move swaps CPUs with the whole shared pool), they narrow for a moment instead: the
         units holding what one of them waits for shrink off it (to one CPU, if need be),
         and that one takes what is free of its target; or one steps aside onto a CPU no
         unit holds yet (a new unit's: new units start last) (cpuservice.apply.waits). A
         change with no such order found (units holding one CPU each that swap, nothing
         free) is refused before anything is touched (NoSafeOrder): never applied out of
         order (what cannot be refused, a restart's, passes those allocations through the
         shared pool instead: cpuservice.shell.recovery.through_pool).
    The one exception: a CPU its owner lends (cpuservice.model.lending) may be in the owner's
    unit and the borrow slice at once; it is lent by growing the borrow slice (step 3) and
    withdrawn by shrinking it (step 1), and nothing ever passes through it.
    An empty AllowedCPUs is never written as a target (systemd reads it as "no restriction");
    a unit that would keep nothing goes straight from its old CPUs to its new ones in step 3.
    Only a restore (or an undo) writes a unit's own earlier value back, whatever it was.
Undo obeys the same rule: each operation's undo writes what the unit held just before that
operation (not before the whole change), so undoing newest first passes back through the
states doing went through; undoing the adoption of a foreign unit is a restore.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, cast

from cpuservice.apply import waits
from cpuservice.apply.ops import CPUS as CPUS
from cpuservice.apply.ops import NOT_PARTITION as NOT_PARTITION
from cpuservice.apply.ops import PARTITION as PARTITION
from cpuservice.apply.ops import Kind as Kind
from cpuservice.apply.ops import Op as Op
from cpuservice.apply.ops import Transaction as Transaction
from cpuservice.apply.ops import Units as Units
from cpuservice.apply.ops import UnitSpec as UnitSpec
from cpuservice.apply.ops import mask as _mask
from cpuservice.apply.waits import NoSafeOrder as NoSafeOrder
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.props import Props

log = logging.getLogger(__name__)

def _same(sig: str, a: Any, b: Any) -> bool:
    return CPUSet.from_mask(bytes(a)) == CPUSet.from_mask(bytes(b)) if sig == "ay" else a == b


def _differs(want: Props, have: Props) -> dict[str, tuple[str, Any]]:
    out = {}
    for name, (sig, value) in want.items():
        current = have.get(name)
        if current is None or not _same(sig, value, current[1]):
            out[name] = (sig, value)
    return out


def plan(before: Units, after: Units, exclusive: CPUSet = EMPTY,
         lent: CPUSet = EMPTY, sharer: str = "", shared: CPUSet = EMPTY) -> Transaction:
    """The operations that take systemd from ``before`` to ``after``. ``exclusive``: the CPUs
    that are whole CPUs of a bound allocation before or after (the ones the rule protects);
    units are otherwise allowed to share CPUs (the shared pool, fragment CPUs). ``lent``: those
    lent (lending.shareable), which the unit ``sharer`` (the borrow slice) may hold besides the
    one other unit that holds them (their owner's): they are protected from every other unit
    as usual. ``shared``: the shared pool after the change, whose holders may hold its CPUs
    together while they get them. Raises NoSafeOrder when no order keeps the rule."""
    ops: list[Op] = []
    unsafe = exclusive | lent

    def claim(unit: str, cpus: CPUSet) -> CPUSet:
        """What a unit's CPUs are, for the rule: the sharer's lent ones are nobody's."""
        return cpus - lent if unit == sharer else cpus

    # what each unit holds, as the rule sees it (claim)
    holding: dict[str, CPUSet] = {u: claim(u, s.cpus) for u, s in before.items()
                                  if s.cpus is not None}
    # what each unit holds just before each step: an operation's undo writes back these values,
    # not the ones from before the whole change, so that undoing in reverse passes through the
    # same states as doing (and keeps the ordering rule)
    now: dict[str, UnitSpec] = dict(before)

    def shrunk(unit: str, keep: CPUSet) -> None:
        now[unit] = replace(now[unit], props={**now[unit].props, CPUS: _mask(keep)})

    # 0. partitions that end, alone, before any CPU moves
    ending: dict[str, UnitSpec] = {}
    for unit in sorted(before.keys() & after.keys()):
        had, gets = before[unit].props.get(PARTITION), after[unit].props.get(PARTITION)
        if had and gets and had[1] not in NOT_PARTITION and gets[1] in NOT_PARTITION:
            ops.append(Op(Kind.SET, unit, {PARTITION: gets}, {PARTITION: had}))
            ending[unit] = replace(before[unit], props={**before[unit].props, PARTITION: gets})
    before = {**before, **ending}
    now.update(ending)

    # 1. shrink: every unit kept loses what it does not keep
    for unit in sorted(before.keys() & after.keys()):
        was, will = before[unit].cpus, after[unit].cpus
        if was is None or will is None or was <= will:
            continue
        keep = was & will
        if keep:
            ops.append(Op(Kind.SET, unit, {CPUS: _mask(keep)}, {CPUS: _mask(was)}))
            holding[unit] = claim(unit, keep)
            shrunk(unit, keep)

    # 2. units that are no longer ours
    for unit in sorted(before.keys() - after.keys()):
        spec = now[unit]
        if spec.own:
            ops.append(Op(Kind.STOP, unit, {}, spec.props))
        else:
            current = {k: spec.props[k] for k in spec.restore if k in spec.props}
            ops.append(Op(Kind.RESTORE, unit, spec.restore, current, spec.forget))
        holding.pop(unit, None)

    # 3. grow, set what else changed, start new units; a unit whose new exclusive CPUs a unit
    # not yet handled still holds waits until that one has moved
    # CPUs any unit may hold for a moment (the shared pool's): of the units after the change,
    # so online ones (before a hotplug repair, units may name CPUs that went offline)
    mentioned = CPUSet.union_all(c for spec in after.values() if (c := spec.cpus) is not None)
    rule = waits.Rule(exclusive, shared, mentioned - unsafe, (mentioned & exclusive) - lent,
                      claim)
    walk = waits.Walk(after, rule, _final)
    rest = walk.order(sorted(after), now, holding)
    if rest is None:
        raise NoSafeOrder(walk.stuck)
    return Transaction(tuple(ops + rest))


def _final(unit: str, before: UnitSpec | None, after: UnitSpec) -> list[Op]:
    if before is None:
        if after.own:
            return [Op(Kind.START, unit, after.props)]
        return [Op(Kind.SET, unit, after.props, after.restore, after.forget, adopt=True)]
    if before.own != after.own:
        stop_or_restore = (Op(Kind.STOP, unit, {}, before.props) if before.own
                           else Op(Kind.RESTORE, unit, before.restore, before.props,
                                   before.forget))
        return [stop_or_restore, *_final(unit, None, after)]
    diff = _differs(after.props, before.props)
    if not diff:
        return []
    becomes = diff.get(PARTITION)
    if becomes and becomes[1] not in NOT_PARTITION and len(diff) > 1:
        rest = {k: v for k, v in diff.items() if k != PARTITION}
        return [Op(Kind.SET, unit, rest, {k: before.props[k] for k in rest if k in before.props}),
                Op(Kind.SET, unit, {PARTITION: becomes},
                   {PARTITION: before.props.get(PARTITION, ("s", "member"))})]
    undo = {k: before.props[k] for k in diff if k in before.props}
    return [Op(Kind.SET, unit, diff, undo)]


class Effector(Protocol):
    """The systemd calls a transaction is made of."""

    async def start_transient(self, unit: str, props: Props) -> None: ...

    async def set_properties(self, unit: str, props: Props, missing_ok: bool = False) -> None: ...

    async def stop(self, unit: str) -> None: ...

    async def remove_overrides(self, unit: str, names: Sequence[str]) -> None: ...


class Batching(Effector, Protocol):
    """An effector that sets some units together: consecutive SETs of such units run as one
    call (the kernel's interrupts and workqueues are written by one oneshot)."""

    def batched(self, unit: str) -> bool: ...

    async def set_many(self, writes: Mapping[str, Props]) -> None: ...


def _moves(op: Op) -> tuple[CPUSet, CPUSet] | None:
    """The CPUs a SET gives its unit and those it takes away ((EMPTY, EMPTY): it changes no
    CPU; None: not known, its unit had no AllowedCPUs of its own before)."""
    if CPUS not in op.props:
        return EMPTY, EMPTY
    if CPUS not in op.undo_props:
        return None
    will, was = (CPUSet.from_mask(bytes(p[CPUS][1])) for p in (op.props, op.undo_props))
    return will - was, was - will


def _independent(a: Op, b: Op) -> bool:
    """Whether two SETs of a plan may run in either order: neither gives a CPU the other takes
    away (so no order passes through a state the plan's own does not allow), and neither is a
    partition's or an adoption."""
    if a.adopt or b.adopt or PARTITION in a.props or PARTITION in b.props:
        return False
    ma, mb = _moves(a), _moves(b)
    if ma is None or mb is None:
        return ma == (EMPTY, EMPTY) or mb == (EMPTY, EMPTY)
    return not (ma[0] & mb[1] or mb[0] & ma[1])


def groups(ops: Sequence[Op], effector: Effector,
           batcher: Batching | bool | None = True) -> list[list[Op]]:
    """The operations as the effector runs them: one each, consecutive batched SETs of distinct
    units together (one call), consecutive STARTs of distinct units together (issued at
    once: new units wait for nobody, so none waits for another's job), and consecutive SETs of
    distinct units that do not depend on each other's order together (issued at once: the
    shrinking holders of the shared pool, say). ``batcher``: the effector as a Batching one or
    None, when the caller knows (True: find out)."""
    out: list[list[Op]] = []
    found = _batcher(effector) if batcher is True else \
        None if isinstance(batcher, bool) else batcher
    batched = found.batched if found is not None else lambda unit: False

    def joins(op: Op, group: list[Op]) -> bool:
        if any(o.unit == op.unit for o in group) or op.kind is not group[0].kind:
            return False
        if op.kind is Kind.START:
            return True
        if op.kind is not Kind.SET:
            return False
        if batched(op.unit) or batched(group[0].unit):
            return batched(op.unit) and batched(group[0].unit)
        return all(_independent(op, o) for o in group)

    for op in ops:
        if out and joins(op, out[-1]):
            out[-1].append(op)
        else:
            out.append([op])
    return out


def _batcher(effector: Effector) -> Batching | None:
    """``effector`` as a Batching one, or None. Asked of its type, once: a runtime protocol
    check walks the protocol's members (~8 us), and every change asks."""
    return cast(Batching, effector) if _batches(type(effector)) else None


@functools.cache
def _batches(kind: type) -> bool:
    return all(callable(getattr(kind, member, None)) for member in ("batched", "set_many"))


async def run_op(effector: Effector, op: Op) -> None:
    if op.kind is Kind.START:
        await effector.start_transient(op.unit, op.props)
    elif op.kind is Kind.STOP:
        await effector.stop(op.unit)
    elif op.kind is Kind.RESTORE:
        await effector.set_properties(op.unit, op.props, missing_ok=True)
        if op.forget:
            await effector.remove_overrides(op.unit, op.forget)
    elif op.props:
        await effector.set_properties(op.unit, op.props)


def inverse(op: Op) -> Op | None:
    if op.keep:
        return None
    if op.kind is Kind.START:
        return Op(Kind.STOP, op.unit)
    if op.kind is Kind.STOP:
        return Op(Kind.START, op.unit, op.undo_props) if op.undo_props else None
    if op.adopt:  # the unit goes back to its owner: its own values, its overrides removed
        return Op(Kind.RESTORE, op.unit, op.undo_props, forget=op.forget)
    return Op(Kind.SET, op.unit, op.undo_props) if op.undo_props else None


class Failed(Exception):
    """A step failed; the steps done before it were undone (``clean``), or some undo failed or
    the failed step may have been done in part."""

    def __init__(self, cause: Exception, step: Op, clean: bool) -> None:
        super().__init__(str(cause))
        self.cause, self.step, self.clean = cause, step, clean


async def execute(tx: Transaction, effector: Effector,
                  last: Callable[[], None] | None = None) -> None:
    """Run the operations in order; when one fails, undo the ones done, newest first, and raise
    Failed. (A crash, BaseException, leaves what was done: startup reconciles it.) ``last`` is
    called once, just before the last group of operations is run (what is then left is
    waiting for systemd)."""
    done: list[Op] = []
    batcher = _batcher(effector)
    found = groups(tx.ops, effector, batcher)
    for i, group in enumerate(found):
        if last is not None and i == len(found) - 1:
            last()
        op = group[0]
        together = len(group) > 1 and not (batcher is not None and batcher.batched(op.unit))
        try:
            if together:
                await _run_all(effector, group, done)
            elif len(group) > 1 and batcher is not None:
                await batcher.set_many({o.unit: o.props for o in group})
            else:
                await run_op(effector, op)
        except Exception as exc:
            if isinstance(exc, _PartFailed):
                op, exc = exc.op, exc.cause
            log.error("reconcile step '%s' failed (%s); undoing %d step(s)", op, exc, len(done))
            # a batched write (the kernel's interrupts and workqueues) may have been done in
            # part: not clean, so that the caller makes the units match what it observes
            clean = not (batcher is not None and batcher.batched(op.unit))
            for earlier in reversed(done):
                undo = inverse(earlier)
                try:
                    if undo is not None:
                        await run_op(effector, undo)
                except Exception as again:
                    log.error("undo of '%s' failed: %s", earlier, again)
                    clean = False
            raise Failed(exc, op, clean) from exc
        if not together:
            done.extend(group)


class _PartFailed(Exception):
    def __init__(self, op: Op, cause: Exception) -> None:
        super().__init__(str(cause))
        self.op, self.cause = op, cause


async def _run_all(effector: Effector, group: Sequence[Op], done: list[Op]) -> None:
    """Run the operations of ``group`` at once (none waits for another's job); the ones that
    were done join ``done``, in the group's order, whatever happens to the others. The first
    failure is raised as _PartFailed; a crash (a BaseException) as it is, undoing nothing."""
    results = await asyncio.gather(*(run_op(effector, o) for o in group),
                                   return_exceptions=True)
    failed: _PartFailed | None = None
    for o, result in zip(group, results, strict=True):
        if result is None:
            done.append(o)
        elif not isinstance(result, Exception):
            raise result
        elif failed is None:
            failed = _PartFailed(o, result)
    if failed is not None:
        raise failed
