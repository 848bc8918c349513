"""Placement: which CPUs a request gets, and what systemd is told. Pure; no I/O.

Bound whole CPUs are chosen in two steps. First the NUMA nodes (alignment and strategy), then,
inside them, a walk down socket -> node -> L3 group -> core -> thread that at every level takes
the best-fitting group that holds the rest of the request (closest to the CPUs the allocation
already has, then fewest free CPUs: packing), or, when none does, whole free groups first and the
remainder in the best-fitting group. So a socket-sized request takes a socket, 2 CPUs on SMT-2 take
one core, and a single thread goes to a partly used core.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from itertools import combinations
from math import comb

from .cpuset import CPUSet
from .errors import AllocationExists, InsufficientCPUs, InvalidArgument, NoSuchAllocation
from .pools import Allocation, Fragment, Ledger
from .request import Options, Request, validate_name
from .topology import Topology

UNLIMITED = 2**32 - 1
WEIGHT_MAX = 10_000
WEIGHT_DEFAULT = 100
USEC_PER_SEC = 1_000_000
_MAX_COMBOS = 5_000


@dataclass(frozen=True)
class Placement:
    """What an allocation runs on and the values systemd enforces.

    ``cpus`` is the AllowedCPUs set (the shared pool for unbound allocations); ``shares`` maps
    each bound CPU to the pieces held on it (a whole CPU = granularity pieces).
    """

    cpus: CPUSet
    whole: CPUSet
    fragment: Fragment | None
    shares: Mapping[int, int]
    memory_nodes: CPUSet
    cpu_quota_usec: int | None
    cpu_weight: int


def cpu_weight(request: Request, fragment: Fragment | None, granularity: int) -> int:
    """CPUWeight: proportional to what the allocation may use where it competes.

    Fractional bound: pieces x 10000 / granularity (20 of 100 pieces -> 2000), so the holders of
    one fragment CPU, siblings under cpuservice-bound.slice, split it in proportion to their
    pieces, and the weights of one CPU's holders never add up to more than 10000. Whole bound: the
    default 100 (nobody else runs there). Unbound: 100 per CPU (0.5 -> 50, 2 -> 200), clamped to
    1..10000, so shared-pool allocations compete in proportion to their size.
    """
    if request.options.bind:
        if fragment is None:
            return WEIGHT_DEFAULT
        return max(1, fragment.pieces * WEIGHT_MAX // granularity)
    return min(WEIGHT_MAX, max(1, int(request.cpus * WEIGHT_DEFAULT)))


def cpu_quota_usec(request: Request) -> int | None:
    """CPUQuota in µs per second: cpus x 100 %; none for whole bound CPUs (they are exclusive)."""
    if request.options.bind and request.fraction == 0:
        return None
    return int(request.cpus * USEC_PER_SEC)


def describe(topology: Topology, ledger: Ledger, allocation: Allocation) -> Placement:
    """The Placement of a committed allocation, against the ledger's current pools."""
    g = ledger.granularity
    shares = {c: g for c in allocation.whole}
    if allocation.fragment:
        shares[allocation.fragment.cpu] = allocation.fragment.pieces
    cpus = allocation.held if allocation.bound and allocation.held else ledger.shared
    return Placement(
        cpus=cpus,
        whole=allocation.whole,
        fragment=allocation.fragment,
        shares=shares,
        memory_nodes=topology.node_set(cpus),
        cpu_quota_usec=cpu_quota_usec(allocation.request),
        cpu_weight=cpu_weight(allocation.request, allocation.fragment, g),
    )


def check_amount(ledger: Ledger, request: Request) -> None:
    """The amount fits the machine and the granularity."""
    online = len(ledger.online)
    if request.cpus > online:
        raise InsufficientCPUs(f"{request.cpus} CPUs is more than this machine's {online} online")
    pieces = request.cpus * ledger.granularity
    if pieces != int(pieces):
        step = Decimal(1) / ledger.granularity
        raise InvalidArgument(
            f"cpus {request.cpus} has more decimals than granularity {ledger.granularity} "
            f"allows (steps of {step})"
        )


def place(topology: Topology, ledger: Ledger, request: Request) -> Placement:
    """Where ``request`` would go now; raises InvalidArgument or InsufficientCPUs."""
    return describe(topology, ledger, _new_allocation(topology, ledger, "-", request))


def allocate(
    topology: Topology, ledger: Ledger, name: str, request: Request
) -> tuple[Ledger, Allocation]:
    """Place and commit ``request`` under ``name``."""
    validate_name(name)
    if name in ledger.allocations:
        raise AllocationExists(f"allocation {name!r} already exists")
    allocation = _new_allocation(topology, ledger, name, request)
    return ledger.with_allocation(allocation), allocation


def release(ledger: Ledger, name: str) -> Ledger:
    if name not in ledger.allocations:
        raise NoSuchAllocation(f"no allocation named {name!r}")
    return ledger.without(name)


def resize(
    topology: Topology, ledger: Ledger, name: str, cpus: Decimal
) -> tuple[Ledger, Allocation]:
    """Change an allocation's size, keeping the CPUs it holds where it can."""
    if name not in ledger.allocations:
        raise NoSuchAllocation(f"no allocation named {name!r}")
    old = ledger.allocations[name]
    if old.request.cpuset is not None and cpus != old.request.cpus:
        raise InvalidArgument(f"allocation {name!r} is pinned to CPUs {old.request.cpuset}")
    request = Request.build(cpus, old.request.options)
    base = ledger.without(name)
    check_amount(base, request)
    if old.bound:
        whole, fragment = _bound(topology, base, request, old.whole, old.fragment)
        new = Allocation(name, request, whole, fragment)
    else:
        new = Allocation(name, request)
    return base.with_allocation(new), new


def capacity(topology: Topology, ledger: Ledger, request: Request) -> int:
    """How many more allocations of exactly this shape fit now (UNLIMITED for unbound)."""
    check_amount(ledger, request)
    if not request.options.bind:
        return UNLIMITED
    count = 0
    limit = len(ledger.online) * ledger.granularity
    while count < limit:
        try:
            ledger, _ = allocate(topology, ledger, f"capacity.{count}", request)
        except InsufficientCPUs:
            break
        count += 1
    return count


def _new_allocation(topology: Topology, ledger: Ledger, name: str, request: Request) -> Allocation:
    check_amount(ledger, request)
    if not request.options.bind:
        return Allocation(name, request)
    whole, fragment = _bound(topology, ledger, request, CPUSet(), None)
    return Allocation(name, request, whole, fragment)


def _bound(
    topology: Topology,
    ledger: Ledger,
    request: Request,
    keep: CPUSet,
    keep_fragment: Fragment | None,
) -> tuple[CPUSet, Fragment | None]:
    """Whole CPUs and fragment for a bound request; ``keep`` and ``keep_fragment`` are what the
    allocation holds already (the ledger no longer counts them as held)."""
    if request.cpuset is not None:
        return _explicit(topology, ledger, request.cpuset), None
    opts = request.options
    n = request.whole
    tpc = topology.threads_per_core
    if opts.policy == "full-pcpus" and n % tpc:
        raise InvalidArgument(
            f"policy full-pcpus takes whole physical cores: {n} whole CPUs is not a multiple "
            f"of {tpc} threads per core"
        )
    if n <= len(keep):
        whole = CPUSet(_take(topology, keep.ids, n, frozenset()))
    else:
        whole = keep | take_whole(topology, ledger, opts, n - len(keep), keep)
    fragment = None
    pieces = int(request.fraction * ledger.granularity)
    if pieces:
        if (
            keep_fragment is not None
            and keep_fragment.cpu in ledger.online
            and keep_fragment.cpu not in whole
            and ledger.free_pieces(keep_fragment.cpu) >= pieces
        ):
            fragment = Fragment(keep_fragment.cpu, pieces)
        else:
            fragment = take_fragment(topology, ledger, opts, pieces, whole)
    taken = whole | CPUSet((fragment.cpu,)) if fragment else whole
    from_shared = len(taken & ledger.shared)
    if from_shared > ledger.shared_budget:
        raise InsufficientCPUs(
            f"this would leave fewer than min_shared_cpus={ledger.min_shared_cpus} CPUs in the "
            f"shared pool ({len(ledger.shared)} now, {from_shared} needed from it)"
        )
    return whole, fragment


def _explicit(topology: Topology, ledger: Ledger, cpuset: CPUSet) -> CPUSet:
    for cpu in cpuset:
        if cpu not in topology.cpus:
            raise InvalidArgument(f"cpuset: CPU {cpu} does not exist")
        if cpu not in ledger.online:
            raise InvalidArgument(f"cpuset: CPU {cpu} is offline")
        if cpu in ledger.reserved:
            raise InvalidArgument(f"cpuset: CPU {cpu} is reserved")
        if cpu in ledger.held:
            owners = ", ".join(ledger.owner_of(cpu))
            raise InsufficientCPUs(f"cpuset: CPU {cpu} is held by {owners}")
    return cpuset


def candidates(topology: Topology, ledger: Ledger, opts: Options, avoid: str) -> set[int]:
    """CPUs this request may take whole, after exclusivity (``avoid``: none|pcpu|numa) and
    policy filters."""
    free = set(ledger.takeable.ids)
    if avoid != "none":
        key = topology.levels[3 if avoid == "pcpu" else 1]
        used = {
            key[c]
            for a in ledger.bound.values()
            if a.request.options.exclusive == opts.exclusive
            for c in a.held
        }
        free = {c for c in free if key[c] not in used}
    if opts.policy == "full-pcpus":
        core = topology.levels[3]
        counts: dict[int, int] = {}
        for c in free:
            counts[core[c]] = counts.get(core[c], 0) + 1
        size = topology.core_size
        free = {c for c in free if counts[core[c]] == size[core[c]]}
    return free


def take_whole(
    topology: Topology, ledger: Ledger, opts: Options, n: int, anchor: CPUSet
) -> CPUSet:
    """``n`` more whole CPUs for a bound allocation that already holds ``anchor``."""
    if n <= 0:
        return CPUSet()
    attempts = ("numa", "pcpu") if opts.exclusive == "numa" else (opts.exclusive,)
    error = InsufficientCPUs("no CPUs")
    for avoid in attempts:
        cands = candidates(topology, ledger, opts, avoid) - anchor.ids
        try:
            return CPUSet(_take_in_nodes(topology, ledger, cands, n, opts, anchor))
        except InsufficientCPUs as exc:
            error = exc
    raise error


def _take_in_nodes(
    topology: Topology,
    ledger: Ledger,
    cands: set[int],
    n: int,
    opts: Options,
    anchor: CPUSet,
) -> list[int]:
    if len(cands) < n:
        what = "whole free cores" if opts.policy == "full-pcpus" else "CPUs"
        raise _shortage(ledger, f"{n} CPUs requested but only {len(cands)} {what} are available")
    nodes = _choose_nodes(topology, ledger, cands, n, opts, anchor)
    near = anchor.ids
    if nodes is None:
        return _pick(topology, cands, n, near, opts.policy)
    node_of = topology.levels[1]
    if opts.numa_strategy == "distribute-evenly" and len(nodes) > 1:
        per_node = {x: [c for c in cands if node_of[c] == x] for x in nodes}
        out: list[int] = []
        for x, quota in zip(nodes, _even_split([len(per_node[x]) for x in nodes], n), strict=False):
            out += _pick(topology, per_node[x], quota, near | frozenset(out), opts.policy)
        return out
    chosen = set(nodes)
    return _pick(topology, [c for c in cands if node_of[c] in chosen], n, near, opts.policy)


def _even_split(free: list[int], n: int) -> list[int]:
    """Split n over groups as evenly as their free counts allow."""
    quotas = [0] * len(free)
    left = n
    while left:
        open_ = [i for i in range(len(free)) if quotas[i] < free[i]]
        share = max(1, left // len(open_))
        for i in sorted(open_, key=lambda i: quotas[i] - free[i]):
            add = min(share, free[i] - quotas[i], left)
            quotas[i] += add
            left -= add
            if not left:
                break
    return quotas


def _choose_nodes(
    topology: Topology,
    ledger: Ledger,
    cands: Collection[int],
    n: int,
    opts: Options,
    anchor: CPUSet,
) -> list[int] | None:
    """The NUMA nodes to place in, in order of preference; None when NUMA doesn't matter."""
    align = opts.numa_alignment
    if align == "none" or len(topology.nodes) <= 1:
        return None
    node_of = topology.levels[1]
    free: dict[int, int] = {}
    for c in cands:
        free[node_of[c]] = free.get(node_of[c], 0) + 1
    anchored = {node_of[c] for c in anchor}
    sign = 1 if opts.numa_strategy == "most-allocated" else -1

    def order(x: int) -> tuple[bool, int, int]:
        return (x not in anchored, sign * free[x], x)

    singles = [x for x in free if free[x] >= n and (align == "best-effort" or anchored <= {x})]
    if singles:
        return [min(singles, key=order)]
    if align == "single-numa-node":
        best = max(free.values(), default=0)
        raise InsufficientCPUs(
            f"numa-alignment single-numa-node: no NUMA node has {n} free CPUs (at most {best})"
        )
    socket_of = topology.levels[0]
    node_socket = {x: socket_of[next(iter(topology.nodes[x]))] for x in free}
    ranked = sorted(free, key=order)
    for k in range(2, len(ranked) + 1):
        if sum(sorted(free.values(), reverse=True)[:k]) < n:
            continue
        combo = _best_combo(ranked, k, n, free, anchored, node_socket, sign)
        if align == "restricted":
            needed = _min_nodes(topology, ledger, n + len(anchor))
            if k + len(anchored - set(combo)) > needed:
                raise InsufficientCPUs(
                    f"numa-alignment restricted: {n + len(anchor)} CPUs fit in {needed} NUMA "
                    f"node(s) on this machine, but the free CPUs would span {k}"
                )
        return sorted(combo, key=order)
    raise InsufficientCPUs(f"{n} CPUs requested but not that many are free")


def _best_combo(
    ranked: list[int],
    k: int,
    n: int,
    free: Mapping[int, int],
    anchored: set[int],
    node_socket: Mapping[int, int],
    sign: int,
) -> tuple[int, ...]:
    """The k nodes with room for n CPUs that touch fewest foreign nodes and sockets."""
    def key(combo: tuple[int, ...]) -> tuple[int, int, int, tuple[int, ...]]:
        return (
            sum(x not in anchored for x in combo),
            len({node_socket[x] for x in combo}),
            sign * sum(free[x] for x in combo),
            combo,
        )

    if comb(len(ranked), k) <= _MAX_COMBOS:
        fits = (c for c in combinations(ranked, k) if sum(free[x] for x in c) >= n)
        return min(fits, key=key)
    greedy: list[int] = []
    for x in ranked:  # too many nodes to enumerate: preferred order, then the roomiest
        greedy.append(x)
        if len(greedy) == k:
            break
    if sum(free[x] for x in greedy) < n:
        greedy = sorted(ranked, key=lambda x: -free[x])[:k]
    return tuple(greedy)


def _min_nodes(topology: Topology, ledger: Ledger, n: int) -> int:
    """Fewest NUMA nodes whose allocatable capacity could hold n CPUs on an empty machine."""
    sizes = sorted((len(cpus - ledger.reserved) for cpus in topology.nodes.values()), reverse=True)
    total = 0
    for k, size in enumerate(sizes, 1):
        total += size
        if total >= n:
            return k
    return len(sizes)


def _pick(
    topology: Topology, cands: Collection[int], n: int, near: frozenset[int], policy: str
) -> list[int]:
    if policy != "spread-pcpus":
        return _take(topology, cands, n, near)
    core_of = topology.levels[3]
    cores: dict[int, list[int]] = {}
    for c in cands:
        cores.setdefault(core_of[c], []).append(c)
    full = [min(t) for k, t in cores.items() if len(t) == len(topology.cores[k])]
    partial = [min(t) for k, t in cores.items() if len(t) != len(topology.cores[k])]
    out: list[int] = []
    for primaries in (full, partial):
        out += _take(topology, primaries, min(n - len(out), len(primaries)), near)
    if len(out) < n:
        rest = set(cands) - set(out)
        out += _take(topology, rest, n - len(out), near | frozenset(out))
    return out


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
    near_groups = {key_of[c] for c in near}

    def fit(g: int) -> tuple[bool, int, int]:
        return (g not in near_groups, len(parts[g]), g)

    fitting = [g for g in parts if len(parts[g]) >= n]
    if fitting:
        return _take(topology, parts[min(fitting, key=fit)], n, near, level + 1)
    whole_groups = _groups_of(topology, level)
    out: list[int] = []
    rest = []
    for g in sorted(parts, key=fit):
        if len(parts[g]) == len(whole_groups[g]) and len(parts[g]) <= n - len(out):
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


def _groups_of(topology: Topology, level: int) -> Mapping[int, CPUSet]:
    return (topology.sockets, topology.nodes, topology.l3_groups, topology.cores)[level]


def take_fragment(
    topology: Topology, ledger: Ledger, opts: Options, pieces: int, anchor: CPUSet
) -> Fragment:
    """A CPU with ``pieces`` free pieces, near ``anchor`` (the allocation's whole CPUs).

    An existing fragment CPU that is an SMT sibling of, shares an L3 with or sits on the NUMA node
    of the whole CPUs comes first (fewest free pieces first); then a fresh CPU from the shared
    pool, nearest first; then any fragment CPU with room (unless NUMA alignment forbids it).
    """
    g = ledger.granularity
    rank = _Rank(topology, anchor)
    aligned_only = bool(anchor) and opts.numa_alignment in ("restricted", "single-numa-node")
    existing = [
        c for c, used in ledger.fragment_pieces.items()
        if g - used >= pieces and c not in anchor and (not aligned_only or rank(c) <= 2)
    ]
    best = min(existing, key=lambda c: (rank(c), g - ledger.fragment_pieces[c], c), default=None)
    if best is not None and (rank(best) <= 2 or not anchor):
        return Fragment(best, pieces)
    fresh = [c for c in ledger.takeable - anchor if not aligned_only or rank(c) <= 2]
    if fresh:
        nearest = min(map(rank, fresh))
        chosen = _take(topology, [c for c in fresh if rank(c) == nearest], 1, anchor.ids)
        return Fragment(chosen[0], pieces)
    if best is not None:
        return Fragment(best, pieces)
    raise _shortage(ledger, f"no CPU has {pieces} free pieces (of {g}) for this fragment")


def _shortage(ledger: Ledger, message: str) -> InsufficientCPUs:
    if not ledger.shared_budget:
        message += (
            f"; the shared pool is at its minimum (min_shared_cpus={ledger.min_shared_cpus})"
        )
    return InsufficientCPUs(message)


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
