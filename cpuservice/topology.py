"""CPU topology discovered from a sysfs tree: sockets, dies, NUMA nodes, L3 groups, cores, threads.

The result is immutable and cheap to rebuild; placement reads only its precomputed maps.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .cpuset import EMPTY, CPUSet

UNKNOWN = -1
_CPU_DIR = re.compile(r"cpu(\d+)$")
_NODE_DIR = re.compile(r"node(\d+)$")


class TopologyError(RuntimeError):
    """The sysfs tree does not describe any CPU."""


@dataclass(frozen=True)
class CPU:
    """One logical CPU. ``core`` and ``l3`` are dense indexes; the rest are kernel ids."""

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
        return Topology(cpus, self.isolated)

    def to_json(self) -> str:
        return json.dumps([self.cpus[c].as_dict() for c in sorted(self.cpus)])


def _replace_online(info: CPU, online: bool) -> CPU:
    return CPU(info.cpu, info.core, info.socket, info.die, info.node, info.l3, online)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read_int(path: Path) -> int:
    text = _read(path)
    return int(text) if text is not None and text.strip().lstrip("-").isdigit() else UNKNOWN


def _l3_list(cpu_dir: Path) -> CPUSet | None:
    cache = cpu_dir / "cache"
    if not cache.is_dir():
        return None
    for index in sorted(cache.glob("index*")):
        if (_read(index / "level") or "").strip() == "3":
            text = _read(index / "shared_cpu_list")
            if text is not None:
                return CPUSet.parse(text)
    return None


def refresh(sysfs_root: str | Path, previous: Topology) -> Topology:
    """The topology after a hotplug event, reading little: when the same CPUs exist and every CPU
    that came online reports the same package and core siblings as before, the previous topology
    with the new online and isolated sets; otherwise a full discover()."""
    base = Path(sysfs_root) / "devices/system/cpu"
    ids = {int(m.group(1)) for p in base.glob("cpu*") if (m := _CPU_DIR.match(p.name))}
    online_text = _read(base / "online")
    if ids != previous.cpus.keys() or online_text is None:
        return discover(sysfs_root, previous)
    online = CPUSet.parse(online_text)
    for cpu in online - previous.online:
        info = previous.cpus[cpu]
        topo = base / f"cpu{cpu}/topology"
        siblings = CPUSet.parse(_read(topo / "thread_siblings_list") or "")
        core = CPUSet(c for c, i in previous.cpus.items() if i.core == info.core)
        if _read_int(topo / "physical_package_id") != info.socket or not siblings <= core:
            return discover(sysfs_root, previous)
    isolated = CPUSet.parse(_read(base / "isolated") or "")
    return Topology(previous.with_online(online).cpus, isolated)


def discover(sysfs_root: str | Path = "/sys", previous: Topology | None = None) -> Topology:
    """Read the topology under ``sysfs_root``.

    Offline CPUs have no topology files; their placement is taken from ``previous`` when given,
    else left UNKNOWN. Physical cores are keyed by (package, die, core_id).
    """
    base = Path(sysfs_root) / "devices/system/cpu"
    ids = sorted(int(m.group(1)) for p in base.glob("cpu*") if (m := _CPU_DIR.match(p.name)))
    if not ids:
        raise TopologyError(f"no CPUs under {base}")
    online_text = _read(base / "online")
    if online_text is not None:
        online = CPUSet.parse(online_text)
    else:
        online = CPUSet(c for c in ids if (_read(base / f"cpu{c}/online") or "1").strip() == "1")
    isolated = CPUSet.parse(_read(base / "isolated") or "")

    node_of: dict[int, int] = {}
    for node_dir in (Path(sysfs_root) / "devices/system/node").glob("node*"):
        if m := _NODE_DIR.match(node_dir.name):
            for c in CPUSet.parse(_read(node_dir / "cpulist") or ""):
                node_of[c] = int(m.group(1))
    default_node = 0 if not node_of else UNKNOWN

    fresh: dict[int, tuple[object, object, int, int, int]] = {}
    for c in ids:
        topo_dir = base / f"cpu{c}/topology"
        if topo_dir.is_dir():
            socket = _read_int(topo_dir / "physical_package_id")
            die = max(_read_int(topo_dir / "die_id"), 0)
            l3 = _l3_list(base / f"cpu{c}")
            l3_key = ("l3", l3.first()) if l3 else ("socket", socket, die)
            core_key = (socket, die, _read_int(topo_dir / "core_id"))
            fresh[c] = (core_key, l3_key, socket, die, node_of.get(c, default_node))

    raw = dict(fresh)
    for c in ids:
        if c in raw:
            continue
        known = previous.cpus.get(c) if previous else None
        if previous is None or known is None:
            raw[c] = (("unknown", c), ("unknown", c), UNKNOWN, UNKNOWN,
                      node_of.get(c, default_node))
            continue
        raw[c] = (_peer_key(previous, fresh, c, "core", 0), _peer_key(previous, fresh, c, "l3", 1),
                  known.socket, known.die, known.node)

    core_index = _dense({c: r[0] for c, r in raw.items()})
    l3_index = _dense({c: r[1] for c, r in raw.items()})
    cpus = {
        c: CPU(c, core_index[c], r[2], r[3], r[4], l3_index[c], c in online)
        for c, r in sorted(raw.items())
    }
    return Topology(cpus, isolated)


def _peer_key(
    previous: Topology, fresh: Mapping[int, tuple[object, ...]], cpu: int, attr: str, slot: int
) -> object:
    """Key of the group an unreadable CPU belonged to, found through its former peers."""
    group = getattr(previous.cpus[cpu], attr)
    for peer, info in previous.cpus.items():
        if getattr(info, attr) == group and peer in fresh:
            return fresh[peer][slot]
    return ("previous", attr, group)


def _dense(keys: Mapping[int, object]) -> dict[int, int]:
    """Number groups of equal keys 0.. in the order of their smallest CPU."""
    first: dict[object, int] = {}
    for c in sorted(keys):
        first.setdefault(keys[c], len(first))
    return {c: first[k] for c, k in keys.items()}
