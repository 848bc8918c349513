"""Imaginary machines, for tests, benchmarks, the planner and demos: built in memory
(Machine.topology(), through the same rules discovery applies to a real reading) or written as a
sysfs tree (write_sysfs(), only for the tests of sysfs reading).

The named machines are the ones the test-suite and the docs talk about:
``a`` 1 socket x 8 cores; ``b`` 2 sockets x 4 cores x 2 threads, 2 NUMA nodes, siblings N and N+8;
``c`` 2 x 32 x 2, 4 NUMA nodes, L3 per 8 cores, siblings N and N+64 (EPYC-like);
``d`` offline CPUs, non-contiguous ids and isolated CPUs; ``e`` 1,024 logical CPUs;
``lab`` the VM lab's 2 x 2 x 2 with adjacent siblings.

SHAPES are machines shaped like real kernels' trees that discovery once got wrong (learned from
the real /sys dumps hwloc keeps as test data; none of their files is used here): repeated
``core_id`` within a package (AMD Opteron), package id -1 (s390), only hex ``_map`` files (POWER9
on 4.14, old kernels), lists ending in ``\\n\\0`` (5.15-rc1), hybrid P/E cores (Alder Lake),
sub-NUMA clustering, CPUs in no node (RHEL 7.6), memory-only nodes (HBM, CXL, GPU memory),
AMD Bulldozer compute units, offline CPUs.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.discovery import resolve
from cpuservice.model.reading import CPUFacts, NodeFacts, Reading
from cpuservice.model.topology import Topology


@dataclass(frozen=True)
class Machine:
    """Shape of an imaginary machine.

    ``adjacent_siblings``: siblings are numbered 2N and 2N+1 (else N and N + cores).
    ``ids``: optional renumbering of logical CPUs 0..n-1 (for non-contiguous ids).
    ``small_cores``: the last that many cores of each socket have one thread (hybrid).
    ``core_ids``: ``"per-package"`` (0.. in each package), ``"per-node"`` (0.. again in each node,
    as AMD Opteron kernels number them) or ``"compute-units"`` (each thread its own core_id
    while the sibling masks pair them: AMD Bulldozer).
    ``package_id_unknown``: ``physical_package_id`` is -1 (s390, PS3).
    ``unlisted``: CPUs in no node's cpulist and without a node link.
    ``memory_only_nodes``: nodes with memory and no CPU, numbered after the others.
    ``memoryless``: nodes that have CPUs and no memory.
    """

    sockets: int
    cores_per_socket: int
    threads: int = 1
    nodes: int = 1
    l3_cores: int | None = None
    adjacent_siblings: bool = False
    ids: tuple[int, ...] | None = None
    offline: frozenset[int] = field(default_factory=frozenset)
    isolated: frozenset[int] = field(default_factory=frozenset)
    small_cores: int = 0
    core_ids: str = "per-package"
    package_id_unknown: bool = False
    unlisted: frozenset[int] = field(default_factory=frozenset)
    memory_only_nodes: int = 0
    memoryless: frozenset[int] = field(default_factory=frozenset)

    @property
    def logical(self) -> int:
        return len(self._rows())

    def _threads(self, core: int) -> int:
        return 1 if core % self.cores_per_socket >= self.cores_per_socket - self.small_cores \
            else self.threads

    def _rows(self) -> list[tuple[int, int, int, int, int, int]]:
        """(cpu id, socket, core index, core_id, node, l3 group) for every logical CPU."""
        cores = self.sockets * self.cores_per_socket
        cores_per_node = max(cores // self.nodes, 1)
        l3_cores = self.l3_cores or self.cores_per_socket
        order = [(core, t) for core in range(cores) for t in range(self._threads(core))]
        if not self.adjacent_siblings:
            order.sort(key=lambda ct: (ct[1], ct[0]))
        rows = []
        for n, (core, t) in enumerate(order):
            socket, node = core // self.cores_per_socket, min(core // cores_per_node,
                                                             self.nodes - 1)
            core_id = core % self.cores_per_socket
            if self.core_ids == "per-node":
                core_id = core % cores_per_node
            elif self.core_ids == "compute-units":
                core_id = core_id * self.threads + t
            rows.append((self.ids[n] if self.ids else n, socket, core, core_id, node,
                         core // l3_cores))
        return sorted(rows)

    def layout(self) -> list[tuple[int, int, int, int, int]]:
        """(cpu id, socket, core_id, node, l3 group) for every logical CPU."""
        return [(cpu, socket, core_id, node, l3) for cpu, socket, _, core_id, node, l3
                in self._rows()]

    def reading(self) -> Reading:
        """What a kernel would show for this machine (offline CPUs: no topology, no node
        list entry, their node link kept; masks name online CPUs only)."""
        rows = self._rows()
        everything = CPUSet(r[0] for r in rows)
        online = everything - CPUSet(self.offline)

        groups: dict[tuple[int, int], set[int]] = {}
        for r in rows:
            if r[0] in online:
                for i in (1, 2, 5):
                    groups.setdefault((i, r[i]), set()).add(r[0])
        sets = {key: CPUSet(cpus) for key, cpus in groups.items()}

        def peers(i: int, mine: tuple[int, ...]) -> CPUSet:
            return sets[(i, mine[i])]

        cpus: dict[int, CPUFacts] = {}
        for mine in rows:
            cpu, socket, _, core_id, node, _ = mine
            link = None if cpu in self.unlisted else node
            if cpu not in online:
                cpus[cpu] = CPUFacts(node_link=link)
                continue
            package = peers(1, mine)
            cpus[cpu] = CPUFacts(
                True, -1 if self.package_id_unknown else socket, 0 if not self.package_id_unknown
                else -1, core_id, peers(2, mine), package, package, peers(5, mine), True, link)
        kernel_nodes = self.nodes + self.memory_only_nodes
        nodes = {
            n: NodeFacts(
                CPUSet(r[0] for r in rows if r[4] == n and r[0] in online
                       and r[0] not in self.unlisted),
                0 if n in self.memoryless else 16 << 20,
                tuple(10 if m == n else 20 if (m < self.nodes) == (n < self.nodes) else 30
                      for m in range(kernel_nodes)))
            for n in range(kernel_nodes)
        }
        has_memory = CPUSet(n for n in range(kernel_nodes) if n not in self.memoryless)
        return Reading(cpus, online, nodes, CPUSet(self.isolated), has_memory)

    def topology(self) -> Topology:
        """The Topology discovery would find on this machine, built in memory."""
        return resolve(self.reading())


MACHINES: dict[str, Machine] = {
    "a": Machine(1, 8),
    "b": Machine(2, 4, 2, nodes=2),
    "c": Machine(2, 32, 2, nodes=4, l3_cores=8),
    "d": Machine(2, 3, 2, nodes=2, adjacent_siblings=True,
                 ids=(0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 21),
                 offline=frozenset({3, 17}), isolated=frozenset({20, 21})),
    "e": Machine(4, 128, 2, nodes=8, l3_cores=8),
    "lab": Machine(2, 2, 2, nodes=2, adjacent_siblings=True),
}

SHAPES: dict[str, Machine] = {
    "opteron": Machine(2, 8, nodes=4, core_ids="per-node"),  # 6134: core_id 0-3 twice a package
    "bulldozer": Machine(2, 8, 2, nodes=4, adjacent_siblings=True, core_ids="compute-units"),
    "s390": Machine(3, 4, package_id_unknown=True),
    "hybrid": Machine(1, 10, 2, small_cores=4, adjacent_siblings=True),  # 6 P-cores + 4 E-cores
    "snc": Machine(2, 8, 2, nodes=4),  # L3 per socket, 2 nodes per socket
    "no-node": Machine(2, 4, 2, nodes=2, unlisted=frozenset({4, 5, 6, 7, 12, 13, 14, 15})),
    "memory-only": Machine(2, 4, 2, nodes=2, memory_only_nodes=2),
    "memoryless": Machine(2, 4, 2, nodes=2, memoryless=frozenset({1})),
    "offline": Machine(2, 4, 2, nodes=2, offline=frozenset({5, 13, 6})),
}


@dataclass(frozen=True)
class Style:
    """How write_reading() spells a tree, as different kernels do: ``lists``/``maps`` write
    the ``*_list`` and/or hex ``*_map`` forms (node ``cpulist``/``cpumap`` too); ``old_names``
    writes ``thread_siblings``/``core_siblings`` only (kernels before 5.0) instead of also
    ``core_cpus``/``package_cpus``; ``end`` ends every file (``"\\n\\0"``: 5.15-rc1)."""

    lists: bool = True
    maps: bool = False
    old_names: bool = False
    end: str = "\n"
    meminfo: bool = True


def format_map(cpus: CPUSet, width: int) -> str:
    """The kernel's hex mask form: comma-separated 32-bit words, most significant first."""
    value = sum(1 << c for c in cpus)
    words = [(value >> (32 * i)) & 0xFFFFFFFF for i in range(width)]
    return ",".join(f"{w:08x}" for w in reversed(words))


def write_reading(root: str | Path, reading: Reading, style: Style = Style()) -> Path:
    """Write a sysfs tree showing ``reading`` under ``root``; writing again over an existing
    tree brings it in line (CPUs without topology lose their topology and cache files, as
    with the kernel)."""
    root = Path(root)
    base = root / "devices/system/cpu"
    everything = CPUSet(reading.cpus)
    width = max(everything.sorted()[-1] // 32 + 1, 1)

    def write(path: Path, text: str) -> None:
        # writing a tree again rewrites only what changed: opening a file to write costs ten
        # times what reading it does, and the hotplug properties write trees thousands of times
        text += style.end
        try:
            if path.read_text() == text:
                return
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def mask(directory: Path, names: tuple[str, str], cpus: CPUSet | None) -> None:
        for name, on, text in ((names[0], style.lists, cpus.format() if cpus is not None else ""),
                               (names[1], style.maps, format_map(cpus or EMPTY, width))):
            if on and cpus is not None:
                write(directory / name, text)
            elif (directory / name).exists():
                (directory / name).unlink()

    write(base / "possible", everything.format())
    write(base / "present", everything.format())
    write(base / "online", reading.online.format())
    write(base / "offline", (everything - reading.online).format())
    write(base / "isolated", reading.isolated.format())
    for cpu, f in reading.cpus.items():
        d = base / f"cpu{cpu}"
        d.mkdir(parents=True, exist_ok=True)
        if cpu != everything.first():
            write(d / "online", "1" if cpu in reading.online else "0")
        for old in d.glob("node*"):
            if old.name != f"node{f.node_link}":
                old.unlink()
        link = d / f"node{f.node_link}"
        if f.node_link is not None and not link.is_symlink():
            link.symlink_to(f"../../node/node{f.node_link}")  # kept while offline, as the kernel
        if not f.topology:
            for gone in ("topology", "cache"):
                shutil.rmtree(d / gone, ignore_errors=True)
            continue
        topo = d / "topology"
        topo.mkdir(parents=True, exist_ok=True)
        for name, value in (("physical_package_id", f.package_id), ("die_id", f.die_id),
                            ("core_id", f.core_id)):
            if value is not None:
                write(topo / name, str(value))
        mask(topo, ("thread_siblings_list", "thread_siblings"), f.core_cpus)
        mask(topo, ("core_siblings_list", "core_siblings"), f.package_cpus)
        for names, cpus in ((("core_cpus_list", "core_cpus"), f.core_cpus),
                            (("package_cpus_list", "package_cpus"), f.package_cpus),
                            (("die_cpus_list", "die_cpus"), f.die_cpus)):
            mask(topo, names, None if style.old_names else cpus)
        if f.l3_cpus is not None:
            core = f.core_cpus or CPUSet([cpu])
            for index, level, kind, shared in ((0, 1, "Data", core), (1, 1, "Instruction", core),
                                               (2, 2, "Unified", core), (3, 3, "Unified",
                                                                        f.l3_cpus)):
                write(d / f"cache/index{index}/level", str(level))
                write(d / f"cache/index{index}/type", kind)
                mask(d / f"cache/index{index}", ("shared_cpu_list", "shared_cpu_map"), shared)
    node_root = root / "devices/system/node"
    for node, nf in reading.nodes.items():
        nd = node_root / f"node{node}"
        nd.mkdir(parents=True, exist_ok=True)
        mask(nd, ("cpulist", "cpumap"), nf.cpus)
        if nf.memory_kb is not None and style.meminfo:
            write(nd / "meminfo", f"Node {node} MemTotal:       {nf.memory_kb} kB\n"
                                  f"Node {node} MemFree:        {nf.memory_kb // 2} kB")
        if nf.distances is not None:
            write(nd / "distance", " ".join(map(str, nf.distances)))
    if reading.has_memory is not None:
        write(node_root / "has_memory", reading.has_memory.format())
    return root


def write_sysfs(root: str | Path, machine: Machine | str, style: Style = Style()) -> Path:
    """Write a sysfs tree for ``machine`` (or a name from MACHINES or SHAPES) under ``root``;
    writing again over an existing tree brings it in line."""
    spec = machine if isinstance(machine, Machine) else {**MACHINES, **SHAPES}[machine]
    return write_reading(root, spec.reading(), style)
