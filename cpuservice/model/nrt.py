"""The machine as a Kubernetes NodeResourceTopology (group topology.node.k8s.io, v1alpha2): the
shape topology-aware schedulers read (scheduler-plugins' NodeResourceTopologyMatch, OpenShift's
NUMA-aware scheduler, KAI). Pure: built from the topology and the ledger; the daemon, the CLI and
the planner print what export() returns. The JSON schema of the object is
docs/nrt/noderesourcetopology-v1alpha2.schema.json.

What is published (consumers read only zones of type Node, named node-<N>, and per resource only
``available``):

- a zone ``node-N`` (type Node) per NUMA node, with costs to every node zone (the kernel's node
  distances; 10/20 where unread) and resources ``cpu`` (capacity: its online CPUs; allocatable:
  less the reserved ones; available: the whole CPUs a bound allocation could still take there,
  within what the shared pool may still give), ``memory`` (MemTotal of its meminfo, when read:
  cpuservice hands out no memory, so all three are that) and ``cpuservice.io/fragment-pieces``
  (capacity and allocatable: the pieces of its fragment CPUs; available: those still free);
  attributes name its CPU sets (cpus, shared, reserved, isolated, exclusive, fragment) and
  memory nodes;
- a zone per L3 group (type L3Cache, ``parent`` its node; a group split by NUMA nodes, as with
  sub-NUMA clustering, is one zone per node: ``l3-K-node-N``) with its ``cpu`` and its CPUs;
- top-level attributes: the policy a request gets unless it asks otherwise (the configured
  ``numa-alignment`` default as ``topologyManagerPolicy``; scope ``container``: each allocation
  is aligned on its own), ``topologyManagerMaxNUMANodes``, whether that default aligns CPUs and
  memory together, the state's generation, the granularity and counts of the allocations.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from cpuservice.model.alignment import misalignment
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.pools import Ledger
from cpuservice.model.request import NumaAlignment, Options, parse_options
from cpuservice.model.topology import Topology

API_VERSION = "topology.node.k8s.io/v1alpha2"
KIND = "NodeResourceTopology"
PREFIX = "cpuservice.io/"
NODE_ZONE = "Node"
L3_ZONE = "L3Cache"
SCOPE = "container"
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# the deprecated topologyPolicies list (still read as a fallback), for scope container
_LEGACY = {NumaAlignment.NONE: "None", NumaAlignment.BEST_EFFORT: "BestEffortContainerLevel",
           NumaAlignment.RESTRICTED: "RestrictedContainerLevel",
           NumaAlignment.SINGLE_NUMA_NODE: "SingleNUMANodeContainerLevel"}


def node_name(text: str) -> str:
    """A Kubernetes node name (a DNS subdomain: lower-case letters, digits, '-' and '.', at most
    253 characters); InvalidArgument naming the fix otherwise."""
    if not isinstance(text, str) or len(text) > 253 or not _NODE_NAME.fullmatch(text):
        raise InvalidArgument(
            f"node name {text!r} is not a Kubernetes node name (1-253 characters of lower-case "
            "letters, digits, '-' and '.', starting and ending with a letter or digit); give "
            "the node's name as kubectl get nodes shows it")
    return text


def default_node_name(hostname: str) -> str:
    """The node name kubelet gives a host by default: its hostname, lower-cased."""
    return hostname.strip().lower()


def _attrs(pairs: Iterable[tuple[str, object]]) -> list[dict[str, str]]:
    return [{"name": name, "value": str(value)} for name, value in pairs]


def _resource(name: str, capacity: object, allocatable: object, available: object
              ) -> dict[str, str]:
    return {"name": name, "capacity": str(capacity), "allocatable": str(allocatable),
            "available": str(available)}


def _cpu(ledger: Ledger, cpus: CPUSet) -> dict[str, str]:
    """``cpu`` of a zone: whole CPUs bindable there are its free isolated ones plus its shared,
    unreserved ones as far as the shared pool may still shrink (as capacity() counts them)."""
    free = len(ledger.free_isolated & cpus) + min(len((ledger.shared - ledger.reserved) & cpus),
                                                 ledger.shared_budget)
    return _resource("cpu", len(cpus), len(cpus - ledger.reserved), free)


def _node_ids(topology: Topology) -> list[int]:
    """Every NUMA node: of a CPU (even offline), or with memory and no CPU."""
    return sorted({info.node for info in topology.cpus.values()}
                  | topology.memory_only_nodes.ids)


def _node_zone(topology: Topology, ledger: Ledger, node: int, nodes: list[int]
               ) -> dict[str, Any]:
    cpus = CPUSet(c for c in topology.online if topology.node_of(c) == node)
    g = ledger.granularity
    fragment = ledger.fragment & cpus
    resources = [_cpu(ledger, cpus)]
    kb = topology.node_memory_kb.get(node)
    if kb is not None:
        memory = f"{kb}Ki" if kb else "0"
        resources.append(_resource("memory", memory, memory, memory))
    resources.append(_resource(f"{PREFIX}fragment-pieces", len(fragment) * g, len(fragment) * g,
                               sum(ledger.free_pieces(c) for c in fragment)))
    return {
        "name": f"node-{node}",
        "type": NODE_ZONE,
        "costs": [{"name": f"node-{m}", "value": topology.distance(node, m)} for m in nodes],
        "attributes": _attrs([
            (f"{PREFIX}cpus", cpus.format()),
            (f"{PREFIX}shared-cpus", (ledger.shared & cpus).format()),
            (f"{PREFIX}reserved-cpus", (ledger.reserved & cpus).format()),
            (f"{PREFIX}isolated-cpus", (ledger.isolated & cpus).format()),
            (f"{PREFIX}exclusive-cpus", (ledger.exclusive & cpus).format()),
            (f"{PREFIX}fragment-cpus", fragment.format()),
            (f"{PREFIX}memory-nodes", topology.node_set(cpus).format() if cpus
             else (CPUSet([node]) if node in topology.memory_only_nodes else CPUSet()).format()),
        ]),
        "resources": resources,
    }


def _l3_zones(topology: Topology, ledger: Ledger) -> list[dict[str, Any]]:
    zones = []
    for group, cpus in topology.l3_groups.items():
        by_node: dict[int, set[int]] = {}
        for c in cpus:
            by_node.setdefault(topology.node_of(c), set()).add(c)
        for node, part in sorted(by_node.items()):
            name = f"l3-{group}" if len(by_node) == 1 else f"l3-{group}-node-{node}"
            mine = CPUSet(part)
            zones.append({"name": name, "type": L3_ZONE, "parent": f"node-{node}",
                          "attributes": _attrs([(f"{PREFIX}cpus", mine.format())]),
                          "resources": [_cpu(ledger, mine)]})
    return zones


def export(topology: Topology, ledger: Ledger, name: str, generation: int,
           defaults: Options | None = None) -> dict[str, Any]:
    """The NodeResourceTopology object of this machine now (see the module docstring);
    ``defaults``: the options a request gets unless it names others (the configuration's)."""
    node_name(name)
    defaults = defaults or parse_options({})
    policy = defaults.numa_alignment
    nodes = _node_ids(topology)
    bound = [a for a in ledger.bound.values()]
    aligned = sum(1 for a in bound if not misalignment(topology, a))
    together = policy == NumaAlignment.SINGLE_NUMA_NODE and defaults.memory_nodes
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "topologyPolicies": [_LEGACY[policy]],
        "zones": [*(_node_zone(topology, ledger, n, nodes) for n in nodes),
                  *_l3_zones(topology, ledger)],
        "attributes": _attrs([
            ("topologyManagerPolicy", policy.value),
            ("topologyManagerScope", SCOPE),
            ("topologyManagerMaxNUMANodes", len(nodes)),
            (f"{PREFIX}cpu-memory-aligned", "true" if together else "false"),
            (f"{PREFIX}generation", generation),
            (f"{PREFIX}granularity", ledger.granularity),
            (f"{PREFIX}min-shared-cpus", ledger.min_shared_cpus),
            (f"{PREFIX}allocations", len(ledger.allocations)),
            (f"{PREFIX}bound-allocations", len(bound)),
            (f"{PREFIX}aligned-allocations", aligned),
        ]),
    }
