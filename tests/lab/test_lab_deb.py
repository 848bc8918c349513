"""The Debian package on a fresh VM image with distro packages only (no pip): install, an enforced
bound allocation, upgrade with allocations live, remove, purge."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.envs import lab


def sections(output: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    key = "install"
    for line in output.splitlines():
        if line.startswith("== "):
            key = line[3:]
        elif " " in line or line.endswith(":"):
            k, _, v = line.partition(" ")
            out.setdefault(key, {})[k] = v.strip()
    return out


def test_lintian_has_no_errors_or_unexplained_warnings(debs: list[Path]) -> None:
    log = (debs[0].parent / "lintian.log").read_text().splitlines()
    assert not [line for line in log if line.startswith(("E:", "W:"))], log


@pytest.fixture(scope="module")
def lifecycle(debs: list[Path], main_boot: lab.Run) -> dict[str, dict[str, str]]:
    assert [d.name for d in debs] == ["cpuservice_0.1.0_all.deb", "cpuservice_0.1.1_all.deb"]
    result = main_boot.results["deb"]
    assert result.status == 0, result.output
    return sections(result.output)


def test_install_starts_an_enforcing_service(lifecycle: dict[str, dict[str, str]]) -> None:
    s = lifecycle["install"]
    assert s["install"] == "0" and s["active"] == "active" and s["introspect"] == "0"
    cpuset = s["cpuset"].split('"')[1]
    assert cpuset and s["process"] == cpuset


def test_upgrade_keeps_allocations_and_cpus(lifecycle: dict[str, dict[str, str]]) -> None:
    before, after = lifecycle["install"], lifecycle["upgrade"]
    assert after["upgrade"] == "0" and after["version"] == "0.1.1"
    assert after["active"] == "active" and after["restarted"] == "yes"
    assert after["cpuset"] == before["cpuset"] and after["process"] == before["process"]


def test_remove_stops_service_and_units(lifecycle: dict[str, dict[str, str]]) -> None:
    s = lifecycle["remove"]
    assert s["remove"] == "0" and s["active"] != "active" and s.get("units", "") == ""
    assert s["process"] == "gone"


def test_purge_leaves_nothing(lifecycle: dict[str, dict[str, str]]) -> None:
    s = lifecycle["purge"]
    assert s["purge"] == "0" and s.get("left:", "") == ""
