"""The machine as a Kubernetes NodeResourceTopology (group topology.node.k8s.io, v1alpha2): the
shape topology-aware schedulers read (scheduler-plugins' NodeResourceTopologyMatch, OpenShift's
NUMA-aware scheduler, KAI). Pure: built from the topology and the ledger; the daemon, the CLI and
the planner print what export() returns. The JSON schema of the object is
docs/nrt/noderesourcetopology-v1alpha2.schema.json.

What is published (consumers read only zones of type Node, named node-<N>, and per resource only
``available``):

- a zone ``node-N`` (type Node) per NUMA node, with costs to every node zone (the kernel's node
  distances; 10/20 where unread) and resources ``cpu`` (capacity: its online CPUs; allocatable:
  less the reserved ones; available: the whole CPUs bound allocations could still take there,
  with its part of what the shared pool may still give: _budget_shares), ``memory`` (MemTotal
  of its meminfo, when read: cpuservice hands out no memory, so all three are that) and
  ``cpuservice.io/fragment-pieces`` (capacity and allocatable: the pieces of its fragment CPUs;
  available: those still free); attributes name its CPU sets (cpus, shared, reserved,
  isolated, exclusive, fragment) and memory nodes, its node as ``resource.kubernetes.io/numaNode``
  (the name DRA drivers such as dra-driver-cpu give a device's NUMA node), and where the
  service knows devices there (the ones option near can name): ``cpuservice.io/devices``
  (``NAME=PCI-ADDRESS``, comma-separated), their PCIe root complexes as
  ``resource.kubernetes.io/pcieRoot`` (``pci0000:3a``, comma-separated: DRA's list of strings
  as one NRT string) and the cores kept next to them (``cpuservice.io/kept-cpus``, config
  keep_near); devices without a NUMA node are listed at the top level instead;
- a zone per L3 group (type L3Cache, ``parent`` its node; a group split by NUMA nodes, as with
  sub-NUMA clustering, is one zone per node: ``l3-K-node-N``) with its ``cpu`` (its available
  CPUs: its part of its node's, so that the L3 zones of a node add up to it) and its CPUs;
- top-level attributes: the policy a request gets unless it asks otherwise (the configured
  ``numa-alignment`` default as ``topologyManagerPolicy``; scope ``container``: each allocation
  is aligned on its own), ``topologyManagerMaxNUMANodes``, whether that default aligns CPUs and
  memory together, the state's generation, the granularity and counts of the allocations.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from cpuservice.model.alignment import misalignment
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.near import Device
from cpuservice.model.pools import Ledger
from cpuservice.model.request import NumaAlignment, Options, parse_options
from cpuservice.model.topology import Topology

API_VERSION = "topology.node.k8s.io/v1alpha2"
KIND = "NodeResourceTopology"
PREFIX = "cpuservice.io/"
K8S = "resource.kubernetes.io/"  # the standard attributes' prefix (DRA's numaNode, pcieRoot)
NODE_ZONE = "Node"
L3_ZONE = "L3Cache"
SCOPE = "container"
_K = TypeVar("_K")
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


def _cpu(ledger: Ledger, cpus: CPUSet, share: int) -> dict[str, str]:
    """``cpu`` of a zone: the whole CPUs bindable there are its free isolated ones plus
    ``share`` of its shared, unreserved ones (its part of the shared pool's budget)."""
    free = len(ledger.free_isolated & cpus) + share
    return _resource("cpu", len(cpus), len(cpus - ledger.reserved), free)


def _bindable_shared(ledger: Ledger, cpus: CPUSet) -> int:
    return len((ledger.shared - ledger.reserved) & cpus)


def _budget_shares(budget: int, counts: dict[_K, int]) -> dict[_K, int]:
    """Split ``budget`` (how many CPUs may still leave the shared pool) among zones holding
    ``counts`` shared, unreserved CPUs each.

    Consumers of NRT treat zones as additive: a scheduler that places a pod on one zone takes
    it off that zone's ``available`` and still believes the others. So the zones may not each
    claim the whole budget (on 16 shared CPUs and min_shared_cpus 1, two nodes of 8 would
    promise 16 CPUs where 15 can be bound). The rule: the zones get min(budget, their total)
    in proportion to their counts, rounded down, and the CPUs left by rounding go one each to
    the largest remainders (ties: the first zone). So the shares add up to exactly what can
    be bound together (with the free isolated CPUs, what ``capacity`` counts for single bound
    CPUs), and no share exceeds its zone's count or the budget: each zone's ``available`` is
    bindable alone, and all of them at once."""
    total = sum(counts.values())
    spend = min(budget, total)
    if not spend:
        return dict.fromkeys(counts, 0)
    shares = {k: spend * n // total for k, n in counts.items()}
    left = spend - sum(shares.values())
    by_remainder = sorted(counts, key=lambda k: -(spend * counts[k] % total))  # stable
    for k in by_remainder[:left]:
        shares[k] += 1
    return shares


def _node_ids(topology: Topology) -> list[int]:
    """Every NUMA node: of a CPU (even offline), or with memory and no CPU."""
    return sorted({info.node for info in topology.cpus.values()}
                  | topology.memory_only_nodes.ids)


def _node_cpus(topology: Topology, nodes: list[int]) -> dict[int, CPUSet]:
    """The online CPUs of each node."""
    by_node: dict[int, set[int]] = {n: set() for n in nodes}
    for c in topology.online:
        by_node[topology.node_of(c)].add(c)
    return {n: CPUSet(cpus) for n, cpus in by_node.items()}


def _device_attrs(node: int, devices: Iterable[Device], roots: Mapping[str, str],
                  ledger: Ledger) -> list[tuple[str, object]]:
    """A Node zone's device attributes (none where no device is known there)."""
    here = [d for d in devices if d.node == node]
    out: list[tuple[str, object]] = []
    if here:
        out.append((f"{PREFIX}devices", ",".join(f"{d.name}={d.address}" for d in here)))
        found = sorted({roots[d.address] for d in here if roots.get(d.address)})
        if found:
            out.append((f"{K8S}pcieRoot", ",".join(found)))
    kept = ledger.keep.at(node)
    if kept is not None:
        out.append((f"{PREFIX}kept-cpus", kept.cpus.format()))
    return out


def _node_zone(topology: Topology, ledger: Ledger, node: int, nodes: list[int], cpus: CPUSet,
               share: int, devices: tuple[Device, ...] = (),
               roots: Mapping[str, str] = MappingProxyType({})) -> dict[str, Any]:
    g = ledger.granularity
    fragment = ledger.fragment & cpus
    resources = [_cpu(ledger, cpus, share)]
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
            (f"{K8S}numaNode", node),
            *_device_attrs(node, devices, roots, ledger),
        ]),
        "resources": resources,
    }


def _l3_zones(topology: Topology, ledger: Ledger, node_shares: dict[int, int]
              ) -> list[dict[str, Any]]:
    """The L3 zones; each node's share of the budget is split among its L3 zones as the budget
    is among the nodes (_budget_shares), so they add up to their node's ``available``."""
    parts: list[tuple[str, int, CPUSet]] = []
    for group, cpus in topology.l3_groups.items():
        by_node: dict[int, set[int]] = {}
        for c in cpus:
            by_node.setdefault(topology.node_of(c), set()).add(c)
        for node, part in sorted(by_node.items()):
            name = f"l3-{group}" if len(by_node) == 1 else f"l3-{group}-node-{node}"
            parts.append((name, node, CPUSet(part)))
    shares: dict[int, int] = {}
    for node, node_share in node_shares.items():
        mine = {i: _bindable_shared(ledger, cpus)
                for i, (_, n, cpus) in enumerate(parts) if n == node}
        shares.update(_budget_shares(node_share, mine))
    return [{"name": name, "type": L3_ZONE, "parent": f"node-{node}",
             "attributes": _attrs([(f"{PREFIX}cpus", cpus.format())]),
             "resources": [_cpu(ledger, cpus, shares.get(i, 0))]}
            for i, (name, node, cpus) in enumerate(parts)]


def export(topology: Topology, ledger: Ledger, name: str, generation: int,
           defaults: Options | None = None, devices: tuple[Device, ...] = (),
           roots: Mapping[str, str] = MappingProxyType({})) -> dict[str, Any]:
    """The NodeResourceTopology object of this machine now (see the module docstring);
    ``defaults``: the options a request gets unless it names others (the configuration's);
    ``devices``: the devices option near can name here, ``roots``: PCI address -> the PCIe
    root complex of each (as the daemon found them at startup)."""
    node_name(name)
    defaults = defaults or parse_options({})
    policy = defaults.numa_alignment
    nodes = _node_ids(topology)
    node_cpus = _node_cpus(topology, nodes)
    shares = _budget_shares(ledger.shared_budget,
                            {n: _bindable_shared(ledger, cpus) for n, cpus in node_cpus.items()})
    bound = [a for a in ledger.bound.values()]
    aligned = sum(1 for a in bound if not misalignment(topology, a))
    together = policy == NumaAlignment.SINGLE_NUMA_NODE and defaults.memory_nodes
    nowhere = [d for d in devices if d.node not in nodes]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "topologyPolicies": [_LEGACY[policy]],
        "zones": [*(_node_zone(topology, ledger, n, nodes, node_cpus[n], shares[n], devices,
                               roots) for n in nodes),
                  *_l3_zones(topology, ledger, shares)],
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
            *([(f"{PREFIX}devices-without-numa-node", ",".join(
                f"{d.name}={d.address}" for d in nowhere))] if nowhere else []),
        ]),
    }
