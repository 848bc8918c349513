"""Which NUMA nodes a bound allocation goes to (alignment, strategy, fewest foreign nodes and
sockets). Pure."""


from __future__ import annotations

from collections.abc import Mapping
from itertools import combinations
from math import comb

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    InsufficientCPUs,
)
from cpuservice.model.pools import Ledger
from cpuservice.model.request import (
    NumaAlignment,
    Options,
    Policy,
)
from cpuservice.model.topology import Topology
from cpuservice.model.vocab import MOST_ALLOCATED
from cpuservice.placement.pack import whole_core_step

_MAX_COMBOS = 5_000


def _quotas(topology: Topology, free: list[int], n: int, policy: str) -> list[int]:
    """distribute-evenly's share of each node: _even_split, in whole cores for full-pcpus
    (where the nodes hold whole cores)."""
    step = whole_core_step(topology) if policy == Policy.FULL_PCPUS else 1
    if step > 1 and sum(f // step for f in free) >= n // step:
        return [q * step for q in _even_split([f // step for f in free], n // step)]
    return _even_split(free, n)  # cores split over nodes (never seen on hardware)


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


def _nodes_for(
    topology: Topology,
    ledger: Ledger,
    free: Mapping[int, int],
    n: int,
    opts: Options,
    anchor: CPUSet,
) -> list[int]:
    """The NUMA nodes to place in, in order of preference, from the candidates' count per node
    (nodes with none left out)."""
    align = opts.numa_alignment
    sign = 1 if opts.numa_strategy == MOST_ALLOCATED else -1
    if not anchor:  # the common case: min(singles, key=order) below, without the closures
        first: tuple[int, int] | None = None
        for x, k in free.items():
            if k >= n and (first is None or (sign * k, x) < first):
                first = (sign * k, x)
        if first is not None:
            return [first[1]]
    node_of = topology.levels[1]
    anchored = {node_of[c] for c in anchor}

    def order(x: int) -> tuple[bool, int, int]:
        return (x not in anchored, sign * free[x], x)

    singles = [x for x in free
               if free[x] >= n and (align == NumaAlignment.BEST_EFFORT or anchored <= {x})]
    if singles:
        return [min(singles, key=order)]
    if align == NumaAlignment.SINGLE_NUMA_NODE:
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
        if align == NumaAlignment.RESTRICTED:
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
