"""The terminal topology picture on fixtures (a) and (c), compared with expected output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cpuservice import placement
from cpuservice.cpuset import CPUSet
from cpuservice.pools import Ledger
from cpuservice.request import Request
from cpuservice.topoview import Pools, render

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
        {"Name": a.name, "Bound": a.bound,
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


def test_offline_and_isolated(machine) -> None:
    t = machine("d")
    ledger = Ledger(t.online, isolated=t.isolated & t.online)
    pools = Pools(ledger.online, ledger.reserved, ledger.isolated, ledger.shared)
    text = render(json.loads(t.to_json()), pools, [])
    assert "cpu20 isolated" in text
    assert "cpu2 shared  " not in text  # cpu3 was never seen online: a core of its own
    assert "cpu3 offline (place inferred)" in text and "cpu17 offline (place inferred)" in text
