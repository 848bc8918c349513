"""Whole cores kept next to devices for the allocations that name them (configuration
``[[keep_near]]``, issue 38). Pure; the daemon finds the devices (cpuservice.host.devices) and
the placement engine honours what this decides (cpuservice.placement.free and choose).

Each rule matches devices of the host's inventory (network interfaces, InfiniBand devices,
DRM cards, NVMe controllers, NVIDIA GPUs: PCI functions with a NUMA node) by ``kind`` and/or a
``name`` pattern (shell-style, ``*`` ``?`` ``[...]``, matched against the device's name and its
PCI address) and keeps ``cores`` whole cores per matching device on the device's node. A device
counts once, for the first rule that matches it; what a node keeps is the sum over its
devices, at most every core of the node that holds no reserved CPU. The kept cores are the
node's highest-numbered such cores (away from CPU 0, where housekeeping usually runs), chosen
from every CPU the machine has (offline ones too), so CPU hotplug never moves them.

A bound allocation naming one of a node's matching devices (option ``near``, matched by PCI
address, whatever name the caller used) takes that node's kept cores first. Any other choice
(another allocation's Allocate, Resize, repair, re-pack, and Capacity's count) takes them
``never`` (the default) or only ``when-full``: when nothing else fits. Kept cores that nobody
binds stay in the shared pool, where unbound work runs as before.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from cpuservice.model import near
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.near import Device
from cpuservice.model.topology import Topology

NEVER, WHEN_FULL = "never", "when-full"
OTHERS = (NEVER, WHEN_FULL)
KINDS = ("net", "infiniband", "drm", "nvme", "nvidia")  # what the inventory lists
MAX_RULES = 16
MAX_CORES = 256  # per matching device
MAX_PATTERN = 128
_PATTERN = re.compile(r"[A-Za-z0-9_.:/*?\[\]!-]{1,128}")


class RuleError(ValueError):
    """A ``[[keep_near]]`` entry cannot be used; the message names the entry and the key."""


@dataclass(frozen=True)
class Rule:
    """One ``[[keep_near]]`` entry: ``kind`` ("" any), ``name`` (a pattern), ``cores``."""

    kind: str = ""
    name: str = "*"
    cores: int = 1

    def matches(self, device: Device) -> bool:
        if self.kind and device.kind != self.kind:
            return False
        return any(fnmatch.fnmatchcase(text, self.name) for text in (device.name, device.address)
                   if text)


def rules(entries: object, where: str = "keep_near") -> tuple[Rule, ...]:
    """The rules of a configuration's ``keep_near`` list (of tables); RuleError naming the entry
    and the key for anything else. Bounded: MAX_RULES entries, MAX_CORES cores each."""
    if not isinstance(entries, list):
        raise RuleError(f"{where}: a list of tables ([[keep_near]]), not {type(entries).__name__}")
    if len(entries) > MAX_RULES:
        raise RuleError(f"{where}: {len(entries)} entries, at most {MAX_RULES}")
    return tuple(_rule(entry, f"{where}[{i}]") for i, entry in enumerate(entries))


def _rule(entry: object, where: str) -> Rule:
    if not isinstance(entry, dict):
        raise RuleError(f"{where}: a table with kind, name and cores, not {entry!r:.60}")
    unknown = sorted(set(entry) - {"kind", "name", "cores"})
    if unknown:
        raise RuleError(f"{where}.{unknown[0]}: unknown key (kind, name, cores)")
    kind, name, cores = entry.get("kind", ""), entry.get("name", "*"), entry.get("cores")
    if not isinstance(kind, str) or (kind and kind not in KINDS):
        raise RuleError(f"{where}.kind: {kind!r:.60} is none of {', '.join(KINDS)}")
    if not isinstance(name, str) or not _PATTERN.fullmatch(name) or ".." in name:
        raise RuleError(f"{where}.name: {name!r:.60} is no pattern of 1-{MAX_PATTERN} of "
                        "A-Z a-z 0-9 _ . : / - and * ? [ ] ! (without ..), e.g. \"mlx5_*\", "
                        "\"/dev/nvidia*\" or \"0000:3b:*\"")
    if name.count("[") != name.count("]"):
        raise RuleError(f"{where}.name: {name!r}: a [ without its ] (or the other way round)")
    if isinstance(cores, bool) or not isinstance(cores, int) or not 1 <= cores <= MAX_CORES:
        raise RuleError(f"{where}.cores: {cores!r:.60} is not a number of whole cores per "
                        f"matching device (1-{MAX_CORES})")
    if not kind and name == "*":
        raise RuleError(f"{where}: give kind or name (a rule for every device keeps cores "
                        "next to every NIC and disk)")
    return Rule(kind, name, cores)


@dataclass(frozen=True)
class Kept:
    """What one NUMA node keeps: its kept ``cpus`` (whole cores), the matching ``devices``
    whose users may take them, and the cores the rules asked for (``wanted``; more than it
    keeps when the node has fewer)."""

    node: int
    cpus: CPUSet
    devices: tuple[Device, ...]
    wanted: int
    cores: int

    @property
    def note(self) -> str:
        """What a person is told: what is kept there, for whom, and what could not be."""
        names = ", ".join(d.name for d in self.devices)
        short = f", of {self.wanted} asked for: the node has no more" \
            if self.cores < self.wanted else ""
        return (f"node {self.node}: {self.cores} core(s), CPUs {self.cpus or 'none'}, kept for "
                f"{names}{short}")


@dataclass(frozen=True)
class Keep:
    """Every node's kept cores, and whether others take them ``never`` or ``when-full``."""

    nodes: tuple[Kept, ...] = ()
    others: str = NEVER

    @cached_property
    def cpus(self) -> CPUSet:
        return CPUSet.union_all(k.cpus for k in self.nodes)

    @property
    def soft(self) -> bool:
        return self.others == WHEN_FULL

    def mine(self, devices: Iterable[Device]) -> CPUSet:
        """The kept CPUs an allocation naming ``devices`` takes first (the kept cores of the
        nodes of the matching devices among them, by PCI address)."""
        if not self.nodes:
            return EMPTY
        addresses = {d.address for d in devices if d.address}
        return CPUSet.union_all(k.cpus for k in self.nodes
                                if any(d.address in addresses for d in k.devices))

    def locked(self, devices: Iterable[Device]) -> CPUSet:
        """The kept CPUs an allocation naming ``devices`` may not take (``never``) or takes
        only when nothing else fits (``when-full``)."""
        return self.cpus - self.mine(devices) if self.nodes else EMPTY

    def at(self, node: int) -> Kept | None:
        return next((k for k in self.nodes if k.node == node), None)


NO_KEEP = Keep()


def plan(topology: Topology, reserved: CPUSet, rules_: Sequence[Rule], inventory:
         Iterable[Device], others: str = NEVER) -> Keep:
    """Which cores each node keeps, for the devices of ``inventory`` the rules match (see the
    module's docstring). Deterministic: the same machine and rules keep the same cores."""
    if not rules_:
        return Keep((), others)
    wanted: dict[int, int] = {}
    devices: dict[int, list[Device]] = {}
    seen: set[str] = set()
    for d in inventory:
        rule = next((r for r in rules_ if r.matches(d)), None)
        nodes = near.cpu_nodes(topology, d.node)
        if rule is None or not nodes or not d.address or d.address in seen:
            continue  # no rule, no locality (it constrains nothing), or named twice
        seen.add(d.address)
        wanted[nodes[0]] = wanted.get(nodes[0], 0) + rule.cores
        devices.setdefault(nodes[0], []).append(d)
    cores = _cores(topology, reserved)
    kept = []
    for node in sorted(wanted):
        take = cores.get(node, [])[:wanted[node]]
        kept.append(Kept(node, CPUSet.union_all(take), tuple(devices[node]), wanted[node],
                         len(take)))
    return Keep(tuple(kept), others)


def _cores(topology: Topology, reserved: CPUSet) -> dict[int, list[CPUSet]]:
    """Per node, its cores (every thread, offline ones too) that hold no reserved CPU and lie
    in that node alone, highest-numbered first."""
    threads: dict[int, set[int]] = {}
    for info in topology.cpus.values():
        threads.setdefault(info.core, set()).add(info.cpu)
    out: dict[int, list[CPUSet]] = {}
    for cs in threads.values():
        nodes = {topology.cpus[c].node for c in cs}
        if len(nodes) == 1 and not any(c in reserved for c in cs):
            out.setdefault(nodes.pop(), []).append(CPUSet(cs))
    return {x: sorted(v, key=lambda cs: -max(cs)) for x, v in out.items()}


def describe(keep: Keep) -> list[str]:
    """One line per node that keeps cores (the daemon logs them at startup)."""
    return [k.note for k in keep.nodes]
