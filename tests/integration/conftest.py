"""The container host: one booted at a time, started on first use and reused by later tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unavailable
from tests.envs.container import ContainerHost
from tests.integration.service_env import ServiceHost


def container_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the container host needs root"
    for tool in ("systemd-nspawn", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-deps.sh integration)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem"
    return None


class Containers:
    """Holds the session's container; nspawn --keep-unit allows one at a time per cgroup."""

    def __init__(self) -> None:
        self.host: ContainerHost | None = None

    def get(self) -> ContainerHost:
        if self.host is None:
            self.host = ContainerHost("cpuservice-it").start()
            print(f"\ncontainer host booted in {self.host.boot_seconds:.2f} s")
        return self.host

    def stop(self) -> None:
        if self.host is not None:
            self.host.stop()
            self.host = None


@pytest.fixture(scope="session")
def containers() -> Iterator[Containers]:
    reason = container_unavailable_reason()
    if reason:
        unavailable(reason)
    manager = Containers()
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture
def container(containers: Containers) -> ContainerHost:
    return containers.get()


@pytest.fixture(scope="session")
def daemon_host(containers: Containers) -> ServiceHost:
    return ServiceHost(containers.get())


@pytest.fixture
def daemon(daemon_host: ServiceHost, containers: Containers) -> ServiceHost:
    """The daemon on fixture machine ``a`` with a clean state (tests reconfigure as needed)."""
    if daemon_host.c is not containers.get():
        daemon_host.install(containers.get())
    daemon_host.configure("a")
    return daemon_host


# polkit grants the unprivileged caller of the access tests (nobody) the allocate action
RULE = "/etc/polkit-1/rules.d/50-cpuservice-test.rules"
GRANT = """polkit.addRule(function(action, subject) {
    if (action.id == "org.cpuservice1.allocate" && subject.user == "nobody") {
        return polkit.Result.YES;
    }
});
"""


@pytest.fixture
def granted(daemon: ServiceHost) -> Iterator[ServiceHost]:
    rule = daemon.c.root / RULE.lstrip("/")
    rule.parent.mkdir(parents=True, exist_ok=True)
    rule.write_text(GRANT)
    daemon.c.run(["systemctl", "restart", "polkit.service"])
    try:
        yield daemon
    finally:
        rule.unlink()
        daemon.c.run(["systemctl", "restart", "polkit.service"])
