"""Units that wait for each other's exclusive CPUs (cpuservice.apply.reconcile, step 3): the
extra steps that let them through without an exclusive CPU in two units at any instant. Pure.

``steps`` lists them, best first, and the reconcile walk tries the next when one leads to a
wait with no step out: one of the units passes through CPUs no unit holds exclusively (parking:
the shared pool's, when some of them stay shared); units give up CPUs for a moment (narrowing:
the units holding CPUs one waits for shrink off them, to what they keep, else to one CPU, as a
unit never holds nothing, and the one waiting takes what is free of its target, leaving its old
CPUs to the others); or one steps aside onto a CPU nobody holds yet (a new unit's, which waits).
A narrowing is safe; a double holding is not. Units holding one CPU each that swap with nothing
free have no safe order at all: the change is refused (NoSafeOrder)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from cpuservice.apply.ops import CPUS, NOT_PARTITION, PARTITION, Kind, Op, UnitSpec, mask
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import InsufficientCPUs


class NoSafeOrder(InsufficientCPUs):
    """The units cannot reach their CPUs without an exclusive CPU in two of them at once: the
    change is refused before anything is touched (a caller sees InsufficientCPUs)."""

    def __init__(self, units: Sequence[str]) -> None:
        super().__init__(
            f"units {', '.join(units)} wait for each other's CPUs and no order was found that "
            "keeps every exclusive CPU in one unit at a time (nothing free to pass through, "
            "none able to give up a CPU)")
        self.units = tuple(units)


Step = tuple[list[Op], dict[str, CPUSet]]  # operations, and what the units they set hold then
Wants = Mapping[str, CPUSet | None]  # pending unit -> what it is to hold, as the rule sees it


@dataclass(frozen=True)
class Rule:
    """What the ordering rule protects in one plan. ``exclusive``: whole CPUs of a bound
    allocation before or after; ``shared``: the shared pool's after (the units that are to hold
    one of them may hold it together meanwhile, as they will); ``parking``: CPUs any unit may
    pass through (not exclusive, not lent); ``spare``: exclusive CPUs a unit may step aside
    onto while no unit holds them (never a lent one); ``claim``: a unit's CPUs as the rule sees
    them (the borrow slice's lent ones are nobody's)."""

    exclusive: CPUSet
    shared: CPUSet
    parking: CPUSet
    spare: CPUSet
    claim: Callable[[str, CPUSet], CPUSet]

    def blocking(self, unit: str, wants: Wants, holding: Mapping[str, CPUSet]) -> CPUSet:
        """The exclusive CPUs ``unit`` holds that another unit that wants one waits for: all
        but those of the shared pool it is to hold too."""
        return (holding[unit] & self.exclusive) - ((wants.get(unit) or EMPTY) & self.shared)

    def waited_for(self, unit: str, pending: Sequence[str], wants: Wants,
                   holding: Mapping[str, CPUSet]) -> bool:
        """Whether another pending unit waits for CPUs ``unit`` holds."""
        held = self.blocking(unit, wants, holding)
        return any(v != unit and (wants[v] or EMPTY) & held for v in pending)


def steps(pending: Sequence[str], wants: Wants, now: Mapping[str, UnitSpec],
          holding: Mapping[str, CPUSet], rule: Rule) -> list[Step]:
    """The ways to break a wait of units for each other's exclusive CPUs, best first: one of
    them parks (when there are CPUs to park on), then each narrowing (see _unblock) in rank
    order, then one of them steps aside onto a spare CPU no unit holds now (one a unit not
    started yet is to have, or one a unit leaving gave up: who is to have it waits). The
    caller tries the next when one leads nowhere."""
    waited = [v for v in pending if v in holding and rule.waited_for(v, pending, wants, holding)]
    out = [] if not waited or not rule.parking else [_park(waited, now, rule.parking)]
    found = [step for v in waited if (step := _unblock(v, pending, wants, now, holding, rule))]
    out += [(ops, holds) for _, ops, holds in sorted(found, key=lambda f: f[0])]
    # stepping aside: the shared pool's holders go together (they may hold a CPU together)
    groups: dict[CPUSet | str, list[str]] = {}
    for v in pending:
        if v in holding:
            groups.setdefault((wants[v] or EMPTY) & rule.shared or v, []).append(v)
    for group in groups.values():
        free = rule.spare - CPUSet.union_all(c for u, c in holding.items() if u not in group)
        aside = next((one for c in free
                      if any(holding[u] != (one := CPUSet((c,))) for u in group)), None)
        if aside is not None and any(u in waited for u in group):
            out.append(([Op(Kind.SET, u, {CPUS: mask(aside)}, {CPUS: mask(now[u].cpus or EMPTY)})
                         for u in group if holding[u] != aside],
                        {u: rule.claim(u, aside) for u in group}))
    return out


def _park(waited: Sequence[str], now: Mapping[str, UnitSpec], parking: CPUSet) -> Step:
    """The first unit others wait for (one that is not a partition, when there is one) moves to
    ``parking`` (a partition stops being one first)."""
    unit = next((u for u in waited if not is_partition(now[u])), waited[0])
    ops = []
    had = now[unit].props
    if is_partition(now[unit]):
        ops.append(Op(Kind.SET, unit, {PARTITION: ("s", "member")}, {PARTITION: had[PARTITION]}))
    ops.append(Op(Kind.SET, unit, {CPUS: mask(parking)}, {CPUS: had[CPUS]}))
    return ops, {unit: parking}


def _unblock(v: str, pending: Sequence[str], wants: Wants, now: Mapping[str, UnitSpec],
             holding: Mapping[str, CPUSet], rule: Rule
             ) -> tuple[tuple[int, int, int], list[Op], dict[str, CPUSet]] | None:
    """Narrowing for ``v``: the units holding exclusive CPUs of its target shrink off them (to
    the rest of what they hold, else to one CPU; one that holds a single such CPU keeps it),
    and ``v``, unless that left it nothing to wait for, moves to what is free of its target
    (so it no longer holds what others wait for). Its rank (best first: no such partial move,
    the fewest of cpuservice's own slices shrunk, so that the shared pool's holders narrow
    before an allocation's slice does, no unit shrunk to one CPU), the operations, and what
    the units it sets hold then; None when it would free no CPU ``v`` waits for."""
    want = (wants[v] or EMPTY) & rule.exclusive
    blockers = [u for u in pending if u != v and u in holding
                and rule.blocking(u, wants, holding) & want]
    # a unit that holds one CPU, which v wants, cannot give it up: v goes without it for now,
    # and the others shrunk to one CPU keep one of those if they can
    stuck = CPUSet.union_all(holding[u] for u in blockers if len(holding[u]) < 2
                             and holding[u] <= want)
    ops: list[Op] = []
    holds: dict[str, CPUSet] = {}
    to_one = own = 0  # units shrunk to one CPU, cpuservice's own slices shrunk
    for u in blockers:
        keep = holding[u] - want
        if not keep:
            if len(holding[u]) < 2:
                continue
            keep, to_one = CPUSet((max(holding[u] & stuck or holding[u]),)), to_one + 1
        own += now[u].own
        had = now[u].cpus or EMPTY
        cpus = had - (holding[u] - keep)
        ops.append(Op(Kind.SET, u, {CPUS: mask(cpus)}, {CPUS: mask(had)}))
        holds[u] = rule.claim(u, cpus)
    then = {**holding, **holds}
    blocked = want & CPUSet.union_all(rule.blocking(u, wants, then)
                                      for u in pending if u != v and u in holding)
    if not want - blocked - holding[v]:
        return None  # frees nothing v does not have
    partial = bool(blocked)
    if partial:  # v takes what is free of its target and leaves its old CPUs to the others
        cpus = (wants[v] or EMPTY) - blocked  # not empty: blocked is less than want
        ops.append(Op(Kind.SET, v, {CPUS: mask(cpus)}, {CPUS: mask(now[v].cpus or EMPTY)}))
        holds[v] = rule.claim(v, cpus)
    return (int(partial), own, int(to_one > 0)), ops, holds


SEARCH = 64  # ways out of a wait tried per plan (each one a step of the walk), at most


class Walk:
    """Step 3: units get what they are to have once no unit they wait for holds it. Units that
    wait for each other (two that swap CPUs, a longer cycle) take an extra step first
    (``steps``: one passes through the parking CPUs, the non-exclusive ones; units narrow
    for a moment; one steps aside onto a spare CPU no unit holds); when the first way out
    leads to another wait with none, the next is tried, up to SEARCH in all.
    ``stuck``: the units of the first wait with no way out; ``final``: the operations that
    give a unit what it is to have (reconcile's)."""

    def __init__(self, after: Mapping[str, UnitSpec], rule: Rule,
                 final: Callable[[str, UnitSpec | None, UnitSpec], list[Op]]) -> None:
        self.after, self.rule, self.final = after, rule, final
        self.wants = {u: None if (c := spec.cpus) is None else rule.claim(u, c)
                      for u, spec in after.items()}
        self.budget, self.stuck = SEARCH, list[str]()
        self.seen: set[tuple[tuple[str, ...], frozenset[tuple[str, CPUSet]]]] = set()

    def order(self, pending: list[str], now: dict[str, UnitSpec], holding: dict[str, CPUSet]
              ) -> list[Op] | None:
        """The operations from ``now`` (``holding``: what each unit holds, as the rule sees
        it) until every pending unit has what it is to have; None: no safe order found."""
        ops: list[Op] = []
        rule = self.rule
        while pending:
            wants = {u: self.wants[u] for u in pending}
            # new units start once every unit that is there already is done (none waits for
            # them): until then, the CPUs they are to have are free to step aside onto
            ready = [u for u in ([u for u in pending if u in now] or pending)
                     if not _waits(u, wants, pending, holding, rule)
                     and (u in now or parent_slice(u) not in pending)]
            if not ready:
                seen = (tuple(pending), frozenset(holding.items()))
                if seen in self.seen:  # been here: whatever way out there is, it was tried
                    return None
                self.seen.add(seen)
                for extra, holds in steps(pending, wants, now, holding, rule):
                    if self.budget <= 0:
                        break
                    self.budget -= 1
                    moved = dict(now)
                    for op in extra:
                        moved[op.unit] = replace(moved[op.unit],
                                                 props={**moved[op.unit].props, **op.props})
                    rest = self.order(list(pending), moved, {**holding, **holds})
                    if rest is not None:
                        return ops + extra + rest
                self.stuck = self.stuck or list(pending)
                return None
            for unit in ready:
                pending.remove(unit)
                ops.extend(self.final(unit, now.get(unit), self.after[unit]))
                will = wants[unit]
                if will is None:
                    holding.pop(unit, None)
                else:
                    holding[unit] = will
        return ops


def parent_slice(unit: str) -> str:
    """The slice a slice is in by its name (``a-b.slice`` is in ``a.slice``; "" for a top-level
    one or another kind of unit): a new slice starts after its new parent (a borrower's slice
    after the borrow slice), which would otherwise be made, bare, by systemd for it."""
    if not unit.endswith(".slice") or "-" not in unit:
        return ""
    return unit[:-len(".slice")].rsplit("-", 1)[0] + ".slice"


def _waits(unit: str, wants: Wants, pending: Sequence[str],
           holding: Mapping[str, CPUSet], rule: Rule) -> bool:
    will = wants[unit]
    if will is None or not will & rule.exclusive:
        return False
    return any(u != unit and u in holding and rule.blocking(u, wants, holding) & will
               for u in pending)


def is_partition(spec: UnitSpec) -> bool:
    value = spec.props.get(PARTITION)
    return value is not None and value[1] not in NOT_PARTITION
