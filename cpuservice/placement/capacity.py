"""How many more allocations of one shape fit now (Capacity): closed forms where every allocation
takes interchangeable units, else the simulation. Pure."""


from __future__ import annotations

from types import MappingProxyType

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    InsufficientCPUs,
)
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import (
    Exclusive,
    Request,
)
from cpuservice.model.topology import Topology
from cpuservice.placement.closed import _fragment_capacity, _unit_capacity
from cpuservice.placement.simulation import _Simulation
from cpuservice.placement.whole import _check_policy, bound_cpus, candidates, check_amount

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
      CPUs each allocation takes decides what the next one can take, so _Simulation makes the
      same choices in turn on a model of the free CPUs kept per (NUMA node, L3 group) cell.
      That is one step per allocation, but there are at most free CPUs / X of them (X >= 1),
      and a step only looks at the cell it lands in (and the counts per node), not at the
      machine and the ledger as allocate does; after exclusive=numa's first phase, or once the
      isolated CPUs or the budget are used up, the rest is a closed form again. On 1,024 CPUs
      with a thousand allocations the slowest shapes take a few tens of milliseconds
      (bench/placement.py: capacity_worst_us). Topologies with a core split over two NUMA
      nodes (never seen on hardware) fall back to placing with bound_cpus, one allocation at a
      time.
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
        return _fragment_capacity(ledger, pieces)
    # free isolated CPUs are taken first (take_whole): which ones each allocation takes
    # decides what is left, so the closed form waits until _Simulation has used them up
    if not pieces and request.options.exclusive != Exclusive.NUMA and not ledger.free_isolated:
        opts = request.options
        cands = candidates(topology, ledger, opts, opts.exclusive)
        node_of = topology.levels[1]
        by_node: dict[int, list[int]] = {}
        for c in cands:
            by_node.setdefault(node_of[c], []).append(c)
        count = _unit_capacity(
            topology, ledger, request, opts.exclusive, by_node,
            len(ledger.shared - ledger.reserved), len(ledger.free_isolated), ledger.shared_budget,
        )
        if count is not None:
            return count
    simulation = _Simulation(topology, ledger, request)
    if not simulation.nested:
        return _replay(topology, ledger, request)
    return simulation.run()


def _replay(topology: Topology, ledger: Ledger, request: Request) -> int:
    """capacity by allocating again and again (for topologies _Simulation does not model)."""
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
