"""Debian 13 (trixie), Debian's stable release: the package built there lintian-clean, installed
on a Debian 13 guest booting its own kernel, the service enforcing AllowedCPUs and repairing
after CPU hotplug, then upgraded with an allocation live, removed and purged, without a warning
from dpkg; then the README's first command, scripts/run.sh, as on a Debian 13 host where systemd
is PID 1. One boot of lab.TRIXIE (plan.DEBIAN13); alone: make test-lab-debian13."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.envs import lab
from tests.lab.test_lab_deb import (
    check_install,
    check_purge,
    check_remove,
    check_upgrade,
    lintian_findings,
    sections,
)
from tests.lab.test_lab_hotplug import check_repair, results


def test_lintian_on_debian13_is_clean(trixie_debs: list[Path]) -> None:
    """Debian 13's lintian: aliased-location for units under /lib/systemd/system, a groff
    warning on cpuserviced.8, before."""
    assert not lintian_findings(trixie_debs)


def test_the_guest_is_debian13(trixie_boot: lab.Run) -> None:
    out = trixie_boot.results["versions"]
    assert out.status == 0, out.output
    release, kernel, systemd, controllers, python = out.output.splitlines()[:5]
    assert release.startswith("13."), release
    assert kernel.startswith("6.12."), kernel
    assert int(systemd.split()[1]) >= 257, systemd
    assert "cpuset" in controllers.split()
    version, _, pydantic = python.split()
    assert version.startswith("3.13.") and pydantic.startswith("2."), python


def test_allowed_cpus_is_enforced(trixie_boot: lab.Run) -> None:
    result = trixie_boot.results["enforce"]
    assert result.status == 0 and "Cpus_allowed_list:\t3" in result.output, result.output


@pytest.fixture(scope="module")
def package(trixie_boot: lab.Run) -> dict[str, dict[str, str]]:
    out = {}
    for name in ("package", "lifecycle"):
        result = trixie_boot.results[name]
        assert result.status == 0, result.output
        out.update(sections(result.output))
    return out


def test_the_package_installs_units_under_usr_lib_and_enforces(
        package: dict[str, dict[str, str]]) -> None:
    check_install(package["install"])
    assert package["install"]["unitfile"] == "/usr/lib/systemd/system/cpuservice.service"


def test_the_packaged_service_repairs_after_cpu_hotplug(trixie_boot: lab.Run) -> None:
    check_repair(results(trixie_boot, "repair"))


def test_upgrade_remove_and_purge_without_a_warning(package: dict[str, dict[str, str]]) -> None:
    check_upgrade(package["install"], package["upgrade"])
    check_remove(package["remove"])
    check_purge(package["purge"])


def test_the_readmes_run_command_installs_and_shows_the_service(trixie_boot: lab.Run) -> None:
    result = trixie_boot.results["run"]
    assert result.status == 0, result.output
    out = result.output
    assert "Id=cpuservice-bound-demo.slice" in out and "ActiveState=active" in out, out
    allowed = next(line for line in out.splitlines() if line.startswith("AllowedCPUs="))
    assert allowed != "AllowedCPUs=", out
    assert out.rstrip().endswith("active active"), out
