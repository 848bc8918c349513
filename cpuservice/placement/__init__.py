"""Placement: which CPUs a request gets, and what systemd is told. Pure; no I/O.

Bound whole CPUs are chosen in two steps. First the NUMA nodes (alignment and strategy), then,
inside them, the CPUs the policy takes (_pick):

- packed and full-pcpus (pack): whole cores for every part of the request that fills one, chosen
  by a walk down socket -> node -> L3 group -> core that at every level takes the best-fitting
  group that holds the rest of the request (closest to the CPUs the allocation already has, then
  fewest free: packing), or, when none does, whole free groups first and the remainder in the
  best-fitting group (_take, run on one thread per wholly free core), then cores whose other
  threads are offline (or hybrid single-thread cores) while the even part is not covered. A
  lone thread only for what is left (an odd remainder on SMT-2), and then the free sibling of a
  half-used core first, the allocation's own or an L3 neighbour's, before a single-thread core,
  before splitting a wholly free core; best fit between groups never overrides this.
  full-pcpus never splits a core: it takes whole cores of any size (on hybrid machines
  single-thread cores too) or fails.
- spread-pcpus: one thread per core, first on cores another spread-pcpus allocation half uses
  (packed leaves those threads to it), then on wholly free cores, then on other partly free
  cores; then further threads.

So a socket-sized request takes a socket, 2 CPUs on SMT-2 take one core, 3 take a core and the
free sibling of a half-used core next to it, and fragments go to loose threads first as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from cpuservice.model import near
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    AllocationExists,
    InvalidArgument,
    NoSuchAllocation,
)
from cpuservice.model.pools import Allocation, Fragment, Ledger
from cpuservice.model.request import (
    Request,
    validate_name,
)
from cpuservice.model.topology import Topology

# the package's face: what the rest of cpuservice calls (repair and the tests use these too)
from cpuservice.placement.capacity import UNLIMITED as UNLIMITED
from cpuservice.placement.capacity import capacity as capacity
from cpuservice.placement.pack import pack as pack
from cpuservice.placement.pack import whole_core_step as whole_core_step
from cpuservice.placement.whole import _new_allocation
from cpuservice.placement.whole import bound_cpus as bound_cpus
from cpuservice.placement.whole import check_amount as check_amount
from cpuservice.placement.whole import take_fragment as take_fragment
from cpuservice.placement.whole import take_whole as take_whole

WEIGHT_MAX = 10_000


WEIGHT_DEFAULT = 100


USEC_PER_SEC = 1_000_000


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
    # option near: memory next to the devices (near.near_memory), wherever the CPUs are
    devices = allocation.request.devices
    memory = near.near_memory(topology, devices) if devices else None
    return Placement(
        cpus=cpus,
        whole=allocation.whole,
        fragment=allocation.fragment,
        shares=shares,
        memory_nodes=memory if memory is not None else topology.node_set(cpus),
        cpu_quota_usec=cpu_quota_usec(allocation.request),
        cpu_weight=cpu_weight(allocation.request, allocation.fragment, g),
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
    request = Request.build(cpus, old.request.options)  # near: the nodes resolved then
    base = ledger.without(name)
    check_amount(base, request)
    if old.bound:
        whole, fragment = bound_cpus(topology, base, request, old.whole, old.fragment)
        new = Allocation(name, request, whole, fragment)
    else:
        new = Allocation(name, request)
    return base.with_allocation(new), new
