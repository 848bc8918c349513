"""How many more allocations of one shape fit now (Capacity): closed forms where every allocation
takes interchangeable units, else the engine's choices counted on one Free view. Pure."""


from __future__ import annotations

from types import MappingProxyType

import cpuservice.placement.choose as choose
from cpuservice.model import near
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    InsufficientCPUs,
)
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import (
    Exclusive,
    NearPolicy,
    Request,
)
from cpuservice.model.topology import Topology
from cpuservice.placement.closed import _fragment_capacity, _unit_capacity
from cpuservice.placement.free import NEAR, Free
from cpuservice.placement.whole import _check_policy, bound_cpus, check_amount

UNLIMITED = 2**32 - 1


def capacity(topology: Topology, ledger: Ledger, request: Request) -> int:
    """How many more allocations of exactly this shape fit now (UNLIMITED for unbound): the
    number of times ``allocate`` of ``request`` succeeds in a row on ``ledger``, with the errors
    the first ``allocate`` would raise (InvalidArgument; InsufficientCPUs for more CPUs than are
    online). Always exactly that number (tests/unit/test_capacity.py compares it with allocating
    again and again), but computed from the free structure rather than by committing one
    allocation after another, which for 0.01 on 1,024 CPUs meant 102,300 allocations:

    - an explicit ``cpuset``: 1 or 0 (one placement; afterwards its CPUs are held);
    - no whole CPUs (0.Y): a closed form, _fragment_capacity;
    - whole CPUs only, when every allocation takes the same number of interchangeable units
      (CPUs, whole cores, or for exclusive=pcpu and one CPU, cores) and the shared-pool budget
      does not depend on which CPUs are taken: a closed form over the candidates per NUMA node,
      _unit_capacity (O(CPUs));
    - anything else (X.Y with X >= 1, exclusive=numa, exclusive=pcpu over partly free cores,
      restricted alignment across nodes, free isolated CPUs and a binding budget): here which
      CPUs each allocation takes decides what the next one can take, so the choice code that
      allocate runs (choose.py) makes its choices in turn on one Free view, which each choice
      updates (Free.take) in the cells it touched. That is one step per allocation, but there
      are at most free CPUs / X of them (X >= 1), and a step only looks at the cell it lands in
      (and the counts per node; packed and full-pcpus on SMT cores walk pack's classes kept
      per cell, choose._packed); after exclusive=numa's first phase, or once the isolated CPUs
      or the budget are used up, the rest is a closed form again. On 1,024 CPUs with a
      thousand allocations the slowest shapes take a few tens of milliseconds
      (bench/placement.py: capacity_worst_us). Topologies with a core split over two NUMA
      nodes (never seen on hardware) place with bound_cpus, one allocation at a time.
    """
    check_amount(ledger, request)
    if not request.options.bind:
        return UNLIMITED
    if request.cpuset is not None:
        try:
            bound_cpus(topology, ledger, request, CPUSet(), None)
        except InsufficientCPUs:
            return 0
        return 1
    _check_policy(topology, request)
    pieces = int(request.fraction * ledger.granularity)
    if request.whole == 0:
        # near-policy preferred fills the CPUs next to the devices first, then the others:
        # every fragment CPU and fresh CPU in the end, as without it
        only = near.near_cpus(topology, request.devices) \
            if request.options.near_policy == NearPolicy.REQUIRED and request.devices else None
        # cores kept for others' devices: never counted, or (when-full) in the end as well
        avoid = ledger.keep.locked(request.devices) if not ledger.keep.soft else None
        return _fragment_capacity(ledger, pieces, only.ids if only is not None else None,
                                  avoid.ids if avoid else None)
    free = Free(topology, ledger, request.options, steps=True)
    # free isolated CPUs are taken first (take_whole): which ones each allocation takes
    # decides what is left, so the closed form waits until the steps have used them up
    if not pieces and request.options.exclusive != Exclusive.NUMA and not ledger.free_isolated:
        count = _rest(free, request)
        if count is not None:
            return count
    if not topology.cells.nested:  # Free.take would have to look at cells it did not touch
        return _replay(topology, ledger, request)
    return _count(free, request)


def _count(free: Free, request: Request) -> int:
    """Allocations of ``request`` one after another on ``free``, as allocate would place them;
    the rest as a closed form once it is one."""
    n, pieces = request.whole, int(request.fraction * free.g)
    total = len(free.free) + len(free.free_isolated)
    for count in range(total + 1):  # every step takes at least one free CPU
        phase = _phase(free)
        try:
            whole, fragment, fresh = choose.take(free, n, pieces)
        except InsufficientCPUs:
            return count
        free.take(whole, fragment, fresh, pieces)
        if _phase(free) != phase:
            rest = _rest(free, request)
            if rest is not None:
                return count + 1 + rest
    raise AssertionError("capacity: more allocations than free CPUs")


def _phase(free: Free) -> tuple[bool, bool, bool]:
    return free.numa_failed, free.budget() > 0, bool(free.free_isolated)


def _rest(free: Free, request: Request) -> int | None:
    """What is left as a closed form, if it is one (whole CPUs only; with option near, only
    for near-policy required: the same units among the CPUs next to the devices)."""
    opts = request.options
    if request.fraction or (opts.exclusive == Exclusive.NUMA and not free.numa_failed):
        return None
    if free.near is not None and not free.near_required:
        return None  # preferred: next to the devices first, then elsewhere
    if free.mine or (free.soft and free.locked):
        return None  # kept cores: their own first, or others' when nothing else fits
    avoid = Exclusive.PCPU if opts.exclusive == Exclusive.NUMA else opts.exclusive
    only = free.near
    view, _ = free.view(avoid if only is None else avoid + NEAR)
    cands = {x: [c for cell in cells for c in view[cell]]
             for x, cells in free.cells.in_node.items()}
    shared = len(free.free if only is None else free.free & only) - len(
        free.locked & free.free if only is None else free.locked & free.free & only)
    isolated = len(free.free_isolated if only is None else free.free_isolated & only) - len(
        free.locked & free.free_isolated if only is None
        else free.locked & free.free_isolated & only)
    return _unit_capacity(free.topology, free.ledger, request, avoid, cands, shared, isolated,
                          free.budget())


def _replay(topology: Topology, ledger: Ledger, request: Request) -> int:
    """capacity by allocating again and again (where a core lies in two NUMA nodes, a choice
    changes cells Free.take does not look at again)."""
    ledger = Ledger(ledger.online, ledger.reserved, ledger.isolated, ledger.granularity,
                    ledger.min_shared_cpus, MappingProxyType(dict(ledger.bound)))
    count = 0
    while True:
        try:
            whole, fragment = bound_cpus(topology, ledger, request, CPUSet(), None)
        except InsufficientCPUs:
            return count
        # not a valid allocation name, so it never replaces one
        ledger = ledger.with_allocation(Allocation(f"#{count}", request, whole, fragment))
        count += 1
