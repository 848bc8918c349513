"""Bound CPUs for a request (allocate, resize, repair): the amount and policy checks, explicit
cpusets, and one choice of the engine (choose.py) on a fresh Free view. Pure."""


from __future__ import annotations

from decimal import Decimal

import cpuservice.placement.choose as choose
import cpuservice.placement.fragment as fragment
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import (
    InsufficientCPUs,
    InvalidArgument,
)
from cpuservice.model.pools import Allocation, Fragment, Ledger
from cpuservice.model.request import Options, Policy, Request
from cpuservice.model.topology import Topology
from cpuservice.model.vocab import FULL_PCPUS
from cpuservice.placement.free import Free
from cpuservice.placement.pack import _pick, whole_core_step


def check_amount(ledger: Ledger, request: Request) -> None:
    """The amount fits the machine and the granularity."""
    online = len(ledger.online)
    if request.cpus > online:
        raise InsufficientCPUs(f"{request.cpus} CPUs is more than this machine's {online} online")
    if not request.fraction:  # whole CPUs: whole pieces
        return
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
    whole, fragment = bound_cpus(topology, ledger, request, EMPTY, None)
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
    if opts.policy == FULL_PCPUS:
        _check_policy(topology, request)
    free = Free(topology, ledger, opts, keep)
    fraction = request.fraction
    pieces = int(fraction * ledger.granularity) if fraction else 0
    prefer = keep_fragment.cpu if keep_fragment is not None and keep_fragment.cpu in \
        ledger.online else None
    if n <= len(keep):
        whole = CPUSet(_pick(topology, keep.ids, n, frozenset(), opts.policy))
        _, cpu, _ = choose.take(free, 0, pieces, whole, prefer)
    else:
        chosen, cpu, _ = choose.take(free, n - len(keep), pieces, keep, prefer)
        whole = CPUSet._trusted(frozenset(chosen))  # CPUs of the topology: no check needed
        whole = keep | whole if keep else whole
    return whole, Fragment(cpu, pieces) if cpu is not None else None


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


def take_whole(
    topology: Topology, ledger: Ledger, opts: Options, n: int, anchor: CPUSet,
    hide: CPUSet = EMPTY,
) -> CPUSet:
    """``n`` more whole CPUs for a bound allocation that already holds ``anchor``, none of
    ``hide`` (free CPUs that must stay free, e.g. those a re-pack makes room with)."""
    if n <= 0:
        return CPUSet()
    return CPUSet(choose.take_whole(Free(topology, ledger, opts, anchor | hide), n, anchor))


def take_fragment(
    topology: Topology, ledger: Ledger, opts: Options, pieces: int, anchor: CPUSet
) -> Fragment:
    """A CPU with ``pieces`` free pieces, near ``anchor`` (the allocation's whole CPUs): see
    fragment.take_fragment."""
    cpu, _ = fragment.take_fragment(Free(topology, ledger, opts), pieces, anchor.ids)
    return Fragment(cpu, pieces)
