"""The VM lab: availability check (a skipped tier fails under CI=true), the Debian packages and
the shared boots every lab test module reads (tests/lab/plan.py), with their times reported at
the end of the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unavailable
from tests.envs import lab
from tests.envs.lab import CHECKOUT
from tests.lab import plan

BOOTS: dict[str, lab.Run] = {}
DEFAULT = lab.Shape()


def lab_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the VM lab needs root (debootstrap, chroot)"
    for tool in ("qemu-system-x86_64", "debootstrap", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-deps.sh lab)"
    try:
        lab.kernel()
    except lab.LabError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def lab_ready() -> None:
    reason = lab_unavailable_reason()
    if reason:
        unavailable(reason)


@pytest.fixture(scope="session")
def debs(lab_ready: None) -> Iterator[list[Path]]:
    """cpuservice 0.1.0 built from the checkout (with lintian's log) and the same package as
    0.1.1, for the upgrade."""
    out = Path(tempfile.mkdtemp(prefix="cpuservice-debs-", dir="/var/tmp"))
    try:
        env = {**os.environ, "CPUSERVICE_DEB_OUT": str(out / "0.1.0")}
        subprocess.run(["bash", str(CHECKOUT / "scripts/build-deb.sh")], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        first = out / "0.1.0/cpuservice_0.1.0_all.deb"
        subprocess.run(["bash", str(CHECKOUT / "tests/lab/scenarios/reversion.sh"), str(first),
                        "0.1.1", str(out / "0.1.1")], check=True, stdout=subprocess.DEVNULL)
        yield sorted(out.glob("*/cpuservice_*_all.deb"))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _boot(name: str, scenarios: dict[str, lab.Scenario], shape: lab.Shape = DEFAULT,
          files: list[Path] | None = None, release: lab.Release = lab.BOOKWORM) -> lab.Run:
    if name not in BOOTS:
        BOOTS[name] = lab.run(scenarios, shape, files=files or [], release=release)
    return BOOTS[name]


@pytest.fixture(scope="session")
def main_boot(debs: list[Path]) -> lab.Run:
    """One boot of the default shape that runs every scenario of plan.MAIN."""
    return _boot("main", plan.MAIN, files=debs)


@pytest.fixture(scope="session")
def modern_boot(lab_ready: None) -> lab.Run:
    """One boot of Debian sid (systemd >= 261, Linux 7.x) that runs every scenario of
    plan.MODERN."""
    return _boot("modern", plan.MODERN, release=lab.SID)


@pytest.fixture(scope="session")
def small_boot(lab_ready: None) -> lab.Run:
    return _boot("small", plan.SMALL_SCENARIOS, plan.SMALL)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for name, run in BOOTS.items():
        times = ", ".join(f"{r.name} {r.seconds:.0f}" for r in run.results.values())
        terminalreporter.write_line(
            f"VM lab boot {name}: booted in {run.boot_seconds:.0f} s, whole run "
            f"{run.total_seconds:.0f} s; scenarios (s): {times}")
        if run.boot_panic:
            terminalreporter.write_line(f"VM lab boot {name}: booted again after a kernel "
                                        f"panic: {run.boot_panic[:1200]}")
        if "sysfs" in run.results:  # what the kernel showed half-way through hotplug
            for line in run.results["sysfs"].output.splitlines():
                if '"transitions"' in line:
                    states = line[len(lab.RESULT):]
                    terminalreporter.write_line(f"VM lab kernel hotplug states: {states}")
