"""Devices an allocation is placed next to (option ``near``): the names a caller gives, what they
resolved to, and which CPUs and memory nodes are next to them. Pure; the host's side (reading
sysfs) is cpuservice.host.devices.

A caller names each device as a PCI address (``0000:3b:00.0``), a ``/dev`` path (char or block,
NVIDIA's ``/dev/nvidiaN`` too) or a name of a network interface, InfiniBand device, DRM card or
render node, NVMe controller or block device. The service resolves each name once, at Allocate
(Plan, Capacity), to the device's NUMA node as the kernel reports it (``numa_node``; -1: the
firmware says nothing, as in most VMs), and the option's value then records what was found,
one ``NAME@NODE@KIND@ADDRESS`` item per device, comma-separated. So the checkpoint and the
slice's Description keep the resolved node: a restart, a resize, a repair or a move never needs
the device again. A device without locality (-1, a virtual device, a node this machine does not
have) constrains nothing, and says so.

Names are bounded (MAX_DEVICES of at most MAX_NAME characters) and refused when they could
lead a lookup elsewhere: ``..``, a path outside ``/dev``, separators of the recorded form.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.topology import Topology

MAX_DEVICES = 16
MAX_NAME = 128
MAX_NODE = 1023  # the kernel's node ids stay below MAX_NUMNODES (1024)
NO_NODE = -1
# how a device was found (what Capabilities lists as resolvable)
KINDS = ("pci", "char", "block", "nvidia", "net", "infiniband", "drm", "nvme")
CLASSES = ("net", "infiniband", "drm", "nvme", "block")  # looked up by name, in this order

PCI = re.compile(r"(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
_CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_DEV_PART = re.compile(r"[A-Za-z0-9_.:+-]{1,64}")
_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


@dataclass(frozen=True)
class Device:
    """One device of option ``near``: ``name`` as the caller gave it; once resolved, ``node``
    (the kernel's ``numa_node``, NO_NODE when it has none), ``kind`` (KINDS: how it was found)
    and ``address`` (its PCI address, "" when it is no PCI device). ``node`` None: not resolved
    yet."""

    name: str
    node: int | None = None
    kind: str = ""
    address: str = ""

    @property
    def resolved(self) -> bool:
        return self.node is not None

    def encode(self) -> str:
        if self.node is None:
            return self.name
        return f"{self.name}@{self.node}@{self.kind}@{self.address}"


def pci_address(text: str) -> str | None:
    """The canonical form (``0000:3b:00.0``, lower case) of a PCI address, None when ``text``
    is none."""
    m = PCI.fullmatch(text)
    if not m:
        return None
    domain, bus, slot, function = m.groups()
    return f"{(domain or '0000').lower():0>4}:{bus.lower()}:{slot.lower()}.{function}"


def form(name: str) -> str:
    """What kind of name a caller gave: "pci", "dev" (a /dev path) or "class" (an interface,
    InfiniBand, DRM, NVMe or block device name); InvalidArgument when it is none of them."""
    shown = repr(name) if len(name) <= 40 else repr(name[:40]) + "..."
    if not name or len(name) > MAX_NAME:
        raise InvalidArgument(f"option 'near': device name {shown} must be 1-{MAX_NAME} "
                              "characters")
    if pci_address(name):
        return "pci"
    if name.startswith("/"):
        parts = name.split("/")[1:]
        if parts[0] != "dev" or len(parts) < 2:
            raise InvalidArgument(f"option 'near': {shown} is not under /dev (a device path is "
                                  "/dev/...)")
        if any(p in (".", "..") or not _DEV_PART.fullmatch(p) for p in parts[1:]):
            raise InvalidArgument(f"option 'near': {shown}: each part of a /dev path is 1-64 of "
                                  "A-Z a-z 0-9 _ . : + - (and not . or ..)")
        return "dev"
    if _CLASS_NAME.fullmatch(name):
        return "class"
    raise InvalidArgument(
        f"option 'near': {shown} is no PCI address (0000:3b:00.0), /dev path or device name "
        "(1-64 of A-Z a-z 0-9 _ . : -, starting with a letter or digit)")


@lru_cache(maxsize=1024)
def parse(text: str) -> tuple[Device, ...]:
    """The devices of an option ``near`` value: names a caller gave, or items the service
    recorded (NAME@NODE@KIND@ADDRESS); InvalidArgument for anything else."""
    if len(text) > MAX_DEVICES * (MAX_NAME + 32):
        raise InvalidArgument(f"option 'near': {len(text)} characters is too long (at most "
                              f"{MAX_DEVICES} devices)")
    items = text.split(",")
    if len(items) > MAX_DEVICES:
        raise InvalidArgument(f"option 'near': {len(items)} devices, at most {MAX_DEVICES}")
    out: list[Device] = []
    for item in items:
        name, at, rest = item.partition("@")
        form(name)
        device = Device(name) if not at else _recorded(item, name, rest)
        if any(d.name == device.name for d in out):
            raise InvalidArgument(f"option 'near': device {device.name!r} is named twice")
        out.append(device)
    return tuple(out)


def _recorded(item: str, name: str, rest: str) -> Device:
    node, kind, address = [*rest.split("@"), "", "", ""][:3]
    if (rest.count("@") != 2 or kind not in KINDS or not re.fullmatch(r"-1|[0-9]{1,4}", node)
            or not (address == "" or _ADDRESS.fullmatch(address))):
        raise InvalidArgument(f"option 'near': {item[:200]!r} is not a resolved device "
                              "(NAME@NODE@KIND@ADDRESS)")
    if int(node) > MAX_NODE:
        raise InvalidArgument(f"option 'near': node {node} of {name!r} is out of range")
    return Device(name, int(node), kind, address)


def encode(devices: Iterable[Device]) -> str:
    return ",".join(d.encode() for d in devices)


def known_nodes(topology: Topology) -> CPUSet:
    """Every kernel node this machine is known to have (with CPUs, memory or distances)."""
    return CPUSet(topology.nodes) | (topology.memory_nodes or EMPTY) | CPUSet(
        topology.node_distances)


def cpu_nodes(topology: Topology, node: int | None) -> tuple[int, ...]:
    """The NUMA nodes whose CPUs are next to a device on kernel node ``node``: the node itself
    when it has online CPUs; else (memory only, or its CPUs offline) the nodes with online CPUs
    nearest to it by the kernel's distances. None for a device without locality (NO_NODE, or a
    node this machine does not have)."""
    if node is None or node < 0 or node not in known_nodes(topology) or not topology.nodes:
        return ()
    if node in topology.nodes:
        return (node,)
    best = min(topology.distance(node, x) for x in topology.nodes)
    return tuple(x for x in topology.nodes if topology.distance(node, x) == best)


def unresolved(devices: Iterable[Device]) -> list[str]:
    return [d.name for d in devices if not d.resolved]


def check_resolved(devices: tuple[Device, ...]) -> None:
    """InvalidArgument when a device was never resolved: every request is resolved before it
    is validated (cpuservice.host.devices), so what places and what is recorded knows where
    each device is."""
    missing = unresolved(devices)
    if missing:
        raise InvalidArgument(f"option 'near': device {missing[0]!r} is not resolved (the "
                              "service looks devices up when it is asked)")


def located(topology: Topology, devices: tuple[Device, ...]) -> tuple[int, ...]:
    """The nodes with CPUs next to the devices (empty: none has locality)."""
    return tuple(sorted({x for d in devices for x in cpu_nodes(topology, d.node)}))


def near_cpus(topology: Topology, devices: tuple[Device, ...]) -> CPUSet | None:
    """The online CPUs next to the devices: where ``near`` places; None when no device has
    locality (then it constrains nothing)."""
    nodes = located(topology, devices)
    if not nodes:
        return None
    return CPUSet.union_all(topology.nodes[x] for x in nodes)


def near_memory(topology: Topology, devices: tuple[Device, ...]) -> CPUSet | None:
    """The memory nodes next to the devices (their own node where it has memory, else the
    memory its nearest CPUs use); None when no device has locality."""
    out = EMPTY
    for d in devices:
        if not cpu_nodes(topology, d.node):
            continue
        assert d.node is not None
        if d.node in topology.nodes:
            out |= topology.node_set(topology.nodes[d.node])
        elif topology.memory_nodes is not None and d.node in topology.memory_nodes:
            out |= CPUSet((d.node,))
        else:
            out |= topology.node_set(CPUSet.union_all(
                topology.nodes[x] for x in cpu_nodes(topology, d.node)))
    return out or None


def locality(topology: Topology, d: Device) -> str:
    """Where a device is, as a person reads it, saying when it constrains nothing."""
    if not d.resolved:
        return "not resolved"
    nodes = cpu_nodes(topology, d.node)
    if d.node == NO_NODE:
        return "no NUMA locality (the kernel gives it none): constrains nothing"
    if not nodes:
        return f"NUMA node {d.node}, which this machine does not have: constrains nothing"
    if nodes != (d.node,):
        return (f"NUMA node {d.node} (no online CPU there: next are nodes "
                f"{','.join(map(str, nodes))})")
    return f"NUMA node {d.node}"


def where(topology: Topology, d: Device) -> str:
    """One device as a person reads it: what it is and where it is."""
    what = " ".join(filter(None, (d.kind, d.address if d.address != d.name else "")))
    return f"{d.name}{f' ({what})' if what else ''}: {locality(topology, d)}"


def views(topology: Topology, devices: tuple[Device, ...]) -> list[list[str | int]]:
    """The Allocation's NearDevices property: [name, node, kind, PCI address, locality] (lists:
    dbus-fast 1.x, Debian 12's, takes no tuple for a struct)."""
    return [[d.name, NO_NODE if d.node is None else d.node, d.kind, d.address,
             locality(topology, d)] for d in devices]


def remote(topology: Topology, devices: tuple[Device, ...], held: CPUSet) -> str:
    """Why CPUs ``held`` are not next to the devices ("" when they are, or nothing is near)."""
    if not devices or any(not d.resolved for d in devices):
        return ""
    cpus = near_cpus(topology, devices)
    if cpus is None or not held or held <= cpus:
        return ""
    names = ", ".join(f"{d.name} on node {d.node}" for d in devices if cpu_nodes(topology, d.node))
    off = CPUSet(topology.node_of(c) for c in held - cpus if c in topology.cpus)
    return f"device-remote: CPUs on node(s) {off} are not next to {names}"


def away(topology: Topology, devices: tuple[Device, ...], held: CPUSet) -> int:
    """How many CPUs of ``held`` are not next to the devices (0 when nothing is near)."""
    cpus = near_cpus(topology, devices) if devices else None
    return 0 if cpus is None else len(held - cpus)
