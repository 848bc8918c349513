"""Generate sysfs trees of imaginary machines, for tests, benchmarks, the planner and demos.

The named machines are the ones the test-suite and the docs talk about:
``a`` 1 socket x 8 cores; ``b`` 2 sockets x 4 cores x 2 threads, 2 NUMA nodes, siblings N and N+8;
``c`` 2 x 32 x 2, 4 NUMA nodes, L3 per 8 cores, siblings N and N+64 (EPYC-like);
``d`` offline CPUs, non-contiguous ids and isolated CPUs; ``e`` 1,024 logical CPUs;
``lab`` the VM lab's 2 x 2 x 2 with adjacent siblings.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .cpuset import CPUSet


@dataclass(frozen=True)
class Machine:
    """Shape of an imaginary machine.

    ``sibling_stride``: siblings are numbered N and N + stride (``None``: adjacent, 2N and 2N+1).
    ``ids``: optional renumbering of logical CPUs 0..n-1 (for non-contiguous ids).
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

    @property
    def logical(self) -> int:
        return self.sockets * self.cores_per_socket * self.threads

    def layout(self) -> list[tuple[int, int, int, int, int]]:
        """(cpu id, socket, core_id, node, l3 group) for every logical CPU."""
        cores = self.sockets * self.cores_per_socket
        cores_per_node = cores // self.nodes
        l3_cores = self.l3_cores or self.cores_per_socket
        rows = []
        for core in range(cores):
            socket = core // self.cores_per_socket
            for t in range(self.threads):
                n = core * self.threads + t if self.adjacent_siblings else t * cores + core
                cpu = self.ids[n] if self.ids else n
                rows.append((cpu, socket, core % self.cores_per_socket, core // cores_per_node,
                             core // l3_cores))
        return sorted(rows)


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


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_sysfs(root: str | Path, machine: Machine | str) -> Path:
    """Write a sysfs tree for ``machine`` (or a name from MACHINES) under ``root``; writing again
    over an existing tree brings it in line (CPUs taken offline lose their topology files, as
    with the kernel)."""
    spec = MACHINES[machine] if isinstance(machine, str) else machine
    root = Path(root)
    base = root / "devices/system/cpu"
    rows = spec.layout()
    everything = CPUSet(r[0] for r in rows)
    online = everything - CPUSet(spec.offline)
    _write(base / "possible", everything.format())
    _write(base / "present", everything.format())
    _write(base / "online", online.format())
    _write(base / "offline", CPUSet(spec.offline).format())
    _write(base / "isolated", CPUSet(spec.isolated).format())

    def peers(match: int) -> str:
        return CPUSet(r[0] for r in rows if r[match] == mine[match] and r[0] in online).format()

    for mine in rows:
        cpu = mine[0]
        d = base / f"cpu{cpu}"
        d.mkdir(parents=True, exist_ok=True)
        if cpu != rows[0][0]:
            _write(d / "online", "1" if cpu in online else "0")
        link = d / f"node{mine[3]}"
        if not link.is_symlink():
            link.symlink_to(f"../../node/node{mine[3]}")  # kept while offline, as the kernel does
        if cpu not in online:
            for gone in ("topology", "cache"):
                shutil.rmtree(d / gone, ignore_errors=True)
            continue
        siblings = CPUSet(r[0] for r in rows if r[1:3] == mine[1:3] and r[0] in online).format()
        _write(d / "topology/physical_package_id", str(mine[1]))
        _write(d / "topology/die_id", "0")
        _write(d / "topology/core_id", str(mine[2]))
        _write(d / "topology/thread_siblings_list", siblings)
        _write(d / "topology/core_cpus_list", siblings)
        for index, level, kind, shared in (
            (0, 1, "Data", siblings), (1, 1, "Instruction", siblings),
            (2, 2, "Unified", siblings), (3, 3, "Unified", peers(4)),
        ):
            _write(d / f"cache/index{index}/level", str(level))
            _write(d / f"cache/index{index}/type", kind)
            _write(d / f"cache/index{index}/shared_cpu_list", shared)
    for node in sorted({r[3] for r in rows}):
        cpus = CPUSet(r[0] for r in rows if r[3] == node and r[0] in online)
        _write(root / f"devices/system/node/node{node}/cpulist", cpus.format())
    return root
