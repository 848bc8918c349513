"""Whether an allocation is aligned, and why not: what a fleet tool asks before trusting it with
a latency-sensitive job (issue 28). Pure.

Aligned means: bound, holding CPUs, every one of them a whole core (no fragment CPU shared with
others, no half of a core), all in one L3 group and one NUMA node, and its memory restricted
(``memory-nodes``) to that node's own memory; with option near, its CPUs next to its devices.
An unbound allocation is never aligned: it runs on the shared pool.
"""

from __future__ import annotations

from cpuservice.model import near
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import Allocation
from cpuservice.model.topology import Topology


def misalignment(topology: Topology, allocation: Allocation) -> list[str]:
    """What keeps ``allocation`` from being aligned, one phrase each (empty: aligned)."""
    if not allocation.bound:
        return ["unbound (runs on the shared pool)"]
    held = allocation.held
    if not held:
        return ["holds no CPU (degraded onto the shared pool)"]
    why = []
    if allocation.fragment is not None:
        why.append(f"shares fragment CPU {allocation.fragment.cpu}")
    known = [c for c in held if c in topology.cpus]
    if topology.whole_cores(held) != held:
        why.append("holds part of a core")
    nodes = {topology.node_of(c) for c in known}
    if len({topology.l3_of(c) for c in known}) > 1:
        why.append("spans L3 groups")
    if len(nodes) > 1:
        why.append(f"spans NUMA nodes {','.join(map(str, sorted(nodes)))}")
    remote = near.remote(topology, allocation.request.devices, held)
    if remote:
        policy = allocation.request.options.near_policy
        why.append(f"{remote} (near-policy {policy}: no room there when placed)")
    memory = near.near_memory(topology, allocation.request.devices) \
        if allocation.request.devices and not remote else None
    if not allocation.request.options.memory_nodes:
        why.append("memory not restricted to its node (no memory-nodes)")
    elif memory is not None and memory != topology.node_set(known):
        why.append(f"memory on its devices' nodes {memory}, CPUs on {CPUSet(nodes)}")
    elif len(nodes) == 1 and topology.node_set(known).ids != nodes:
        why.append(f"its node {nodes.pop()} has no memory of its own")
    return why
