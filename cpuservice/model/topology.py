"""The CPU topology of a machine as a pure model: sockets, dies, NUMA nodes, L3 groups, cores,
threads and memory nodes, with named queries. cpuservice.model.discovery turns what was read
from sysfs into one. No I/O here."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from math import gcd
from typing import Any

from cpuservice.model.cpuset import EMPTY, CPUSet

__all__ = ["CPU", "Cells", "CoreThreads", "Topology", "TopologyError"]

Cell = tuple[int, int]


class TopologyError(RuntimeError):
    """The sysfs tree does not describe any CPU."""


@dataclass(frozen=True)
class CPU:
    """One logical CPU. ``core`` and ``l3`` are dense indexes; ``socket``, ``die`` and ``node``
    are labels (kernel ids where the kernel gives usable ones, see resolve()); none is ever
    negative, and ``node`` is a kernel node or one of the topology's ``pseudo_nodes``."""

    cpu: int
    core: int
    socket: int
    die: int
    node: int
    l3: int
    online: bool

    def as_dict(self) -> dict[str, int | bool]:
        return {
            "cpu": self.cpu,
            "core": self.core,
            "socket": self.socket,
            "die": self.die,
            "node": self.node,
            "l3": self.l3,
            "online": self.online,
        }


@dataclass(frozen=True)
class Cells:
    """The CPUs in cells, by which placement keeps its views of free CPUs: (NUMA node, L3 group)
    when every core lies in one of those (``l3``), else (node, -1). ``of``: cpu -> cell;
    ``cpus``: cell -> its CPUs (cells in order); ``in_node``: node -> its cells, in order;
    ``nested``: every core lies in one node; ``node_socket``: node -> its socket, None when a
    node spans sockets."""

    of: Mapping[int, Cell]
    cpus: Mapping[Cell, frozenset[int]]
    in_node: Mapping[int, tuple[Cell, ...]]
    l3: bool
    nested: bool
    node_socket: Mapping[int, int] | None
    nodes: Mapping[Cell, frozenset[int]]
    """The coarser grouping a single choice needs: one cell (node, -1) per node."""
    node_in: Mapping[int, tuple[Cell, ...]]


@dataclass(frozen=True)
class CoreThreads:
    """The cores as sets, by which the free view (model/freeview.py) keeps the wholly free
    cores of a cell with a few set operations per change instead of counting threads.
    ``of``: cpu -> the online threads of its core (itself included); ``wide``: the lowest
    thread of each core whose threads_per_core threads are all online; ``full``: the threads
    of those cores; ``partial``: the online threads of cores with an offline thread;
    ``first``: the lowest online thread of each core."""

    of: Mapping[int, frozenset[int]]
    wide: frozenset[int]
    full: frozenset[int]
    partial: frozenset[int]
    first: frozenset[int]


def _group(cpus: Mapping[int, CPU], key: str) -> dict[int, CPUSet]:
    groups: dict[int, set[int]] = {}
    for info in cpus.values():
        if info.online:
            groups.setdefault(getattr(info, key), set()).add(info.cpu)
    return {k: CPUSet(v) for k, v in sorted(groups.items())}


@dataclass(frozen=True)
class Topology:
    """All logical CPUs of a machine plus the kernel-isolated set and what is known of memory.

    ``notes``: cpu -> what was uncertain about its place and the rule that placed it.
    ``memory_nodes``: the kernel nodes that have memory (None: not known; then every node of a
    CPU counts as having memory). ``memory_of``: node -> the memory nodes its CPUs use when
    that is not the node itself (a node without memory, a pseudo node). ``pseudo_nodes``: NUMA
    groups of CPUs whose node the kernel does not say (no kernel node has these ids).
    ``node_memory_kb``: node -> MemTotal where read. ``node_distances``: node -> node -> the
    kernel's distance (``nodeN/distance``) where every row was read whole. ``warnings``: what
    discovery found malformed or contradictory, each naming its file. (None of these three is
    compared: two readings of one machine are equal whatever their warnings and memory.)"""

    cpus: Mapping[int, CPU]
    isolated: CPUSet = field(default=EMPTY)
    inferred: CPUSet = field(default=EMPTY)
    """CPUs whose place could not be read (never seen online): inferred, read when online."""
    notes: Mapping[int, str] = field(default_factory=dict)
    memory_nodes: CPUSet | None = None
    memory_of: Mapping[int, CPUSet] = field(default_factory=dict)
    pseudo_nodes: CPUSet = field(default=EMPTY)
    node_memory_kb: Mapping[int, int] = field(default_factory=dict, compare=False)
    warnings: tuple[str, ...] = field(default=(), compare=False)
    node_distances: Mapping[int, Mapping[int, int]] = field(default_factory=dict, compare=False)

    @cached_property
    def _node_sets(self) -> dict[CPUSet, CPUSet]:
        """node_set's answers so far (a value's memo: the topology never changes)."""
        return {}

    @cached_property
    def all(self) -> CPUSet:
        return CPUSet(self.cpus)

    @cached_property
    def online(self) -> CPUSet:
        return CPUSet(c for c, info in self.cpus.items() if info.online)

    @cached_property
    def cores(self) -> dict[int, CPUSet]:
        """Physical core index -> its online threads."""
        return _group(self.cpus, "core")

    @cached_property
    def l3_groups(self) -> dict[int, CPUSet]:
        return _group(self.cpus, "l3")

    @cached_property
    def nodes(self) -> dict[int, CPUSet]:
        return _group(self.cpus, "node")

    @cached_property
    def sockets(self) -> dict[int, CPUSet]:
        return _group(self.cpus, "socket")

    @cached_property
    def core_size(self) -> dict[int, int]:
        """Physical core index -> number of threads it has, online or not (per core: on hybrid
        machines P-cores have 2, E-cores 1)."""
        sizes: dict[int, int] = {}
        for info in self.cpus.values():
            sizes[info.core] = sizes.get(info.core, 0) + 1
        return sizes

    @cached_property
    def sizes(self) -> tuple[dict[int, int], ...]:
        """Online CPUs per group at each level of ``levels``: socket, NUMA node, L3 group,
        core (plain ints for placement's inner loops)."""
        return tuple({g: len(cpus) for g, cpus in groups.items()}
                     for groups in (self.sockets, self.nodes, self.l3_groups, self.cores))

    @cached_property
    def core_threads(self) -> CoreThreads:
        """The cores as sets (CoreThreads)."""
        online = {k: t.ids for k, t in self.cores.items()}
        tpc, size = self.threads_per_core, self.core_size
        full = [t for t in online.values() if len(t) == tpc]
        return CoreThreads(
            {c: online.get(info.core, frozenset()) | {c} for c, info in self.cpus.items()},
            frozenset(min(t) for t in full), frozenset().union(*full),
            frozenset().union(*(t for k, t in online.items() if len(t) < size[k])),
            frozenset(min(t) for t in online.values() if t))

    @cached_property
    def core_step(self) -> int:
        """The step in which whole cores add up: the greatest common divisor of the core sizes
        (2 on SMT-2, 1 on a machine with any single-thread core)."""
        return gcd(*self.core_size.values()) if self.core_size else 1

    @cached_property
    def threads_per_core(self) -> int:
        """The largest core size (kept for compatibility: use core_size per core)."""
        return max(self.core_size.values(), default=1)

    @cached_property
    def levels(self) -> tuple[dict[int, int], ...]:
        """cpu -> group at each level, outermost first: socket, NUMA node, L3 group, core."""
        return tuple(
            {c: getattr(info, attr) for c, info in self.cpus.items()}
            for attr in ("socket", "node", "l3", "core")
        )

    @cached_property
    def cells(self) -> Cells:
        _, node_of, l3_of, _ = self.levels
        cores = self.cores.values()
        l3 = all(len({(node_of[c], l3_of[c]) for c in t}) == 1 for t in cores)
        nested = l3 or all(len({node_of[c] for c in t}) == 1 for t in cores)
        of = {c: (node_of[c], l3_of[c] if l3 else -1) for c in self.cpus}
        cpus: dict[Cell, set[int]] = {}
        for c, cell in of.items():
            cpus.setdefault(cell, set()).add(c)
        in_node: dict[int, list[Cell]] = {}
        for cell in sorted(cpus):
            in_node.setdefault(cell[0], []).append(cell)
        sockets = {x: {self.cpus[c].socket for c in cpus} for x, cpus in self.nodes.items()}
        node_socket = ({x: min(s) for x, s in sockets.items()}
                       if all(len(s) == 1 for s in sockets.values()) else None)
        return Cells(of, {cell: frozenset(cs) for cell, cs in sorted(cpus.items())},
                     {x: tuple(cs) for x, cs in in_node.items()}, l3, nested, node_socket,
                     {(x, -1): frozenset(c for cell in cs for c in cpus[cell])
                      for x, cs in in_node.items()},
                     {x: ((x, -1),) for x in in_node})

    @cached_property
    def memory_only_nodes(self) -> CPUSet:
        """Nodes with memory and no CPU (HBM, CXL, GPU memory): never used for CPUs."""
        if self.memory_nodes is None:
            return EMPTY
        return self.memory_nodes - CPUSet(info.node for info in self.cpus.values())

    # named queries: placement and repair ask these rather than index levels
    def core_of(self, cpu: int) -> int:
        return self.cpus[cpu].core

    def node_of(self, cpu: int) -> int:
        return self.cpus[cpu].node

    def l3_of(self, cpu: int) -> int:
        return self.cpus[cpu].l3

    def socket_of(self, cpu: int) -> int:
        return self.cpus[cpu].socket

    def distance(self, a: int, b: int) -> int:
        """The kernel's distance from node ``a`` to node ``b``; where it was not read (pseudo
        nodes, a kernel without NUMA), the kernel's own defaults: 10 local, 20 remote."""
        known = self.node_distances.get(a, {}).get(b)
        if known is not None:
            return known
        return 10 if a == b else 20

    def siblings(self, cpu: int) -> CPUSet:
        """The online threads of ``cpu``'s core (itself included when online)."""
        return self.cores.get(self.cpus[cpu].core, EMPTY)

    def whole_cores(self, cpus: Iterable[int]) -> CPUSet:
        """The CPUs of ``cpus`` whose core lies wholly in ``cpus``: every thread of the core,
        online or not, counted by the core's own size (whole-core counting lives here)."""
        core_of, size = self.levels[3], self.core_size
        counts: Counter[int] = Counter()
        mine = [c for c in cpus if c in core_of]
        for c in mine:
            counts[core_of[c]] += 1
        return CPUSet(c for c in mine if counts[core_of[c]] == size[core_of[c]])

    def count_whole_cores(self, cpus: Iterable[int]) -> int:
        """How many cores lie wholly in ``cpus``."""
        return len({self.cpus[c].core for c in self.whole_cores(cpus)})

    def node_set(self, cpus: Iterable[int]) -> CPUSet:
        """The memory nodes for the given CPUs: their NUMA nodes, where a node without memory
        (or a pseudo node) stands for its nearest memory nodes. Only nodes that exist and have
        memory (when that is known)."""
        if isinstance(cpus, CPUSet):  # the shared pool, asked once per unbound allocation
            known = self._node_sets.get(cpus)
            if known is None:
                if len(self._node_sets) >= 1024:
                    self._node_sets.clear()
                known = self._node_sets[cpus] = self._nodes_of(cpus)
            return known
        return self._nodes_of(cpus)

    def _nodes_of(self, cpus: Iterable[int]) -> CPUSet:
        out: set[int] = set()
        for node in {self.cpus[c].node for c in cpus if c in self.cpus}:
            out |= self.memory_of.get(node, CPUSet([node])).ids
        return CPUSet(out)

    def with_online(self, online: CPUSet) -> Topology:
        """The same machine with another online set (for pure hotplug tests)."""
        cpus = {c: replace(info, online=c in online) for c, info in self.cpus.items()}
        return replace(self, cpus=cpus)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per CPU: CPU.as_dict() plus ``inferred``, and ``note`` where there is one."""
        out: list[dict[str, Any]] = []
        for c in sorted(self.cpus):
            row: dict[str, Any] = {**self.cpus[c].as_dict(), "inferred": c in self.inferred}
            if c in self.notes:
                row["note"] = self.notes[c]
            out.append(row)
        return out

    def to_json(self) -> str:
        """The D-Bus ``Topology`` property: a JSON array of rows (see rows())."""
        return json.dumps(self.rows())

    def document(self) -> dict[str, Any]:
        """Everything known, for a richer view: ``cpus`` (rows()), ``notes`` {cpu: text},
        ``memory_nodes`` and ``memory_only_nodes`` and ``pseudo_nodes`` (cpu lists, memory_nodes
        null when unknown), ``memory_of`` {node: cpu list}, ``node_memory_kb`` {node: kB},
        ``warnings`` [text]. Keys of the objects are strings (JSON)."""
        return {
            "cpus": self.rows(),
            "notes": {str(c): text for c, text in sorted(self.notes.items())},
            "memory_nodes": None if self.memory_nodes is None else self.memory_nodes.format(),
            "memory_only_nodes": self.memory_only_nodes.format(),
            "pseudo_nodes": self.pseudo_nodes.format(),
            "memory_of": {str(n): s.format() for n, s in sorted(self.memory_of.items())},
            "node_memory_kb": {str(n): kb for n, kb in sorted(self.node_memory_kb.items())},
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------------------------
# What sysfs says, before the rules: built by cpuservice.host.sysfs (from files) or by
# cpuservice.model.fixtures (in memory).
