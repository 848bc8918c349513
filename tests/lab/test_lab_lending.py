"""Lending idle exclusive CPUs on a real kernel (VM lab, cgroup v2, issue 26): a borrower runs on
the cores an idle owner lends and never on one once it is withdrawn, nor on the CPUs of the
owner's successor (tests/lab/scenarios/lending.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.envs import lab


@pytest.fixture(scope="module")
def checks(main_boot: lab.Run) -> dict[str, dict[str, Any]]:
    out = main_boot.results["lending"]
    assert out.status == 0, out.output
    return out.checks()


def test_an_idle_owner_lends_its_cores(checks: dict[str, dict[str, Any]]) -> None:
    lent = checks["lent"]
    cpus = set(lent["cpus"])
    assert len(cpus) == 4, lent
    assert cpus <= set(lent["borrow_slice"]) and cpus <= set(lent["borrower_cgroup"]), lent
    assert lent["ran_on_lent"], lent  # the borrower's stress-ng ran there


def test_a_borrower_never_runs_on_a_withdrawn_core(checks: dict[str, dict[str, Any]]) -> None:
    w = checks["withdrawn"]
    assert w["lent"] == [], w
    assert w["after"] == [], w  # Cpus_allowed_list, cpuset.cpus.effective, last CPU
    assert w["ms"] < 5000, w
    assert checks["lent-again"]["seconds"] < 30


def test_a_released_owners_successor_is_not_lent_out(checks: dict[str, dict[str, Any]]
                                                      ) -> None:
    n = checks["new-owner"]
    assert n["after"] == [], n
    assert not set(checks["lent"]["cpus"]) & set(n["borrow_slice"]), n
