"""Movable allocations on a real kernel (VM lab, cgroup v2): a moved allocation's process runs on
its new CPUs only, with its memory nodes following (tests/lab/scenarios/moves.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.envs import lab


@pytest.fixture(scope="module")
def checks(main_boot: lab.Run) -> dict[str, dict[str, Any]]:
    out = main_boot.results["moves"]
    assert out.status == 0, out.output
    return out.checks()


def _follow(where: dict[str, dict[str, Any]]) -> None:
    """Every allocation's process runs where the daemon says, as its slice's cgroup does."""
    for name, w in where.items():
        assert w["process"] == w["held"] == w["unit"] == w["cgroup"], (name, w)
        assert w["mems"] == w["nodes"], (name, w)  # memory-nodes: memory follows the CPUs


def test_a_full_pcpus_request_is_placed_after_a_move(checks: dict[str, dict[str, Any]]) -> None:
    r = checks["repack"]
    assert r["big_is_a_core"], r
    assert len(r["moved"]) >= 1, r
    _follow(r["before"])
    _follow(r["after"])
    for name, old, new in r["moved"]:
        assert r["before"][name]["held"] != r["after"][name]["held"]
        assert old != new and not set(r["big"]) & set(r["after"][name]["held"])


def test_defragment_moves_processes_with_their_allocations(
        checks: dict[str, dict[str, Any]]) -> None:
    d = checks["defragment"]
    assert d["plan"] == d["done"], d
    assert len(d["moved"]) == len(d["done"]), d
    _follow(d["after"])
