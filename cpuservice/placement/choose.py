"""The choice code: which whole CPUs and which fragment CPU a bound request takes, read from a
Free view. The one engine: allocate, resize and repair make one choice on a fresh view, capacity
counts choices on one view until one fails. Pure.

Whole CPUs here, the fragment's CPU in fragment.py, both within the shared pool's floor in
``take``. Whole CPUs: exclusivity (numa falls back to pcpu), free isolated CPUs first, the NUMA
nodes (nodes.py), then the policy's pick inside them (pack.py). Where nothing is near, the pick
is followed down socket, node and L3 group on the counts per cell and run only on the cell it
reaches (the same result as running it on every candidate, without looking at them)."""


from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.request import (
    Exclusive,
    Options,
    Policy,
)
from cpuservice.model.vocab import DISTRIBUTE_EVENLY, NO_ALIGNMENT, NUMA_EXCLUSIVE, SPREAD_PCPUS
from cpuservice.placement.fragment import STRICT_ALIGNMENT, _take_fragment, take_fragment
from cpuservice.placement.free import ANY, FAR, LOCKED, MINE, NEAR, NOT_MINE, Cell, Free
from cpuservice.placement.nodes import _nodes_for, _quotas
from cpuservice.placement.pack import _pick, _take, no_whole_cores, whole_core_step
from cpuservice.placement.refusals import floor, refusal, shortage, too_few


def attempts(opts: Options) -> tuple[Exclusive, ...]:
    """The exclusivity take_whole tries in turn: numa falls back to pcpu."""
    if opts.exclusive == NUMA_EXCLUSIVE:
        return Exclusive.NUMA, Exclusive.PCPU
    return (opts.exclusive,)


def take_whole(free: Free, n: int, anchor: CPUSet = EMPTY) -> list[int]:
    """``n`` more whole CPUs for a bound allocation that already holds ``anchor`` (hidden from
    ``free``'s candidates). With option near, first (near-policy preferred) or only (required)
    among the CPUs next to its devices. Cores kept next to devices (cpuservice.model.keep):
    those kept for its own devices first; those kept for others never, or (when-full) only
    for what nothing else holds."""
    if n <= 0:
        return []
    if free.mine:
        with contextlib.suppress(InsufficientCPUs):
            return _first(free, n, anchor, MINE, NOT_MINE)
    try:
        if free.near is None:  # (_near_whole's first step)
            return _take_whole(free, n, anchor, "")
        return _near_whole(free, n, anchor, "")
    except InsufficientCPUs:
        if not (free.soft and free.locked):
            raise
    try:  # when-full: the kept cores only for what nothing else holds
        return _first(free, n, anchor, "", LOCKED)
    except InsufficientCPUs:
        return _near_whole(free, n, anchor, ANY)


def _first(free: Free, n: int, anchor: CPUSet, first: str, then: str) -> list[int]:
    """As many of ``n`` as the candidates marked ``first`` hold (in whole cores for
    full-pcpus), the rest among those marked ``then``."""
    step = whole_core_step(free.topology) if free.opts.policy == Policy.FULL_PCPUS else 1
    only = NEAR if free.near is not None and free.near_required else ""
    room = sum(free.view(attempts(free.opts)[-1] + only + first)[1].values())
    k = min(room, n) // step * step
    if k >= n:
        return _near_whole(free, n, anchor, first)
    part = _near_whole(free, k, anchor, first) if k > 0 else []
    return part + _near_whole(free, n - k, anchor | CPUSet(part), then)


def _near_whole(free: Free, n: int, anchor: CPUSet, marks: str) -> list[int]:
    """take_whole's choice for option near, among the candidates ``marks`` leave."""
    if n <= 0:
        return []
    if free.near is None:
        return _take_whole(free, n, anchor, marks)
    try:
        return _take_whole(free, n, anchor, NEAR + marks)
    except InsufficientCPUs as exc:
        if free.near_required:
            raise InsufficientCPUs(f"{refusal(free)}: {exc}") from None
    # preferred: as many as fit next to the devices, the rest elsewhere
    step = whole_core_step(free.topology) if free.opts.policy == Policy.FULL_PCPUS else 1
    room = sum(free.view(attempts(free.opts)[-1] + NEAR + marks)[1].values())
    k = min(room, n - 1) // step * step
    if k > 0:
        with contextlib.suppress(InsufficientCPUs):
            part = _take_whole(free, k, anchor, NEAR + marks)
            return part + _take_whole(free, n - k, anchor | CPUSet(part), FAR + marks)
    return _take_whole(free, n, anchor, marks)


def _take_whole(free: Free, n: int, anchor: CPUSet, mark: str) -> list[int]:
    error: InsufficientCPUs | None = None
    # a restricted (NEAR) try of near-policy preferred finds its own exclusive=numa failures;
    # a try marked for kept cores (whose candidates are not those of the next) none
    near_only = bool(mark) and not free.near_required
    kept = bool(mark) and mark not in (NEAR, FAR)  # marked MINE, NOT_MINE, LOCKED or ANY
    for avoid in attempts(free.opts):
        failed = free.numa_failed_near if near_only else free.numa_failed
        if avoid == NUMA_EXCLUSIVE and failed and not kept:
            continue
        try:
            return _isolated_first(free, avoid + mark, n, anchor)
        except InsufficientCPUs as exc:
            error = exc
            if avoid == Exclusive.NUMA and kept:
                pass
            elif avoid == Exclusive.NUMA and near_only:
                free.numa_failed_near = True
            elif avoid == Exclusive.NUMA:
                free.numa_failed = True
    raise error if error is not None else InsufficientCPUs("no CPUs")


def _isolated_first(free: Free, avoid: str, n: int, anchor: CPUSet) -> list[int]:
    """Free isolated CPUs (kernel isolcpus: never shared, meant for bound work) come first: a
    request they can hold takes them, and one the shared pool's budget cannot cover takes all
    of them and the rest from the shared pool (not where NUMA alignment is strict)."""
    if not free.free_isolated:  # (the rest of this is about them)
        return _take_in_nodes(free, avoid, n, anchor)
    iso_view, iso_counts = free.view(f"{avoid}/iso")
    n_iso = sum(iso_counts.values())
    if n_iso and n_iso >= n:
        with contextlib.suppress(InsufficientCPUs):
            return _take_in_nodes(free, f"{avoid}/iso", n, anchor)
    got = _take_in_nodes(free, avoid, n, anchor)
    if (n_iso and n_iso < n and free.from_shared(got) > free.budget()
            and free.opts.numa_alignment not in STRICT_ALIGNMENT):
        iso = sorted(c for cs in iso_view.values() for c in cs)
        return iso + _take_in_nodes(free, f"{avoid}/shared", n - n_iso, anchor | CPUSet(iso))
    return got


def _take_in_nodes(free: Free, key: str, n: int, anchor: CPUSet) -> list[int]:
    """n CPUs of the candidates ``key`` (Free.candidates): the NUMA nodes, then the policy's
    pick inside them, near ``anchor``."""
    opts, topology = free.opts, free.topology
    cands, counts = free.view(key)
    near = anchor.ids
    available = sum(counts.values())
    if available < n:
        raise shortage(free.ledger, too_few(n, available, opts.policy))
    if opts.numa_alignment != NO_ALIGNMENT and len(topology.nodes) > 1:
        nodes = _nodes_for(topology, free.ledger, counts, n, opts, anchor)
        if opts.numa_strategy == DISTRIBUTE_EVENLY and len(nodes) > 1:
            out: list[int] = []
            quotas = _quotas(topology, [counts[x] for x in nodes], n, opts.policy)
            for x, quota in zip(nodes, quotas, strict=False):
                out += _pick(topology, free.everything(key, (x,)), quota,
                             near | frozenset(out), opts.policy, free.shy, free.level((x,)))
            return out
        counts = dict(zip(nodes, map(counts.__getitem__, nodes), strict=True))  # no comp frame
    if free.steps and not near and free.cells.nested:  # the walks assume nothing near
        if opts.policy == SPREAD_PCPUS:
            return _spread(free, key, cands, counts, n)
        if topology.threads_per_core == 1:
            return _walk(free, cands, counts, n)
        got = _packed(free, key, cands, counts, n)  # packed or full-pcpus
        if got is not None:
            return got
    cands_in, level, classes = free.picking(key, counts)
    return _pick(topology, cands_in, n, near, opts.policy, free.shy, level, classes)


def _spread(free: Free, key: str, cands: Mapping[Cell, Collection[int]],
            counts: Mapping[int, int], n: int) -> list[int]:
    """_pick for spread-pcpus over the candidates of the nodes in ``counts``: its first _take
    (over one thread of each partly free core spread-pcpus uses, or when there is none, of each
    wholly free core, or else of each other partly free core) walked on counts when it takes
    all n; otherwise _pick itself."""
    cells_in = free.in_node
    primaries = {cell: free.primaries(cell, key, cands[cell])
                 for x in counts for cell in cells_in[x] if cands[cell]}
    for i in (0, 1, 2):
        there = {cell: p[i] for cell, p in primaries.items() if p[i]}
        per_node: dict[int, int] = {}
        for (x, _), ps in there.items():
            per_node[x] = per_node.get(x, 0) + len(ps)
        if n <= sum(per_node.values()):
            return _walk(free, there, per_node, n)
        if there:
            break
    return _pick(free.topology, free.everything(key, counts), n, frozenset(), free.opts.policy,
                 free.shy)


def _walk(free: Free, cells: Mapping[Cell, Collection[int]], counts: Mapping[int, int], n: int
          ) -> list[int]:
    """_take(the CPUs of ``cells`` in the nodes of ``counts`` (their number there), n, nothing
    near): its socket, node and L3 levels followed on counts while one group holds n, then
    _take inside that group."""
    topology, cells_in = free.topology, free.in_node
    node = _node(free, counts, n) if n < sum(counts.values()) else None
    if node is None:
        everything = [c for x in counts for cell in cells_in[x] for c in cells.get(cell, ())]
        return _take(topology, everything, n, frozenset())
    inside = {cell[1]: cs for cell in cells_in[node] if (cs := cells.get(cell, ()))}
    if n >= counts[node]:
        return [c for cs in inside.values() for c in cs]
    if not free.cells.l3:
        return _take(topology, [c for cs in inside.values() for c in cs], n, frozenset(), 2)
    fitting = [l3 for l3, cs in inside.items() if len(cs) >= n]
    if not fitting:
        return _take(topology, [c for cs in inside.values() for c in cs], n, frozenset(), 2)
    best = min(fitting, key=lambda l3: (len(inside[l3]), l3))
    return _take(topology, list(inside[best]), n, frozenset(), 3)


def _packed(free: Free, key: str, cands: Mapping[Cell, Collection[int]],
            counts: Mapping[int, int], n: int) -> list[int] | None:
    """pack (packed or full-pcpus, nothing near) over the candidates of the nodes in
    ``counts`` on cores of several threads, walked on the per-cell classes
    (Free.packed_classes) where pack's steps are walks with nothing near: whole cores (a walk
    on one thread per wholly free core) when they make all n; else (packed), with no core
    taken whole, loose threads (the first bucket, when it holds all n), or the lowest threads
    of the best-fitting wholly free core. None where pack looks nearer (CPUs already chosen),
    or at cores of fewer threads: pack itself then. full-pcpus without whole cores for n:
    pack's InsufficientCPUs."""
    if n >= sum(counts.values()):
        return None
    tpc, cores, core_of = free.topology.threads_per_core, free.topology.cores, free.core_of
    wide: dict[Cell, list[int]] = {}
    plain: dict[Cell, list[int]] = {}
    shy: dict[Cell, list[int]] = {}
    for x in counts:
        for cell in free.in_node[x]:
            if cands[cell]:
                w, single, p, s = free.packed_classes(cell, key, cands[cell])
                if single:
                    return None
                wide[cell], plain[cell], shy[cell] = w, p, s
    whole = sum(len(w) for w in wide.values())
    k = min(n // tpc, whole)
    if k * tpc == n:
        return [c for p in _walk(free, wide, _per_node(wide), k) for c in cores[core_of[p]]]
    if free.opts.policy == Policy.FULL_PCPUS:  # no single-thread core to make up the rest
        raise no_whole_cores(n, {tpc: whole} if whole else {})
    if k:
        return None  # the rest goes near the cores taken
    for bucket in (plain, shy):
        per_node = _per_node(bucket)
        if per_node:
            return _walk(free, bucket, per_node, n) if n <= sum(per_node.values()) else None
    # no loose thread: n < tpc threads of one wholly free core
    primary = _walk(free, wide, _per_node(wide), 1)[0]
    return sorted(cores[core_of[primary]])[:n]


def _per_node(cells: Mapping[Cell, Collection[int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for (x, _), cs in cells.items():
        if cs:
            counts[x] = counts.get(x, 0) + len(cs)
    return counts


def _node(free: Free, counts: Mapping[int, int], n: int) -> int | None:
    """The node _take(candidates, n, nothing near) descends into, from the candidates' count
    per node; None when it takes CPUs of several nodes (or a node spans sockets)."""
    socket_of = free.cells.node_socket
    if socket_of is None:
        return None
    if len(counts) == 1:
        return next(iter(counts))
    per_socket: dict[int, int] = {}
    for x, k in counts.items():
        per_socket[socket_of[x]] = per_socket.get(socket_of[x], 0) + k
    fitting = [s for s in per_socket if per_socket[s] >= n]
    if not fitting:
        return None
    socket = min(fitting, key=lambda s: (per_socket[s], s))
    inside = {x: k for x, k in counts.items() if socket_of[x] == socket}
    if len(inside) == 1:
        return next(iter(inside))
    if n >= per_socket[socket]:
        return None
    fitting = [x for x in inside if inside[x] >= n]
    return min(fitting, key=lambda x: (inside[x], x)) if fitting else None


def take(free: Free, n: int, pieces: int, anchor: CPUSet = EMPTY, prefer: int | None = None
         ) -> tuple[list[int], int | None, bool]:
    """One bound allocation's choice: ``n`` more whole CPUs (take_whole) beside ``anchor``
    (what it holds already), and a CPU for a fragment of ``pieces`` (none for 0) near all of
    them (take_fragment; ``prefer``: the fragment CPU it had, when that still has room), and
    whether that CPU is fresh; leaving the shared pool its min_shared_cpus. The floor is part
    of the choice: a fragment joins an existing fragment CPU rather than take the pool's last
    CPU. Where the choice fails and the request's preferences have a fallback (near-policy
    preferred, cores kept for others when-full), the same choice without them: a preference
    never refuses what fits without it. allocate, resize and capacity all choose here."""
    try:
        return _choice(free, n, pieces, anchor, prefer, relaxed=False)
    except InsufficientCPUs as exc:
        if not ((free.near is not None and not free.near_required)
                or (free.soft and free.locked)):
            raise
        first = exc
    try:
        return _choice(free, n, pieces, anchor, prefer, relaxed=True)
    except InsufficientCPUs:
        raise first from None


def _choice(free: Free, n: int, pieces: int, anchor: CPUSet, prefer: int | None,
            relaxed: bool) -> tuple[list[int], int | None, bool]:
    """take, with the request's preferences (relaxed: without near-policy preferred, and
    with the cores kept for others when-full)."""
    # relaxed, cores kept for others are candidates only when-full (soft); never stays never
    marks = ANY if free.soft and free.locked else ""
    if not relaxed:
        whole = take_whole(free, n, anchor)
    elif free.near is not None and free.near_required:
        whole = _near_whole(free, n, anchor, marks)
    else:
        whole = _take_whole(free, n, anchor, marks)
    left = free.budget() - free.from_shared(whole) - (free.leaving(anchor) if anchor else 0)
    if left < 0:
        raise floor(free, left)
    if not pieces:
        return whole, None, False
    near = anchor.ids.union(whole) if anchor else whole
    if prefer is not None and prefer not in near and free.rooms.get(prefer, free.g) >= pieces:
        fresh = prefer not in free.rooms
        if not fresh or free.from_shared((prefer,)) <= left:
            return whole, prefer, fresh
    if relaxed:
        only = free.near if free.near is not None and free.near_required else None
        avoid = frozenset() if free.soft else free.locked
        cpu, fresh = _take_fragment(free, pieces, near, only, avoid, left)
    else:
        cpu, fresh = take_fragment(free, pieces, near, left)
    return whole, cpu, fresh
