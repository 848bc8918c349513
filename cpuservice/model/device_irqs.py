"""Where the interrupts of the devices an allocation feeds go (option ``near-irqs``): on the
shared pool's CPUs of each device's own NUMA node, never on an allocation's CPUs, and on a
remote node only while the device's node has no shared CPU left (then the whole shared pool,
and the plan says why). Pure; the kernel's side (writing ``/proc/irq``, reading the PCI
function's ``msi_irqs`` and ``irq``) is cpuservice.host.irqs.

Each PCI function some allocation with ``near-irqs`` names (by its recorded address:
cpuservice.model.near) is one more holder of the shared pool in the reconcile transaction, the
pseudo-unit ``kernel:irqs:<address>`` (holder()), beside ``kernel:irqs``: its CPUs shrink before
an allocation gets CPUs and grow after one is released, on every path, as the pool's do. A
device's holder exists while an allocation names it; when the last one is released, the
device's interrupts follow the pool again (``kernel:irqs``'s CPUs, or every online CPU when
``isolate_irqs`` is off).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cpuservice.model import near
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import Allocation
from cpuservice.model.topology import Topology

PREFIX = "kernel:irqs:"  # + a PCI address: the pseudo-unit of that function's interrupts
# the pseudo-property a device holder is "restored" with when no allocation keeps it any more
# (its interrupts follow the pool again)
RELEASE = "ReleaseIRQs"


def holder(address: str) -> str:
    return PREFIX + address


def address_of(unit: str) -> str | None:
    """The PCI address of a device holder's name (None: the unit is none)."""
    if not unit.startswith(PREFIX):
        return None
    return near.pci_address(unit[len(PREFIX):])


@dataclass(frozen=True)
class Placement:
    """Where one device's interrupts go: ``cpus`` (empty: nowhere they may, the shared pool is
    empty), ``local`` whether those are next to the device, ``why`` what a person reads when they
    are not, ``names`` the allocations (and their names for it) that keep it."""

    address: str
    node: int
    cpus: CPUSet
    local: bool
    why: str
    names: tuple[str, ...]

    @property
    def unit(self) -> str:
        return holder(self.address)


def devices(allocations: Iterable[Allocation]) -> dict[str, tuple[int, tuple[str, ...]]]:
    """The PCI functions whose interrupts are kept (address -> the node recorded for it, the
    allocations naming it). Devices without a PCI address (virtual ones) have no interrupts of
    their own to keep."""
    out: dict[str, tuple[int, tuple[str, ...]]] = {}
    for a in allocations:
        if not (a.bound and a.request.options.near_irqs):
            continue
        for d in a.request.devices:
            if not d.address:
                continue
            node = near.NO_NODE if d.node is None else d.node
            had = out.get(d.address)
            out[d.address] = (had[0] if had else node, (*(had[1] if had else ()), a.name))
    return out


def place(topology: Topology, shared: CPUSet, node: int) -> tuple[CPUSet, bool, str]:
    """Where the interrupts of a device on kernel node ``node`` go when the shared pool is
    ``shared``: its shared CPUs next to the device; else the whole pool, with why."""
    nodes = near.cpu_nodes(topology, node)
    if not nodes:
        why = ("no NUMA locality (the kernel gives it none)" if node == near.NO_NODE else
               f"NUMA node {node}, which this machine does not have")
        return shared, False, f"{why}: on the whole shared pool"
    local = shared & CPUSet.union_all(topology.nodes[x] for x in nodes)
    if local:
        return local, True, ""
    where = ",".join(map(str, nodes))
    return shared, False, (f"no shared CPU left on node {where} (allocations hold them all): "
                           "on the whole shared pool")


def plan(topology: Topology, allocations: Mapping[str, Allocation], shared: CPUSet
         ) -> dict[str, Placement]:
    """Every kept device's placement, by its holder's name (cpuservice.apply.targets makes them
    units of the reconcile transaction)."""
    out = {}
    for address, (node, names) in sorted(devices(allocations.values()).items()):
        cpus, local, why = place(topology, shared, node)
        out[holder(address)] = Placement(address, node, cpus, local, why, names)
    return out
