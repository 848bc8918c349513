"""Bound CPUs for a request: the candidates, kernel-isolated CPUs first, the NUMA nodes, then the
policy's pick; explicit cpusets; the fragment CPU. Pure."""


from __future__ import annotations

import contextlib
from decimal import Decimal

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    InsufficientCPUs,
    InvalidArgument,
)
from cpuservice.model.pools import Allocation, Fragment, Ledger
from cpuservice.model.request import (
    Exclusive,
    NumaAlignment,
    NumaStrategy,
    Options,
    Policy,
    Request,
)
from cpuservice.model.topology import Topology
from cpuservice.placement.nodes import _choose_nodes, _quotas
from cpuservice.placement.pack import _pick, _Rank, pack, whole_core_step

_STRICT_ALIGNMENT = (NumaAlignment.RESTRICTED, NumaAlignment.SINGLE_NUMA_NODE)


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


def _new_allocation(topology: Topology, ledger: Ledger, name: str, request: Request) -> Allocation:
    check_amount(ledger, request)
    if not request.options.bind:
        return Allocation(name, request)
    whole, fragment = bound_cpus(topology, ledger, request, CPUSet(), None)
    return Allocation(name, request, whole, fragment)


def bound_cpus(
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
    _check_policy(topology, request)
    if n <= len(keep):
        whole = CPUSet(_pick(topology, keep.ids, n, frozenset(), opts.policy))
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


def _check_policy(topology: Topology, request: Request) -> None:
    """full-pcpus: the whole CPUs must be a sum of core sizes (any count on a machine with
    single-thread cores)."""
    n = request.whole
    step = whole_core_step(topology)
    if request.options.policy == Policy.FULL_PCPUS and n % step:
        raise InvalidArgument(
            f"policy full-pcpus takes whole physical cores: {n} whole CPUs is not a multiple "
            f"of {step} threads per core"
        )


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
    if avoid != Exclusive.NONE:
        key = topology.levels[3 if avoid == Exclusive.PCPU else 1]
        used = {
            key[c]
            for a in ledger.bound.values()
            if a.request.options.exclusive == opts.exclusive
            for c in a.held
        }
        free = {c for c in free if key[c] not in used}
    if opts.policy == Policy.FULL_PCPUS:
        core = topology.levels[3]
        counts: dict[int, int] = {}
        for c in free:
            counts[core[c]] = counts.get(core[c], 0) + 1
        size = topology.core_size
        free = {c for c in free if counts[core[c]] == size[core[c]]}
    return free


def _attempts(opts: Options) -> tuple[Exclusive, ...]:
    """The exclusivity take_whole tries in turn: numa falls back to pcpu."""
    if opts.exclusive == Exclusive.NUMA:
        return Exclusive.NUMA, Exclusive.PCPU
    return (opts.exclusive,)


def take_whole(
    topology: Topology, ledger: Ledger, opts: Options, n: int, anchor: CPUSet
) -> CPUSet:
    """``n`` more whole CPUs for a bound allocation that already holds ``anchor``."""
    if n <= 0:
        return CPUSet()
    attempts = _attempts(opts)
    error = InsufficientCPUs("no CPUs")
    for avoid in attempts:
        cands = candidates(topology, ledger, opts, avoid) - anchor.ids
        try:
            return CPUSet(_isolated_first(topology, ledger, cands, n, opts, anchor))
        except InsufficientCPUs as exc:
            error = exc
    raise error


def _isolated_first(
    topology: Topology, ledger: Ledger, cands: set[int], n: int, opts: Options, anchor: CPUSet
) -> list[int]:
    """Free isolated CPUs (kernel isolcpus: never shared, meant for bound work) come first: a
    request they can hold takes them, and one the shared pool's budget cannot cover takes all
    of them and the rest from the shared pool (not where NUMA alignment is strict)."""
    iso = cands & ledger.free_isolated.ids
    if iso and len(iso) >= n:
        with contextlib.suppress(InsufficientCPUs):
            return _take_in_nodes(topology, ledger, set(iso), n, opts, anchor)
    got = _take_in_nodes(topology, ledger, cands, n, opts, anchor)
    if (iso and len(iso) < n and len(set(got) - iso) > ledger.shared_budget
            and opts.numa_alignment not in _STRICT_ALIGNMENT):
        rest = _take_in_nodes(topology, ledger, cands - iso, n - len(iso), opts,
                              anchor | CPUSet(iso))
        return sorted(iso) + rest
    return got


def _take_in_nodes(
    topology: Topology,
    ledger: Ledger,
    cands: set[int],
    n: int,
    opts: Options,
    anchor: CPUSet,
) -> list[int]:
    if len(cands) < n:
        raise _shortage(ledger, _too_few(n, len(cands), opts.policy))
    nodes = _choose_nodes(topology, ledger, cands, n, opts, anchor)
    near = anchor.ids

    def shy() -> frozenset[int]:
        return spread_cores(topology, ledger)
    if nodes is None:
        return _pick(topology, cands, n, near, opts.policy, shy)
    node_of = topology.levels[1]
    if opts.numa_strategy == NumaStrategy.DISTRIBUTE_EVENLY and len(nodes) > 1:
        per_node = {x: [c for c in cands if node_of[c] == x] for x in nodes}
        out: list[int] = []
        quotas = _quotas(topology, [len(per_node[x]) for x in nodes], n, opts.policy)
        for x, quota in zip(nodes, quotas, strict=False):
            out += _pick(topology, per_node[x], quota, near | frozenset(out), opts.policy, shy)
        return out
    chosen = set(nodes)
    return _pick(topology, [c for c in cands if node_of[c] in chosen], n, near, opts.policy, shy)


def _too_few(n: int, available: int, policy: str) -> str:
    """The shortage message; counts CPUs, never cores."""
    where = "on whole free cores " if policy == Policy.FULL_PCPUS else ""
    return f"{n} CPUs requested but only {available} CPUs {where}are available"


def spread_cores(topology: Topology, ledger: Ledger) -> frozenset[int]:
    """Cores on which a spread-pcpus allocation holds a thread: packed leaves their other
    threads to later spread-pcpus requests while other threads will do."""
    core_of = topology.levels[3]
    return frozenset(core_of[c] for a in ledger.bound.values()
                     if a.request.options.policy == Policy.SPREAD_PCPUS for c in a.whole)


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
    aligned_only = bool(anchor) and opts.numa_alignment in _STRICT_ALIGNMENT
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
        chosen = pack(topology, [c for c in fresh if rank(c) == nearest], 1, anchor.ids)
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
