"""Inside the chosen nodes, which CPUs: packed and full-pcpus (pack: whole cores, best fit down
socket, node, L3 group, core) and spread-pcpus. Pure."""


from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable

from cpuservice.model.errors import (
    InsufficientCPUs,
)
from cpuservice.model.freeview import Classes, classify
from cpuservice.model.topology import Topology
from cpuservice.model.vocab import FULL_PCPUS, SPREAD_PCPUS


def _pick(
    topology: Topology,
    cands: Collection[int],
    n: int,
    near: frozenset[int],
    policy: str,
    shy: Callable[[], Collection[int]] = frozenset,
    level: int = 0,
    classes: Classes | None = None,
) -> list[int]:
    """``n`` of ``cands`` as ``policy`` takes them (``shy()``: the cores spread-pcpus
    allocations use, asked for only when they matter; ``level``: the candidates lie in one
    group of every level above it, e.g. 2 for one NUMA node of one socket; ``classes``: pack's
    classes of ``cands``, or for spread-pcpus its primaries, when known)."""
    if policy != SPREAD_PCPUS:
        return pack(topology, cands, n, near, strict=policy == FULL_PCPUS, shy=shy,
                    level=level, classes=classes)
    paired: Collection[int]
    full: Collection[int]
    partial: Collection[int]
    if classes is not None:  # FreeView.primaries
        paired, full, partial = classes
    else:
        core_of = topology.levels[3]
        cores: dict[int, list[int]] = {}
        for c in cands:
            cores.setdefault(core_of[c], []).append(c)
        spread = shy()
        size = topology.sizes[3]
        paired = [min(t) for k, t in cores.items() if len(t) != size[k] and k in spread]
        full = [min(t) for k, t in cores.items() if len(t) == size[k]]
        partial = [min(t) for k, t in cores.items() if len(t) != size[k] and k not in spread]
    out: list[int] = []
    for primaries in (paired, full, partial):
        out += _take(topology, primaries, min(n - len(out), len(primaries)), near, level)
    if len(out) < n:
        rest = set(cands) - set(out)
        out += _take(topology, rest, n - len(out), near | frozenset(out), level)
    return out


def whole_core_step(topology: Topology) -> int:
    """The step in which whole cores add up: the greatest common divisor of the core sizes (2
    on SMT-2, 1 on a machine with any single-thread core)."""
    return topology.core_step


def pack(
    topology: Topology,
    cands: Collection[int],
    n: int,
    near: Collection[int] = frozenset(),
    *,
    strict: bool = False,
    shy: Callable[[], Collection[int]] = frozenset,
    level: int = 0,
    classes: Classes | None = None,
) -> list[int]:
    """``n`` of ``cands``, packed without splitting a core that need not be split.

    First whole cores: as many wholly free cores of threads_per_core threads as fit in ``n``,
    chosen by the best-fit walk of _take on one thread per core (so by whole-core counts, near
    ``near`` first). When those run out before the even part of ``n`` is covered, wholly free
    cores of fewer online threads (hybrid machines, or cores with offline threads) make it up,
    nearest first: they hold no lone thread. Then the rest (the odd remainder, or what no whole
    core is left for), one thread at a time where it does the least harm: a loose thread (the
    free sibling of a half-used core), nearest first (a sibling of ``near`` or of the cores just
    taken, then the same L3 group, then the same node), loose threads on ``shy()`` cores last
    within a rank; then single-thread cores; only then a thread of a wholly free core.
    ``strict`` (full-pcpus): never a thread of a core without the others: InsufficientCPUs when
    whole cores cannot make ``n``. ``classes``: classify(topology, cands), when known.
    """
    if n <= 0:
        return []
    tpc = topology.threads_per_core
    if not strict and (tpc == 1 or n >= len(cands)):
        return _take(topology, cands, n, frozenset(near), level) if n < len(cands) else list(cands)
    core_of = topology.levels[3]
    wide, single, loose = classes or classify(topology, cands)
    out: list[int] = []
    k = min(n // tpc, len(wide))
    if k:
        for primary in _take(topology, wide, k, frozenset(near), level):
            out += topology.cores[core_of[primary]].ids
    left = n - len(out)
    if not left:
        return out
    rank = _Rank(topology, [*near, *out])
    if not strict and left >= tpc and single:
        # wide cores ran out before the even part was covered: whole cores of fewer online
        # threads make it up (no lone thread), nearest first; loose threads only for the rest
        out += _whole_cores_of(topology, single, left - left % tpc, rank, exact=False)
        left = n - len(out)
        if not left:
            return out
        taken = set(out)
        single = [c for c in single if c not in taken]
    spread: Collection[int] = shy() if loose and not strict else ()
    cpus: Collection[int]
    for tier in range(1 if strict else 3):
        if strict:
            cpus = _whole_cores_of(topology, single, left)
        elif tier == 2:  # split the best-fitting wholly free core not taken whole (left < tpc)
            taken_cores = {core_of[c] for c in out}
            rest = [p for p in wide if core_of[p] not in taken_cores]
            if rest:
                core = core_of[_take(topology, rest, 1, frozenset([*near, *out]), level)[0]]
                return [*out, *topology.cores[core].sorted()[:left]]  # a wide core's: all
            break
        else:
            cpus = (loose, single)[tier]
        buckets: dict[tuple[int, bool], list[int]] = {}
        for c in cpus:
            buckets.setdefault((rank(c), core_of[c] in spread), []).append(c)
        for key in sorted(buckets):
            bucket = buckets[key]
            got = _take(topology, bucket, min(left, len(bucket)), frozenset([*near, *out]), level)
            out += got
            left -= len(got)
            if not left:
                return out
    singles = Counter(core_of[c] for c in single)  # (strict: single as classes have it)
    sizes = Counter([tpc] * len(wide) + list(singles.values()))
    raise no_whole_cores(n, dict(sizes))


def no_whole_cores(n: int, sizes: dict[int, int]) -> InsufficientCPUs:
    """full-pcpus' refusal; ``sizes``: the number of whole free cores of each size."""
    free = ", ".join(f"{count} of {size} thread{'s' * (size > 1)}"
                     for size, count in sorted(sizes.items(), reverse=True)) or "none"
    return InsufficientCPUs(
        f"{n} CPUs requested but whole free cores cannot make exactly {n} CPUs here "
        f"(whole free cores: {free})"
    )


def _whole_cores_of(
    topology: Topology,
    single: Collection[int],
    n: int,
    rank: Callable[[int], int] = lambda c: 0,
    *,
    exact: bool = True,
) -> list[int]:
    """Threads of whole small cores (from ``single``) adding up to at most ``n``, nearest
    (``rank``) and smallest cores first (full-pcpus on a hybrid machine: one-thread cores make
    an odd remainder); ``exact``: nothing unless they add up to exactly ``n``."""
    core_of = topology.levels[3]
    cores: dict[int, list[int]] = {}
    for c in single:
        cores.setdefault(core_of[c], []).append(c)
    out: list[int] = []
    for k in sorted(cores, key=lambda k: (rank(min(cores[k])), len(cores[k]), k)):
        if len(out) + len(cores[k]) <= n:
            out += sorted(cores[k])
    return out if len(out) == n or not exact else []


_NO_GROUPS: frozenset[int] = frozenset()


def _take(
    topology: Topology, cands: Collection[int], n: int, near: frozenset[int], level: int = 0
) -> list[int]:
    """Best-fit walk down socket -> node -> L3 -> core (see the module docstring)."""
    if n <= 0:
        return []
    if n >= len(cands):
        return list(cands)
    if level == len(topology.levels):
        return sorted(cands)[:n]
    key_of = topology.levels[level]
    parts: dict[int, list[int]] = {}
    for c in cands:
        parts.setdefault(key_of[c], []).append(c)
    if len(parts) == 1:
        return _take(topology, cands, n, near, level + 1)
    near_groups = set(map(key_of.__getitem__, near)) if near else _NO_GROUPS

    def fit(g: int) -> tuple[bool, int, int]:
        return (g not in near_groups, len(parts[g]), g)

    whole_groups = topology.sizes[level]
    if n >= 2 and len(parts) == len(cands):  # one candidate per group: none holds n
        # what the loop below does then: whole groups (of one CPU) first, then the rest, each
        # in order of fit
        ranked = sorted(parts, key=fit) if near_groups else sorted(parts)  # (fit: by g then)
        firsts = [g for g in ranked if whole_groups[g] == 1][:n]
        if len(firsts) < n:
            chosen = set(firsts)
            firsts += [g for g in ranked if g not in chosen][:n - len(firsts)]
        return [parts[g][0] for g in firsts]
    fitting = [g for g in parts if len(parts[g]) >= n]
    if fitting:
        return _take(topology, parts[min(fitting, key=fit)], n, near, level + 1)
    out: list[int] = []
    rest = []
    for g in sorted(parts, key=fit):
        if len(parts[g]) == whole_groups[g] and len(parts[g]) <= n - len(out):
            out += parts[g]
        else:
            rest.append(g)
    while len(out) < n:
        left = n - len(out)
        fitting = [g for g in rest if len(parts[g]) >= left]
        if fitting:
            out += _take(topology, parts[min(fitting, key=fit)], left, near, level + 1)
            break
        biggest = max(rest, key=lambda g: (g in near_groups, len(parts[g]), -g))
        out += parts[biggest]
        rest.remove(biggest)
    return out


class _Rank:
    """0 = SMT sibling of an anchor CPU, 1 = same L3, 2 = same NUMA node, 3 = elsewhere."""

    def __init__(self, topology: Topology, anchor: Iterable[int]) -> None:
        _, node, l3, core = topology.levels
        anchor = list(anchor)
        self._levels = ((core, {core[c] for c in anchor}), (l3, {l3[c] for c in anchor}),
                        (node, {node[c] for c in anchor}))

    def __call__(self, cpu: int) -> int:
        for i, (key, groups) in enumerate(self._levels):
            if key[cpu] in groups:
                return i
        return 3
