"""The Debian package on a fresh VM image with distro packages only (no pip): install, an enforced
bound allocation, upgrade with allocations live, remove, purge."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unavailable
from tests.envs import lab
from tests.envs.lab import CHECKOUT

M = "org.cpuservice1 /org/cpuservice1 org.cpuservice1.Manager"
A = "org.cpuservice1 /org/cpuservice1/allocation/pkg org.cpuservice1.Allocation"
SCENARIO = f"""
F=/payload/files
dpkg -i $F/cpuservice_0.1.0_all.deb >/dev/null 2>&1; echo "install $?"
echo "active $(systemctl is-active cpuservice)"
busctl introspect org.cpuservice1 /org/cpuservice1 >/dev/null; echo "introspect $?"
busctl call {M} Allocate 'ssa{{sv}}' pkg 2 1 bind b true >/dev/null
systemd-run --slice=cpuservice-bound-pkg.slice --unit=pkgworker sleep 1000
pid=$(systemctl show pkgworker -p MainPID --value)
echo "cpuset $(busctl get-property {A} CPUSet)"
echo "process $(grep Cpus_allowed_list /proc/$pid/status | cut -f2)"
before=$(systemctl show cpuservice -p MainPID --value)
echo "== upgrade"
dpkg -i $F/cpuservice_0.1.1_all.deb >/dev/null 2>&1; echo "upgrade $?"
echo "version $(dpkg-query -W -f '${{Version}}' cpuservice)"
echo "active $(systemctl is-active cpuservice)"
echo "restarted $([ "$(systemctl show cpuservice -p MainPID --value)" != "$before" ] && echo yes)"
echo "cpuset $(busctl get-property {A} CPUSet)"
echo "process $(grep Cpus_allowed_list /proc/$pid/status | cut -f2)"
echo "== remove"
dpkg -r cpuservice >/dev/null 2>&1; echo "remove $?"
echo "active $(systemctl is-active cpuservice)"
echo "units $(systemctl list-units --all --plain --no-legend 'cpuservice*' \
    | grep -v cpuservice-lab | awk '$3 != "inactive" || $1 ~ /slice$/ {{print $1 ":" $3}}' \
    | tr '\n' ' ')"
echo "process $(kill -0 $pid 2>/dev/null && echo alive || echo gone)"
echo "== purge"
dpkg -P cpuservice >/dev/null 2>&1; echo "purge $?"
echo "left: $(find / -xdev \\( -path /proc -o -path /sys -o -path /payload -o -path /var/lib/dpkg \\
    -o -path /var/log \\) -prune -o -name '*cpuservice*' -print | grep -v cpuservice-lab \\
    | tr '\\n' ' ')"
"""


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


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory, lab_ready: None) -> Iterator[list[Path]]:
    if os.geteuid() != 0:
        unavailable("building the package needs root for its build dependencies")
    out = tmp_path_factory.mktemp("debs")
    for version in ("", "0.1.1"):
        env = {**os.environ, "CPUSERVICE_DEB_OUT": str(out / (version or "0.1.0"))}
        subprocess.run(["bash", str(CHECKOUT / "scripts/build-deb.sh"),
                        *([version] if version else [])], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    yield sorted(out.glob("*/cpuservice_*_all.deb"))


def test_lintian_has_no_errors_or_unexplained_warnings(debs: list[Path]) -> None:
    for deb in debs:
        log = (deb.parent / "lintian.log").read_text().splitlines()
        assert not [line for line in log if line.startswith(("E:", "W:"))], log


@pytest.fixture(scope="module")
def lifecycle(debs: list[Path]) -> dict[str, dict[str, str]]:
    assert [d.name for d in debs] == ["cpuservice_0.1.0_all.deb", "cpuservice_0.1.1_all.deb"]
    result = lab.run({"deb": SCENARIO}, files=debs).results["deb"]
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
