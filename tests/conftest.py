"""Shared test helpers: fixture machines and the CI rule that a skipped tier is a failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cpuservice.model.fixtures import MACHINES, SHAPES
from cpuservice.model.topology import Topology
from tests import props  # noqa: F401  (loads the hypothesis profile before any test module)


def unavailable(reason: str) -> None:
    """Skip a tier that cannot run here; under CI=true that is a failure instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"tier cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def sysfs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sysfs")


@pytest.fixture(scope="session")
def machine(sysfs_dir: Path):  # type: ignore[no-untyped-def]
    """machine("b") -> the Topology of fixture machine b (or of a shape in SHAPES), built in
    memory (tests/unit/test_discovery.py checks that discovery on its written tree agrees)."""
    cache: dict[str, Topology] = {}

    def get(name: str) -> Topology:
        if name not in cache:
            cache[name] = {**MACHINES, **SHAPES}[name].topology()
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _state_files_in_pytests_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests keep their state files in pytest's tmp_path, under /tmp, which the daemon's
    configuration refuses (cpuservice.model.config.VOLATILE_DIRS; tests/unit/test_config.py checks
    that rule with its own list)."""
    from cpuservice.model import config

    monkeypatch.setattr(config, "VOLATILE_DIRS", ())
