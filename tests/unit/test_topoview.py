"""The terminal topology picture on fixtures (a) and (c), compared with expected output."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from cpuservice import placement
from cpuservice.cli.topoview import Pools, Style, render
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import Ledger
from cpuservice.model.request import Request

GOLDEN = Path(__file__).parent / "golden"
SCENES = {
    "a": ("", [("web", "2", True), ("db", "1.2", True), ("batch", "0.5", True), ("u", "1", False)]),
    "c": ("0", [("big", "16", True), ("pair", "2", True), ("frag", "0.3", True),
                ("frag2", "1.45", True)]),
}


def picture(machine, name: str) -> str:  # type: ignore[no-untyped-def]
    t = machine(name)
    reserved, steps = SCENES[name]
    ledger = Ledger(t.online, CPUSet.parse(reserved), t.isolated & t.online)
    for alloc_name, cpus, bind in steps:
        ledger, _ = placement.allocate(t, ledger, alloc_name, Request.parse(cpus, {"bind": bind}))
    allocations = [
        {"Name": a.name, "Bound": a.bound, "CPUs": str(a.request.cpus),
         "Shares": dict(placement.describe(t, ledger, a).shares)}
        for a in ledger.allocations.values()
    ]
    pools = Pools(ledger.online, ledger.reserved, ledger.isolated, ledger.shared)
    return render(json.loads(t.to_json()), pools, allocations) + "\n"


@pytest.mark.parametrize("name", ["a", "c"])
def test_topology_picture(machine, name: str) -> None:
    path = GOLDEN / f"topology-{name}.txt"
    got = picture(machine, name)
    if os.environ.get("CPUSERVICE_WRITE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text()


def test_colour_only_when_asked(machine) -> None:
    t = machine("a")
    pools = Pools(t.online, CPUSet(), CPUSet(), t.online)
    assert "\033[" not in render(json.loads(t.to_json()), pools, [])
    assert "\033[32mcpu0 shared\033[0m" in render(json.loads(t.to_json()), pools, [], colour=True)


def scene(machine, name: str):  # type: ignore[no-untyped-def]
    """(topology rows, pools, allocations) of SCENES[name], with the CPUs of each."""
    t = machine(name)
    reserved, steps = SCENES[name]
    ledger = Ledger(t.online, CPUSet.parse(reserved), t.isolated & t.online)
    for alloc_name, cpus, bind in steps:
        ledger, _ = placement.allocate(t, ledger, alloc_name, Request.parse(cpus, {"bind": bind}))
    allocations = [{"Name": a.name, "Bound": a.bound, "CPUs": str(a.request.cpus),
                    "Shares": dict(placement.describe(t, ledger, a).shares)}
                   for a in ledger.allocations.values()]
    return (json.loads(t.to_json()), Pools(ledger.online, ledger.reserved, ledger.isolated,
                                           ledger.shared), allocations)


def test_one_colour_per_allocation_and_a_legend(machine) -> None:
    rows, pools, allocations = scene(machine, "a")
    text = render(rows, pools, allocations, colour=True)
    colours = {name: text.split(f"m{name}")[0].rsplit("\033[", 1)[1]
               for name in ("batch", "db", "web")}
    assert len(set(colours.values())) == 3, colours
    assert "\033[1;34mcpu0 web" not in text or colours["web"] == "1;34"
    plain = render(rows, pools, allocations)
    assert "Legend: shared = the shared pool; fragment = " in plain
    assert "  u      1 CPU(s) unbound, on the shared pool" in plain  # unbound ones are listed
    assert "  web    2 CPU(s) bound: 0-1" in plain


def test_marks_differ_for_reserved_isolated_offline(machine) -> None:
    t = machine("d")
    ledger = Ledger(t.online, reserved=CPUSet.parse("0"), isolated=t.isolated & t.online)
    pools = Pools(ledger.online, ledger.reserved, ledger.isolated, ledger.shared)
    text = render(json.loads(t.to_json()), pools, [], colour=True)
    for kind, code in (("reserved", "33"), ("isolated", "36"), ("offline", "2")):
        assert re.search(rf"\033\[{code}mcpu\d+ {kind}", text), kind
    legend = render(json.loads(t.to_json()), pools, []).splitlines()
    line = next(x for x in legend if x.startswith("Legend:"))
    assert "reserved = " in line and "isolated = " in line and "offline = " in line


def test_compact_and_one_node(machine) -> None:
    rows, pools, allocations = scene(machine, "c")
    full = render(rows, pools, allocations)
    compact = render(rows, pools, allocations, style=Style(compact=True))
    assert len(compact.splitlines()) < len(full.splitlines()) // 2
    assert "Cores 8-15 (8): cpu8-15 big  cpu72-79 big" in compact
    one = render(rows, pools, allocations, style=Style(compact=True, nodes=frozenset({3})))
    assert "NUMA node 3" in one and "NUMA node 0" not in one and "Socket 0" not in one


def test_ascii_when_asked(machine) -> None:
    rows, pools, allocations = scene(machine, "a")
    text = render(rows, pools, allocations, style=Style(unicode=False))
    assert "`- Socket 0" in text and "|- Core 0" in text
    assert all(ch.isascii() for ch in text)


def test_an_l3_spanning_two_nodes_is_drawn_once() -> None:
    rows = [{"cpu": c, "core": c, "socket": 0, "die": 0, "node": c // 2, "l3": 0,
             "online": True} for c in range(4)]
    pools = Pools(CPUSet.parse("0-3"), CPUSet(), CPUSet(), CPUSet.parse("0-3"))
    text = render(rows, pools, [])
    assert text.count("L3 0") == 1 and "L3 0 (0-3), spans NUMA nodes 0-1" in text
    assert "NUMA node 0 (0-1)" in text and "NUMA node 1 (2-3)" in text
    assert text.index("L3 0") < text.index("NUMA node 0")


def test_the_topologys_notes_are_shown() -> None:
    rows = [{"cpu": 0, "core": 0, "socket": 0, "die": 0, "node": 0, "l3": 0, "online": True},
            {"cpu": 1, "core": 1, "socket": 0, "die": 0, "node": 0, "l3": 0, "online": False,
             "inferred": True}]
    pools = Pools(CPUSet.parse("0"), CPUSet(), CPUSet(), CPUSet.parse("0"))
    for topology in ({"cpus": rows, "notes": {"1": "never seen online; its node is a guess"}},
                     [rows[0], {**rows[1], "note": "never seen online; its node is a guess"}]):
        text = render(topology, pools, [])
        assert "Notes:\n  cpu1: never seen online; its node is a guess" in text
    document = {"cpus": rows, "notes": {}, "warnings": ["node 3 has memory and no CPUs"]}
    assert "Notes:\n  node 3 has memory and no CPUs" in render(document, pools, [])


def test_offline_and_isolated(machine) -> None:
    t = machine("d")
    ledger = Ledger(t.online, isolated=t.isolated & t.online)
    pools = Pools(ledger.online, ledger.reserved, ledger.isolated, ledger.shared)
    text = render(json.loads(t.to_json()), pools, [])
    assert "cpu20 isolated" in text
    assert "cpu2 shared  " not in text  # cpu3 was never seen online: a core of its own
    assert "cpu3 offline (place inferred)" in text and "cpu17 offline (place inferred)" in text


def test_the_planner_draws_the_same_picture(machine, capsys) -> None:  # type: ignore[no-untyped-def]
    from cpuservice.cli import plan

    steps = [f"{n}={c}" + (":bind" if b else "") for n, c, b in SCENES["a"][1]]
    assert plan.main(["--machine", "a", *steps, "--draw"]) == 0
    drawn = capsys.readouterr().out
    assert drawn.endswith((GOLDEN / "topology-a.txt").read_text().replace("└─", "`- ")
                          .replace("├─", "|- ").replace("│", "|")) or drawn.endswith(
        (GOLDEN / "topology-a.txt").read_text())
