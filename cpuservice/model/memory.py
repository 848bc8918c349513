"""Which NUMA nodes have memory, the memory nodes nearest to each node that has none (by its
distance row) and the table of node distances: part of discovery (cpuservice.model.discovery).
Pure."""

from __future__ import annotations

from collections.abc import Mapping

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.reading import NodeFacts, Reading
from cpuservice.model.topology import CPU


def memory_nodes(reading: Reading, node_ids: CPUSet, pseudo: CPUSet, cpus: Mapping[int, CPU]
            ) -> tuple[CPUSet | None, dict[int, CPUSet], dict[int, int]]:
    """(memory nodes or None when unknown, node -> memory nodes where not itself, node -> kB)."""
    kb = {n: f.memory_kb for n, f in reading.nodes.items() if f.memory_kb is not None}
    memory: CPUSet | None
    if reading.has_memory is not None:
        memory = reading.has_memory & node_ids
    elif kb:
        memory = CPUSet(n for n, k in kb.items() if k > 0)
    else:
        memory = None
    if memory is not None and not memory:
        memory = None  # nothing says any node has memory: not believable, so not known
    everything = memory if memory is not None else node_ids or CPUSet([0])
    memory_of: dict[int, CPUSet] = {n: everything for n in pseudo}
    if memory is not None:
        for node in {info.node for info in cpus.values()} - pseudo.ids - memory.ids:
            memory_of[node] = nearest(reading.nodes.get(node), node_ids, memory)
    return memory, memory_of, kb


def nearest(facts: NodeFacts | None, node_ids: CPUSet, memory: CPUSet) -> CPUSet:
    """The memory nodes nearest to a node by its distance row (all of them when unknown)."""
    if facts is None or facts.distances is None or len(facts.distances) != len(node_ids):
        return memory
    distance = dict(zip(node_ids.sorted(), facts.distances, strict=True))
    best = min(distance[n] for n in memory)
    return CPUSet(n for n in memory if distance[n] == best)


def distances(reading: Reading, node_ids: CPUSet) -> dict[int, dict[int, int]]:
    """node -> node -> distance, from the nodes' ``distance`` rows (a row names every node in
    the order of their ids); nothing unless every row was read whole, so that a half-read
    table never mixes with the defaults (Topology.distance)."""
    order = node_ids.sorted()
    rows = {n: f.distances for n, f in reading.nodes.items()}
    if not order or any(r is None or len(r) != len(order) for r in rows.values()):
        return {}
    return {n: dict(zip(order, row, strict=True)) for n, row in sorted(rows.items())
            if row is not None}
