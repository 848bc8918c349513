"""CPU topology discovered from a sysfs tree: sockets, dies, NUMA nodes, L3 groups, cores, threads.

The result is immutable and cheap to rebuild; placement reads only its precomputed maps.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from .cpuset import EMPTY, CPUSet

_CPU_DIR = re.compile(r"cpu(\d+)$")
_NODE_DIR = re.compile(r"node(\d+)$")


class TopologyError(RuntimeError):
    """The sysfs tree does not describe any CPU."""


@dataclass(frozen=True)
class CPU:
    """One logical CPU. ``core`` and ``l3`` are dense indexes; the rest are kernel ids (always
    ids the machine has: see discover())."""

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


def _group(cpus: Mapping[int, CPU], key: str) -> dict[int, CPUSet]:
    groups: dict[int, set[int]] = {}
    for info in cpus.values():
        if info.online:
            groups.setdefault(getattr(info, key), set()).add(info.cpu)
    return {k: CPUSet(v) for k, v in sorted(groups.items())}


@dataclass(frozen=True)
class Topology:
    """All logical CPUs of a machine plus the kernel-isolated set."""

    cpus: Mapping[int, CPU]
    isolated: CPUSet = field(default=EMPTY)
    inferred: CPUSet = field(default=EMPTY)
    """CPUs whose place could not be read (never seen online): inferred, read when online."""

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
        """Physical core index -> number of threads it has, online or not."""
        sizes: dict[int, int] = {}
        for info in self.cpus.values():
            sizes[info.core] = sizes.get(info.core, 0) + 1
        return sizes

    @cached_property
    def threads_per_core(self) -> int:
        return max(self.core_size.values(), default=1)

    @cached_property
    def levels(self) -> tuple[dict[int, int], ...]:
        """cpu -> group at each level, outermost first: socket, NUMA node, L3 group, core."""
        return tuple(
            {c: getattr(info, attr) for c, info in self.cpus.items()}
            for attr in ("socket", "node", "l3", "core")
        )

    def node_set(self, cpus: CPUSet) -> CPUSet:
        """The NUMA nodes the given CPUs belong to."""
        return CPUSet(self.cpus[c].node for c in cpus if c in self.cpus)

    def with_online(self, online: CPUSet) -> Topology:
        """The same machine with another online set (for pure hotplug tests)."""
        cpus = {c: _replace_online(info, c in online) for c, info in self.cpus.items()}
        return Topology(cpus, self.isolated, self.inferred)

    def to_json(self) -> str:
        return json.dumps([{**self.cpus[c].as_dict(), "inferred": c in self.inferred}
                           for c in sorted(self.cpus)])


def _replace_online(info: CPU, online: bool) -> CPU:
    return CPU(info.cpu, info.core, info.socket, info.die, info.node, info.l3, online)


def _read(path: Path) -> str | None:
    """A sysfs file's text, None when it cannot be read: missing, or (seen in the lab, EPERM)
    the attribute of a CPU that is being taken down."""
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    """An integer file, or None when it is missing or not an integer (a CPU in transition)."""
    text = (_read(path) or "").strip("\0 \n\t")
    return int(text) if text.lstrip("-").isdigit() else None


def _read_list(path: Path) -> CPUSet | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return CPUSet.parse(text.strip("\0 \n\t"))
    except ValueError:
        return None


def _l3_list(cpu_dir: Path) -> CPUSet | None:
    cache = cpu_dir / "cache"
    if not cache.is_dir():
        return None
    for index in sorted(cache.glob("index*")):
        if (_read(index / "level") or "").strip() == "3":
            cpus = _read_list(index / "shared_cpu_list")
            if cpus:
                return cpus
    return None


def _node_link(cpu_dir: Path) -> int | None:
    """The node of ``cpuN/nodeM``: the kernel keeps this link while the CPU is offline."""
    for link in cpu_dir.glob("node*"):
        if (m := _NODE_DIR.match(link.name)) and link.is_dir():
            return int(m.group(1))
    return None


def _nodes(sysfs_root: Path) -> dict[int, int]:
    """cpu -> node from the nodes' cpulists; a CPU listed twice belongs to the lowest node."""
    node_of: dict[int, int] = {}
    dirs = [(int(m.group(1)), d) for d in (sysfs_root / "devices/system/node").glob("node*")
            if (m := _NODE_DIR.match(d.name))]
    for node, node_dir in sorted(dirs, reverse=True):
        for c in _read_list(node_dir / "cpulist") or EMPTY:
            node_of[c] = node
    return node_of


def refresh(sysfs_root: str | Path, previous: Topology) -> Topology:
    """The topology after a hotplug event, reading little: when the same CPUs exist and every CPU
    that came online reports the package, core siblings and node it had before (and its place was
    read, not inferred), the previous topology with the new online and isolated sets; otherwise a
    full discover()."""
    root = Path(sysfs_root)
    base = root / "devices/system/cpu"
    ids = {int(m.group(1)) for p in base.glob("cpu*") if (m := _CPU_DIR.match(p.name))}
    online = _read_list(base / "online")
    if ids != previous.cpus.keys() or online is None:
        return discover(sysfs_root, previous)
    if previous.inferred & online:
        return discover(sysfs_root, previous)
    node_of: dict[int, int] | None = None
    for cpu in online - previous.online:
        info = previous.cpus[cpu]
        topo = base / f"cpu{cpu}/topology"
        siblings = _read_list(topo / "thread_siblings_list")
        core = CPUSet(c for c, i in previous.cpus.items() if i.core == info.core)
        package = _read_int(topo / "physical_package_id")
        if package is None or max(package, 0) != info.socket or siblings is None \
                or not siblings <= core:
            return discover(sysfs_root, previous)
        if node_of is None:
            node_of = _nodes(root)
        node = node_of.get(cpu, _node_link(base / f"cpu{cpu}"))
        if node is not None and node != info.node:
            return discover(sysfs_root, previous)
    isolated = _read_list(base / "isolated") or EMPTY
    return Topology(previous.with_online(online).cpus, isolated, previous.inferred)


def discover(sysfs_root: str | Path = "/sys", previous: Topology | None = None) -> Topology:
    """Read the topology under ``sysfs_root``.

    Physical cores are keyed by (package, die, core_id). A CPU whose topology files cannot be
    read (offline, or half-way through going on- or offline) keeps its place from ``previous``
    when that place was read; otherwise its place is inferred and the CPU is listed in
    ``inferred`` (re-read when it comes online): the node from its ``nodeN`` link (which the
    kernel keeps while the CPU is offline), the package from its node's other CPUs, a core and an
    L3 group of its own. Every id in the result is one the machine has; nothing is UNKNOWN.
    """
    root = Path(sysfs_root)
    base = root / "devices/system/cpu"
    ids = sorted(int(m.group(1)) for p in base.glob("cpu*") if (m := _CPU_DIR.match(p.name)))
    if not ids:
        raise TopologyError(f"no CPUs under {base}")
    online = _read_list(base / "online")
    if online is None:
        online = CPUSet(c for c in ids if (_read(base / f"cpu{c}/online") or "1").strip() == "1")
    isolated = _read_list(base / "isolated") or EMPTY
    node_of = _nodes(root)
    for c in ids:
        if c not in node_of and (link := _node_link(base / f"cpu{c}")) is not None:
            node_of[c] = link

    fresh: dict[int, _Place] = {}
    for c in ids:
        topo_dir = base / f"cpu{c}/topology"
        package = _read_int(topo_dir / "physical_package_id")
        core_id = _read_int(topo_dir / "core_id")
        if package is None or core_id is None:
            continue
        socket = max(package, 0)
        die = max(_read_int(topo_dir / "die_id") or 0, 0)
        l3 = _l3_list(base / f"cpu{c}")
        fresh[c] = _Place((socket, die, core_id), ("l3", l3.first()) if l3 else None,
                          socket, die, node_of.get(c))

    has_l3 = any(p.l3 is not None for p in fresh.values())
    raw: dict[int, _Place] = {}
    inferred: set[int] = set()
    for c in ids:
        known = previous.cpus.get(c) if previous and c not in previous.inferred else None
        if c in fresh:
            place = fresh[c]
            if place.l3 is None and known:
                place = replace(place, l3=_peer_key(previous, fresh, c, "l3")
                                or ("previous l3", known.l3))
            elif place.l3 is None and not has_l3:
                place = replace(place, l3=("socket", place.socket, place.die))
            if place.node is None and known:
                place = replace(place, node=known.node)
            if place.l3 is None or place.node is None:
                inferred.add(c)  # half-way online: read again at the next event
            raw[c] = place
        elif known and previous:
            raw[c] = _Place(_peer_key(previous, fresh, c, "core") or ("previous core", known.core),
                            _peer_key(previous, fresh, c, "l3") or ("previous l3", known.l3),
                            known.socket, known.die, node_of.get(c, known.node))
        else:
            inferred.add(c)
            raw[c] = _Place(("alone", c), None, -1, 0, node_of.get(c))
    _infer(raw, node_of)

    core_index = _dense({c: p.core for c, p in raw.items()})
    l3_index = _dense({c: p.l3 for c, p in raw.items()})
    cpus = {
        c: CPU(c, core_index[c], p.socket, p.die, p.node if p.node is not None else 0,
               l3_index[c], c in online)
        for c, p in sorted(raw.items())
    }
    return Topology(cpus, isolated, CPUSet(inferred))


@dataclass(frozen=True)
class _Place:
    """Where one CPU sits, before group keys become dense indexes."""

    core: object
    l3: object
    socket: int
    die: int
    node: int | None


def _infer(raw: dict[int, _Place], node_of: Mapping[int, int]) -> None:
    """Fill in what could not be read, from what could: a missing node from the CPU's core
    siblings, else the most common node of its package, else the lowest node; a missing package
    from the CPUs of its node, else the lowest package; a missing L3 group from its package."""
    nodes = sorted(set(node_of.values())) or [0]
    for c, p in sorted(raw.items()):
        if p.socket < 0:
            peers = [q.socket for d, q in raw.items() if q.socket >= 0 and p.node is not None
                     and q.node == p.node]
            sockets = sorted(q.socket for q in raw.values() if q.socket >= 0) or [0]
            raw[c] = p = replace(p, socket=_most_common(peers) if peers else sockets[0])
        if p.node is None:
            siblings = [q.node for q in raw.values() if q.core == p.core and q.node is not None]
            package = [q.node for q in raw.values() if q.socket == p.socket and q.node is not None]
            raw[c] = p = replace(p, node=_most_common(siblings or package) if siblings or package
                                 else nodes[0])
        if p.l3 is None:
            same = [q.l3 for d, q in sorted(raw.items()) if d != c and q.socket == p.socket
                    and q.l3 is not None and q.core != ("alone", d)]
            raw[c] = replace(p, l3=same[0] if same else ("alone", c))


def _most_common(values: list[int]) -> int:
    return min(set(values), key=lambda v: (-values.count(v), v))


def _peer_key(previous: Topology | None, fresh: Mapping[int, _Place], cpu: int, attr: str
              ) -> object | None:
    """Key of the group an unreadable CPU belonged to, found through its former peers."""
    if previous is None:
        return None
    group = getattr(previous.cpus[cpu], attr)
    for peer, info in sorted(previous.cpus.items()):
        if getattr(info, attr) == group and peer in fresh:
            place = fresh[peer]
            key = place.core if attr == "core" else place.l3
            if key is not None:
                return key
    return None


def _dense(keys: Mapping[int, object]) -> dict[int, int]:
    """Number groups of equal keys 0.. in the order of their smallest CPU."""
    first: dict[object, int] = {}
    for c in sorted(keys):
        first.setdefault(keys[c], len(first))
    return {c: first[k] for c, k in keys.items()}
