"""Small helpers for the placement tests."""

from __future__ import annotations

from typing import Any

from cpuservice import placement
from cpuservice.cpuset import CPUSet
from cpuservice.pools import Allocation, Ledger, check_index, check_invariants
from cpuservice.request import Request
from cpuservice.topology import Topology


def ledger_for(topology: Topology, **kw: Any) -> Ledger:
    return Ledger(topology.online, isolated=topology.isolated & topology.online, **kw)


def bind(cpus: str, **options: Any) -> Request:
    opts = {k.replace("_", "-"): v for k, v in options.items()}
    return Request.parse(cpus, {"bind": True, **opts})


def alloc(
    topology: Topology, ledger: Ledger, name: str, request: Request
) -> tuple[Ledger, Allocation]:
    new, a = placement.allocate(topology, ledger, name, request)
    check_invariants(new)
    check_index(new)
    return new, a


def nodes_of(topology: Topology, cpus: CPUSet) -> set[int]:
    return {topology.cpus[c].node for c in cpus}
