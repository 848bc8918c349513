"""Read the CPU topology from a sysfs tree: the thin I/O shell around cpuservice.model.topology.

read() gathers what the kernel writes under ``devices/system/cpu`` and ``devices/system/node``
into a Reading (both the ``*_list`` and the hex ``*_map`` forms; trailing NULs and whitespace
are ignored; a file that cannot be parsed becomes a warning naming it, never an exception);
discover() resolves a reading by the rules of cpuservice.model.topology; refresh() re-reads little
after a hotplug event.
"""

from __future__ import annotations

import re
from pathlib import Path

from cpuservice.model.cpuset import EMPTY, MAX_CPU_ID, CPUSet, CPUSetError
from cpuservice.model.discovery import resolve
from cpuservice.model.reading import CPUFacts, NodeFacts, Reading
from cpuservice.model.topology import Topology, TopologyError

_CPU_DIR = re.compile(r"cpu(\d+)$")
_NODE_DIR = re.compile(r"node(\d+)$")
_JUNK = "\0 \n\t"

# each mask of a CPU: its list file and its map file, newest names first
CORE_FILES = (("core_cpus_list", "core_cpus"), ("thread_siblings_list", "thread_siblings"))
PACKAGE_FILES = (("package_cpus_list", "package_cpus"), ("core_siblings_list", "core_siblings"))
DIE_FILES = (("die_cpus_list", "die_cpus"),)


class _Reader:
    """Reads files under one root, collecting warnings for the ones it cannot parse."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.warnings: list[str] = []

    def name(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def text(self, path: Path) -> str | None:
        """A file's text without trailing NULs and whitespace; None when it cannot be read:
        missing, or (seen in the lab, EPERM) the attribute of a CPU that is being taken
        down."""
        try:
            return path.read_text(errors="replace").strip(_JUNK)
        except OSError:
            return None

    def integer(self, path: Path) -> int | None:
        text = self.text(path)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            self.warnings.append(f"{self.name(path)}: not an integer: {text[:40]!r}; ignored")
            return None

    def cpus(self, path: Path, hex_map: bool = False) -> CPUSet | None:
        text = self.text(path)
        if text is None:
            return None
        try:
            return parse_map(text) if hex_map else CPUSet.parse(text)
        except (CPUSetError, ValueError):
            self.warnings.append(f"{self.name(path)}: not a CPU {'mask' if hex_map else 'list'}"
                                 f": {text[:40]!r}; ignored")
            return None

    def mask(self, directory: Path, names: tuple[tuple[str, str], ...], cpu: int | None = None
             ) -> tuple[CPUSet | None, str | None]:
        """The first readable of (list, map) file pairs, and its name; with ``cpu``, a mask
        that does not name that CPU is passed over (with a warning) for the next form."""
        for list_name, map_name in names:
            for name, hex_map in ((list_name, False), (map_name, True)):
                cpus = self.cpus(directory / name, hex_map)
                if cpus is not None and cpu is not None and cpu not in cpus:
                    self.warnings.append(f"{self.name(directory / name)}: {cpus} does not name "
                                         f"cpu{cpu} itself; ignored")
                elif cpus is not None:
                    return cpus, self.name(directory / name)
        return None, None


def parse_map(text: str) -> CPUSet:
    """The kernel's hex mask form (``00000000,0000ffff``: 32-bit words, most significant
    first); ValueError when it is not one."""
    digits = text.strip(_JUNK).replace(",", "")
    if not digits or any(ch not in "0123456789abcdefABCDEF" for ch in digits):
        raise ValueError(f"not a hex mask: {text[:40]!r}")
    value = int(digits, 16)
    return CPUSet(i for i in range(value.bit_length()) if value >> i & 1)


def _ids(directory: Path, pattern: re.Pattern[str]) -> list[int]:
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := pattern.match(n)))


def _node_link(cpu_dir: Path) -> int | None:
    """The node of ``cpuN/nodeM``: the kernel keeps this link while the CPU is offline."""
    for node in _ids(cpu_dir, _NODE_DIR):
        return node
    return None


def _l3(r: _Reader, cpu_dir: Path, cpu: int, core: CPUSet | None
        ) -> tuple[CPUSet | None, bool, str | None]:
    """(CPUs sharing the level-3 cache, whether the CPU has cache entries, the file). An
    empty shared mask (old ia64 kernels) is a cache of the CPU's own core."""
    cache = cpu_dir / "cache"
    indexes = [cache / f"index{i}" for i in _ids(cache, re.compile(r"index(\d+)$"))]
    for index in reversed(indexes):  # the L3 is usually the last entry
        if r.text(index / "level") == "3" and r.text(index / "type") != "Instruction":
            names = (("shared_cpu_list", "shared_cpu_map"),)
            if r.mask(index, names)[0] == EMPTY:
                return core or CPUSet([cpu]), True, r.name(index / "shared_cpu_map")
            cpus, name = r.mask(index, names, cpu)
            if cpus:
                return cpus, True, name
    return None, bool(indexes), None


def cpu_facts(r: _Reader, base: Path, cpu: int) -> CPUFacts:
    cpu_dir = base / f"cpu{cpu}"
    topo = cpu_dir / "topology"
    try:
        entries = {p.name for p in topo.iterdir()}
    except OSError:
        return CPUFacts(node_link=_node_link(cpu_dir))
    core, core_file = r.mask(topo, CORE_FILES, cpu)
    package, package_file = r.mask(topo, PACKAGE_FILES, cpu)
    die, die_file = r.mask(topo, DIE_FILES, cpu)
    ids = {name: r.integer(topo / name) if name in entries else None
           for name in ("physical_package_id", "die_id", "core_id")}
    if entries and all(v is None for v in (core, package, ids["physical_package_id"],
                                           ids["core_id"])):
        return CPUFacts(node_link=_node_link(cpu_dir))  # files there, none readable: changing
    l3, caches, l3_file = _l3(r, cpu_dir, cpu, core)
    files = {k: v for k, v in (("core_cpus", core_file), ("package_cpus", package_file),
                                ("die_cpus", die_file), ("l3_cpus", l3_file)) if v}
    return CPUFacts(True, ids["physical_package_id"], ids["die_id"], ids["core_id"], core,
                    package, die, l3, caches, _node_link(cpu_dir), files)


def node_facts(r: _Reader, node_dir: Path) -> NodeFacts:
    cpus, cpus_file = r.mask(node_dir, (("cpulist", "cpumap"),))
    memory_kb = None
    meminfo = r.text(node_dir / "meminfo")
    if meminfo is not None:
        for line in meminfo.splitlines():
            if "MemTotal:" in line:
                value = line.split("MemTotal:")[1].split()
                if value and value[0].isdigit():
                    memory_kb = int(value[0])
                else:
                    r.warnings.append(f"{r.name(node_dir / 'meminfo')}: unreadable MemTotal")
    distances = None
    text = r.text(node_dir / "distance")
    if text is not None:
        try:
            distances = tuple(int(v) for v in text.split())
        except ValueError:
            r.warnings.append(f"{r.name(node_dir / 'distance')}: not a distance row; ignored")
    return NodeFacts(cpus, memory_kb, distances, {"cpus": cpus_file} if cpus_file else {})


def read(sysfs_root: str | Path = "/sys") -> Reading:
    """Everything discovery needs, as read; raises TopologyError when there is no CPU."""
    root = Path(sysfs_root)
    r = _Reader(root)
    base = root / "devices/system/cpu"
    ids = _ids(base, _CPU_DIR)
    for too_big in [c for c in ids if c > MAX_CPU_ID]:  # no kernel has them (NR_CPUS <= 8192)
        r.warnings.append(f"{r.name(base / f'cpu{too_big}')}: CPU id above {MAX_CPU_ID}; ignored")
        ids.remove(too_big)
    if not ids:
        raise TopologyError(f"no CPUs under {base}")
    online = r.cpus(base / "online")
    if online is None:
        online = CPUSet(c for c in ids if (r.text(base / f"cpu{c}/online") or "1") == "1")
    isolated = r.cpus(base / "isolated") or EMPTY
    node_root = root / "devices/system/node"
    nodes = {n: node_facts(r, node_root / f"node{n}") for n in _ids(node_root, _NODE_DIR)
             if n < MAX_CPU_ID}  # (the kernel's node ids stay below 1024)
    has_memory = r.cpus(node_root / "has_memory") if nodes else None
    cpus = {c: cpu_facts(r, base, c) for c in ids}
    return Reading(cpus, online, nodes, isolated, has_memory, tuple(r.warnings))


def discover(sysfs_root: str | Path = "/sys", previous: Topology | None = None) -> Topology:
    """Read and resolve the topology under ``sysfs_root`` (see cpuservice.model.topology)."""
    return resolve(read(sysfs_root), previous)


def refresh(sysfs_root: str | Path, previous: Topology) -> Topology:
    """The topology after a hotplug event, reading little: when the same CPUs exist, the
    previous reading had nothing uncertain (no inferred CPU online, no notes), and every CPU
    that came online reports the package, core siblings and node it had before, the previous
    topology with the new online and isolated sets; otherwise a full discover()."""
    root = Path(sysfs_root)
    r = _Reader(root)
    base = root / "devices/system/cpu"
    online = r.cpus(base / "online")
    if set(_ids(base, _CPU_DIR)) != previous.cpus.keys() or online is None \
            or previous.inferred & online or previous.notes:
        return discover(sysfs_root, previous)
    node_of: dict[int, int] | None = None
    for cpu in online - previous.online:
        info = previous.cpus[cpu]
        topo = base / f"cpu{cpu}/topology"
        siblings, _ = r.mask(topo, CORE_FILES)
        package, _ = r.mask(topo, PACKAGE_FILES)
        package_id = r.integer(topo / "physical_package_id")
        core = CPUSet(c for c, i in previous.cpus.items() if i.core == info.core)
        socket = CPUSet(c for c, i in previous.cpus.items() if i.socket == info.socket)
        same_package = package <= socket if package is not None else \
            package_id is not None and max(package_id, 0) == info.socket
        if siblings is None or not siblings <= core or not same_package:
            return discover(sysfs_root, previous)
        if node_of is None:
            node_of = {}
            node_root = root / "devices/system/node"
            for n in _ids(node_root, _NODE_DIR):
                for c in r.mask(node_root / f"node{n}", (("cpulist", "cpumap"),))[0] or EMPTY:
                    node_of.setdefault(c, n)
        node = node_of.get(cpu, _node_link(base / f"cpu{cpu}"))
        if node is not None and node != info.node:
            return discover(sysfs_root, previous)
    isolated = r.cpus(base / "isolated") or EMPTY
    return Topology(previous.with_online(online).cpus, isolated, previous.inferred,
                    previous.notes, previous.memory_nodes, previous.memory_of,
                    previous.pseudo_nodes, previous.node_memory_kb, previous.warnings,
                    previous.node_distances)
