"""Lending on the command line (issue 26): cpuservicectl lend NAME on|off, the lent cores in
cpuservicectl topology, the borrowers in its legend."""

from __future__ import annotations

import json

import pytest

from cpuservice.cli.ctl import WRITES, parse
from cpuservice.cli.topoview import LENT, POOL_PROPERTIES, Pools, Style, render
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixtures import MACHINES

B = MACHINES["b"].topology()  # CPU n and n+8 are siblings


def test_lend_parses_on_and_off() -> None:
    assert (parse(["lend", "db", "on"]).value, parse(["lend", "db", "off"]).name) == ("on", "db")
    assert "lend" in WRITES  # a write: polkit's agent is started for it
    with pytest.raises(SystemExit):
        parse(["lend", "db", "maybe"])


def test_lent_cores_are_marked_in_the_topology() -> None:
    owner = {"Name": "db", "Bound": True, "CPUs": "4", "Unit": "cpuservice-bound-db.slice",
             "Shares": {c: 100 for c in (0, 1, 8, 9)}, "LentCPUs": "0,8"}
    borrower = {"Name": "batch", "Bound": False, "CPUs": "2", "Shares": {},
                "Unit": "cpuservice-borrow-batch.slice"}
    shared = B.online - CPUSet.parse("0-1,8-9")
    pools = Pools(B.online, CPUSet(), CPUSet(), shared, CPUSet.parse("0,8"))
    text = render(json.loads(B.to_json()), pools, [owner, borrower])
    assert "Core 0: cpu0 db lent  cpu8 db lent" in text
    assert "Core 1: cpu1 db  cpu9 db" in text
    assert LENT in text
    assert "db     4 CPU(s) bound: 0-1,8-9, lends 0,8" in text
    assert "batch  2 CPU(s) unbound, on the shared pool and lent cores (borrows)" in text
    compact = render(json.loads(B.to_json()), pools, [owner, borrower], style=Style(compact=True))
    assert "Core 0: cpu0 db lent" in compact and "Core 1: cpu1 db" in compact  # not one run
    unlent = render(json.loads(B.to_json()), Pools(B.online, CPUSet(), CPUSet(), shared),
                    [owner])
    assert " lent" not in unlent.split("Legend")[0] and LENT not in unlent
    assert POOL_PROPERTIES[-1] == "LentCPUs"


@pytest.mark.parametrize("line,want", [("cpuservicectl le", "lend"),
                                       ("cpuservicectl lend db ", "off"),
                                       ("cpuservicectl allocate x 2 --bind --le", "--lend"),
                                       ("cpuservicectl allocate x 2 --bor", "--borrow"),
                                       ("cpuservicectl show x -p Lent", "LentCPUs")])
def test_completion_offers_lending(line: str, want: str) -> None:
    from tests.unit.test_docs import test_completion_completes
    test_completion_completes(line, want)
