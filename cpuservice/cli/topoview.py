"""The machine as a tree, the way lstopo draws it, for the terminal: sockets > NUMA nodes >
L3 groups > cores > threads, each CPU marked with what it is doing, a legend, the allocations
that hold no CPU of their own, and the topology's notes. Pure: ``cpuservicectl topology``
draws it from the service's properties, ``python -m cpuservice.cli.plan --draw`` from the planner.

An L3 group that spans several NUMA nodes (sub-NUMA clustering) is drawn once, above its
nodes. ``compact`` collapses runs of cores whose threads are all in the same state; ``nodes``
draws only those NUMA nodes; without ``unicode`` the tree is drawn in ASCII."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cpuservice.model.cpuset import EMPTY, CPUSet

# one colour per kind; allocations take theirs from PALETTE in name order
COLOURS = {"shared": "32", "reserved": "33", "isolated": "36", "offline": "2",
           "fragment": "35"}
PALETTE = ("1;34", "1;31", "1;36", "1;33", "1;35", "34", "31", "94", "91", "96", "95", "93")
KINDS = {
    "shared": "the shared pool",
    "reserved": "shared, never allocated (reserved_cpus)",
    "isolated": "kernel isolcpus: bound allocations only",
    "offline": "not online now (hotplug)",
    "fragment": "one CPU split between bound allocations (NAME:PIECES)",
}
LENT = "lent = an idle whole core its owner lends to borrowers now (option lend)"


@dataclass(frozen=True)
class Pools:
    online: CPUSet
    reserved: CPUSet
    isolated: CPUSet
    shared: CPUSet
    lent: CPUSet = EMPTY  # owned CPUs lent to borrowers now (marked, same colour)


# the Manager's properties Pools is made of, in its order
POOL_PROPERTIES = ("OnlineCPUs", "ReservedCPUs", "IsolatedCPUs", "SharedCPUs", "LentCPUs")


@dataclass(frozen=True)
class Style:
    unicode: bool = True
    compact: bool = False
    nodes: frozenset[int] = field(default_factory=frozenset)  # empty: all


def cpu_states(
    pools: Pools, allocations: Iterable[Mapping[str, Any]], granularity: int
) -> dict[int, tuple[str, str]]:
    """cpu -> (kind, label) for every online CPU; kind is a key of COLOURS or ``owned``."""
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


def rows_and_notes(topology: Any) -> tuple[list[Mapping[str, Any]], dict[int, str]]:
    """The per-CPU rows of the Topology property and its notes (cpu -> text): the property is
    a list of rows, each may carry a ``note``, or an object with ``cpus`` and ``notes``."""
    if isinstance(topology, Mapping):
        rows = list(topology.get("cpus", []))
        notes = {int(k): str(v) for k, v in (topology.get("notes") or {}).items()}
    else:
        rows, notes = list(topology), {}
    for row in rows:
        if row.get("note"):
            notes.setdefault(int(row["cpu"]), str(row["note"]))
    return rows, notes


class Tree:
    """Lines with tree branches in Unicode or ASCII."""

    def __init__(self, unicode: bool) -> None:
        self.lines: list[str] = []
        self.branch = ("├─ ", "└─ ", "│  ", "   ") if unicode else ("|- ", "`- ", "|  ", "   ")

    def children(self, prefix: str, items: Sequence[Any],
                 draw: Callable[[Any, str, str], None]) -> None:
        for i, item in enumerate(items):
            last = i == len(items) - 1
            draw(item, prefix + self.branch[1 if last else 0],
                 prefix + self.branch[3 if last else 2])


def render(
    topology: Any,
    pools: Pools,
    allocations: Iterable[Mapping[str, Any]],
    granularity: int = 100,
    colour: bool = False,
    style: Style = Style(),
    devices: Sequence[Sequence[Any]] = (),
) -> str:
    """The tree, one line per group and one per core (or run of cores) with its threads, then
    the legend, the unbound allocations and the notes. ``devices``: (name, node, kind, PCI
    address) of the devices option near can name (near_devices), each shown at its node."""
    allocations = sorted(allocations, key=lambda a: str(a["Name"]))
    states = cpu_states(pools, allocations, granularity)
    rows, notes = rows_and_notes(topology)
    inferred = {int(r["cpu"]) for r in rows if r.get("inferred")}
    palette = {a["Name"]: PALETTE[i % len(PALETTE)] for i, a in enumerate(allocations)}

    def paint(kind: str, label: str, text: str) -> str:
        if not colour:
            return text
        code = palette.get(label, "1") if kind == "owned" else COLOURS[kind]
        return f"\033[{code}m{text}\033[0m"

    def state(cpu: int) -> tuple[str, str]:
        return states.get(cpu, ("offline", "offline"))

    def lent(cpu: int) -> str:
        return " lent" if cpu in pools.lent and state(cpu)[0] == "owned" else ""

    def mark(cpu: int) -> str:
        kind, label = state(cpu)
        extra = " (place inferred)" if cpu in inferred else ""
        return paint(kind, label, f"cpu{cpu} {label}{lent(cpu)}{extra}")

    sockets = sorted({r["socket"] for r in rows})
    nodes = {r["node"] for r in rows}
    l3s = {(r["socket"], r["l3"]) for r in rows}
    cores: dict[int, list[int]] = {}
    for r in rows:
        cores.setdefault(r["core"], []).append(r["cpu"])
    threads = max((len(c) for c in cores.values()), default=1)
    tree = Tree(style.unicode)
    lines = tree.lines
    lines.append(f"Machine: {len(rows)} CPUs, {len(sockets)} socket(s), {len(nodes)} NUMA "
                 f"node(s), {len(l3s)} L3 group(s), {threads} thread(s) per core")
    shown = [r for r in rows if not style.nodes or r["node"] in style.nodes]
    if style.nodes:
        lines.append(f"(NUMA node(s) {CPUSet(style.nodes)} only)")

    def core_runs(members: list[int]) -> list[list[int]]:
        """Consecutive cores with the same states per thread, when compact."""
        runs: list[list[int]] = []
        for core in members:
            sig = [(state(c), lent(c)) for c in sorted(cores[core])]
            if style.compact and runs and sig == [(state(c), lent(c))
                                                  for c in sorted(cores[runs[-1][0]])] \
                    and not inferred & set(cores[core]):
                runs[-1].append(core)
            else:
                runs.append([core])
        return runs

    def core_line(run: list[int], head: str, _: str) -> None:
        if len(run) == 1:
            lines.append(f"{head}Core {run[0]}: "
                         + "  ".join(mark(c) for c in sorted(cores[run[0]])))
            return
        per_thread = list(zip(*(sorted(cores[k]) for k in run), strict=True))
        parts = []
        for cpus in per_thread:
            kind, label = state(cpus[0])
            parts.append(paint(kind, label, f"cpu{CPUSet(cpus)} {label}{lent(cpus[0])}"))
        lines.append(f"{head}Cores {run[0]}-{run[-1]} ({len(run)}): " + "  ".join(parts))

    def cores_of(members: Iterable[Mapping[str, Any]]) -> list[list[int]]:
        ordered = sorted({r["core"] for r in members}, key=lambda k: min(cores[k]))
        return core_runs(ordered)

    def cpus_of(members: Iterable[Mapping[str, Any]]) -> CPUSet:
        return CPUSet(r["cpu"] for r in members)

    def l3_line(key: tuple[int, int], head: str, indent: str) -> None:
        members = [r for r in shown if (r["socket"], r["l3"]) == key]
        lines.append(f"{head}L3 {key[1]} ({cpus_of(members)})")
        tree.children(indent, cores_of(members), core_line)

    def node_line(key: tuple[int, int, int | None], head: str, indent: str) -> None:
        socket, node, within = key
        members = [r for r in shown if r["socket"] == socket and r["node"] == node
                   and (within is None or r["l3"] == within)]
        here = " ".join(str(d[0]) for d in devices if d[1] == node)
        lines.append(f"{head}NUMA node {node}" + (f" ({cpus_of(members)})"
                                                  if within is not None else "")
                     + (f"  devices: {here}" if here else ""))
        if within is not None:  # under an L3 that spans nodes: cores directly
            tree.children(indent, cores_of(members), core_line)
        else:
            tree.children(indent, sorted({(socket, r["l3"]) for r in members}), l3_line)

    def spanning_l3_line(key: tuple[int, int], head: str, indent: str) -> None:
        members = [r for r in shown if (r["socket"], r["l3"]) == key]
        node_ids = sorted({r["node"] for r in members})
        lines.append(f"{head}L3 {key[1]} ({cpus_of(members)}), spans NUMA nodes "
                     f"{CPUSet(node_ids)}")
        tree.children(indent, [(key[0], n, key[1]) for n in node_ids], node_line)

    def socket_line(socket: int, head: str, indent: str) -> None:
        lines.append(f"{head}Socket {socket}")
        members = [r for r in shown if r["socket"] == socket]
        spans = {l3 for l3 in {r["l3"] for r in members}
                 if len({r["node"] for r in members if r["l3"] == l3}) > 1}
        items: list[tuple[int, Any]] = []  # (first cpu, item) to keep the machine's order
        for l3 in spans:
            group = [r for r in members if r["l3"] == l3]
            items.append((min(r["cpu"] for r in group), ("l3", (socket, l3))))
        for node in sorted({r["node"] for r in members if r["l3"] not in spans}):
            group = [r for r in members if r["node"] == node and r["l3"] not in spans]
            items.append((min(r["cpu"] for r in group), ("node", (socket, node, None))))

        def draw(item: tuple[str, Any], head: str, indent: str) -> None:
            (spanning_l3_line if item[0] == "l3" else node_line)(item[1], head, indent)

        tree.children(indent, [item for _, item in sorted(items)], draw)

    tree.children("", sorted({r["socket"] for r in shown}), socket_line)
    elsewhere = [f"{d[0]} ({d[2]} {d[3]})" for d in devices if d[1] not in nodes]
    if elsewhere and not style.nodes:
        lines.append(f"Devices without NUMA locality here: {', '.join(elsewhere)}")
    lines += legend({state(int(r["cpu"]))[0] for r in shown}, allocations, paint,
                    any(lent(int(r["cpu"])) for r in shown))
    warnings = list(topology.get("warnings") or ()) if isinstance(topology, Mapping) else []
    if notes or warnings:
        lines.append("Notes:")
        lines += [f"  cpu{cpu}: {text}" for cpu, text in sorted(notes.items())]
        lines += [f"  {text}" for text in warnings]
    return "\n".join(lines)


def near_devices(props: Mapping[str, Any]) -> list[Sequence[Any]]:
    """The devices option near can name, from the Manager's Capabilities (NearDevices; none
    from a daemon before issue 38)."""
    return list((props.get("Capabilities") or {}).get("NearDevices") or ())


def legend(
    kinds: set[str],
    allocations: Sequence[Mapping[str, Any]],
    paint: Callable[[str, str, str], str],
    lent: bool = False,
) -> list[str]:
    """The marks in use and every allocation, the unbound ones with where they run."""
    marks = [f"{paint(k, k, k)} = {text}" for k, text in KINDS.items() if k in kinds]
    marks += [LENT] if lent else []
    lines = ["Legend: " + "; ".join(marks)] if marks else []
    if allocations:
        lines.append("Allocations:")
    width = max((len(str(a["Name"])) for a in allocations), default=0)
    for a in allocations:
        name = paint("owned", a["Name"], str(a["Name"]).ljust(width))
        cpus = a.get("CPUs")
        amount = f"{cpus} CPU(s) " if cpus is not None else ""
        if a["Bound"]:
            held = CPUSet(int(c) for c in a["Shares"])
            lends = f", lends {a['LentCPUs']}" if a.get("LentCPUs") else ""
            lines.append(f"  {name}  {amount}bound: {held or '-'}{lends}")
        else:
            borrows = str(a.get("Unit", "")).startswith("cpuservice-borrow-")
            where = "the shared pool and lent cores (borrows)" if borrows else "the shared pool"
            lines.append(f"  {name}  {amount}unbound, on {where}")
    return lines


def draw_ledger(topology: Any, ledger: Any, colour: bool = False, style: Style = Style()) -> str:
    """The same drawing from the planner's pure state (``python -m cpuservice.cli.plan --draw``):
    a Topology and a Ledger instead of the service's properties."""
    from cpuservice import placement  # the daemon's client side never needs the placement engine

    allocations = [{"Name": a.name, "Bound": a.bound, "CPUs": str(a.request.cpus),
                    "Shares": dict(placement.describe(topology, ledger, a).shares)}
                   for a in ledger.allocations.values()]
    pools = Pools(ledger.online, ledger.reserved, ledger.isolated, ledger.shared)
    return render(json.loads(topology.to_json()), pools, allocations, ledger.granularity,
                  colour, style)
