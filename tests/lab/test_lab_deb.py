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


def lintian_findings(debs: list[Path]) -> list[str]:
    """lintian's errors and warnings on the package (scripts/build-deb.sh's log)."""
    log = (debs[0].parent / "lintian.log").read_text().splitlines()
    return [line for line in log if line.startswith(("E:", "W:"))]


def test_lintian_has_no_errors_or_unexplained_warnings(debs: list[Path]) -> None:
    assert not lintian_findings(debs)


def check_install(s: dict[str, str]) -> None:
    """Installed without a warning, started, and its allocation enforced by the kernel."""
    assert s["install"] == "0" and s["warnings:"] == "", s
    assert s["active"] == "active" and s["introspect"] == "0", s
    cpuset = s["cpuset"].split('"')[1]
    assert cpuset and s["process"] == cpuset


def check_upgrade(before: dict[str, str], after: dict[str, str]) -> None:
    """Upgraded with the allocation live: restarted, its CPUs kept."""
    assert after["upgrade"] == "0" and after["version"] == "0.1.1", after
    assert after["warnings:"] == "", after
    assert after["active"] == "active" and after["restarted"] == "yes"
    assert after["cpuset"] == before["cpuset"] and after["process"] == before["process"]


def check_remove(s: dict[str, str]) -> None:
    assert s["remove"] == "0" and s["warnings:"] == "", s
    assert s["active"] != "active" and s.get("units", "") == ""
    assert s["process"] == "gone"


def check_purge(s: dict[str, str]) -> None:
    """Nothing left, and no warning (Debian 13 warned that /lib/systemd/system was not empty
    while the units were installed there)."""
    assert s["purge"] == "0" and s["warnings:"] == "", s
    assert s.get("left:", "") == ""


@pytest.fixture(scope="module")
def lifecycle(debs: list[Path], main_boot: lab.Run) -> dict[str, dict[str, str]]:
    assert [d.name for d in debs] == ["cpuservice_0.1.0_all.deb", "cpuservice_0.1.1_all.deb"]
    result = main_boot.results["deb"]
    assert result.status == 0, result.output
    return sections(result.output)


def test_install_starts_an_enforcing_service(lifecycle: dict[str, dict[str, str]]) -> None:
    check_install(lifecycle["install"])


def test_upgrade_keeps_allocations_and_cpus(lifecycle: dict[str, dict[str, str]]) -> None:
    check_upgrade(lifecycle["install"], lifecycle["upgrade"])


def test_remove_stops_service_and_units(lifecycle: dict[str, dict[str, str]]) -> None:
    check_remove(lifecycle["remove"])


def test_purge_leaves_nothing(lifecycle: dict[str, dict[str, str]]) -> None:
    check_purge(lifecycle["purge"])
