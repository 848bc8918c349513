"""The machine as a tree, the way lstopo draws it, for the terminal: sockets > NUMA nodes >
L3 groups > cores > threads, each CPU marked with what it is doing. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .cpuset import CPUSet

COLOURS = {"shared": "32", "reserved": "33", "isolated": "33", "offline": "2", "fragment": "35",
           "owned": "34"}


@dataclass(frozen=True)
class Pools:
    online: CPUSet
    reserved: CPUSet
    isolated: CPUSet
    shared: CPUSet


def cpu_states(
    pools: Pools, allocations: Iterable[Mapping[str, Any]], granularity: int
) -> dict[int, tuple[str, str]]:
    """cpu -> (kind, label) for every CPU some pool or allocation names."""
    owners: dict[int, str] = {}
    pieces: dict[int, list[str]] = {}
    for a in allocations:
        if not a["Bound"]:
            continue
        for cpu, count in a["Shares"].items():
            if count >= granularity:
                owners[int(cpu)] = a["Name"]
            else:
                pieces.setdefault(int(cpu), []).append(f"{a['Name']}:{count}")
    states: dict[int, tuple[str, str]] = {}
    for cpu in pools.online:
        if cpu in owners:
            states[cpu] = ("owned", owners[cpu])
        elif cpu in pieces:
            states[cpu] = ("fragment", "frag(" + ",".join(sorted(pieces[cpu])) + ")")
        elif cpu in pools.reserved:
            states[cpu] = ("reserved", "reserved")
        elif cpu in pools.shared:
            states[cpu] = ("shared", "shared")
        elif cpu in pools.isolated:
            states[cpu] = ("isolated", "isolated")
        else:
            states[cpu] = ("shared", "?")
    return states


def render(
    topology: Sequence[Mapping[str, Any]],
    pools: Pools,
    allocations: Iterable[Mapping[str, Any]],
    granularity: int = 100,
    colour: bool = False,
) -> str:
    """The tree, one line per group and one per core with its threads."""
    states = cpu_states(pools, allocations, granularity)

    inferred = {row["cpu"] for row in topology if row.get("inferred")}

    def mark(cpu: int) -> str:
        kind, label = states.get(cpu, ("offline", "offline"))
        text = f"cpu{cpu} {label}" + (" (place inferred)" if cpu in inferred else "")
        return f"\033[{COLOURS[kind]}m{text}\033[0m" if colour else text

    known = list(topology)
    sockets = sorted({row["socket"] for row in known})
    nodes = {row["node"] for row in known}
    l3s = {row["l3"] for row in known}
    cores: dict[int, list[int]] = {}
    for row in known:
        cores.setdefault(row["core"], []).append(row["cpu"])
    threads = max((len(c) for c in cores.values()), default=1)
    lines = [f"Machine: {len(topology)} CPUs, {len(sockets)} socket(s), {len(nodes)} NUMA "
             f"node(s), {len(l3s)} L3 group(s), {threads} thread(s) per core"]

    def tree(prefix: str, items: list[Any], draw: Any) -> None:
        for i, item in enumerate(items):
            last = i == len(items) - 1
            draw(item, prefix + ("└─ " if last else "├─ "), prefix + ("   " if last else "│  "))

    def core_line(core: int, head: str, _: str) -> None:
        cpus = sorted(cores[core])
        lines.append(f"{head}Core {core}: " + "  ".join(mark(c) for c in cpus))

    def l3_line(key: tuple[int, int, int], head: str, indent: str) -> None:
        members = sorted({r["core"] for r in known if (r["socket"], r["node"], r["l3"]) == key},
                         key=lambda k: min(cores[k]))
        cpus = CPUSet(r["cpu"] for r in known if (r["socket"], r["node"], r["l3"]) == key)
        lines.append(f"{head}L3 {key[2]} ({cpus})")
        tree(indent, members, core_line)

    def node_line(key: tuple[int, int], head: str, indent: str) -> None:
        lines.append(f"{head}NUMA node {key[1]}")
        groups = sorted({(r["socket"], r["node"], r["l3"]) for r in known
                         if (r["socket"], r["node"]) == key})
        tree(indent, groups, l3_line)

    def socket_line(socket: int, head: str, indent: str) -> None:
        lines.append(f"{head}Socket {socket}")
        tree(indent, sorted({(socket, r["node"]) for r in known if r["socket"] == socket}),
             node_line)

    tree("", sockets, socket_line)
    return "\n".join(lines)
