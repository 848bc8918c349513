"""Containers on allocated CPUs, on the lab's real kernel (cgroup v2 enforces AllowedCPUs):
podman 4.3 of Debian 12 and a local busybox image, started the three ways people start them
(tests/lab/scenarios/containers.py; docs/guides/podman.md's "Containers" recipes). One boot of
lab.PODMAN, alone with `make test-lab-containers`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.envs import lab


@pytest.fixture(scope="module")
def containers(containers_boot: lab.Run) -> lab.Run:
    return containers_boot


def checks(run: lab.Run, scenario: str) -> dict[str, dict[str, Any]]:
    for name in ("install", "podman", scenario):
        result = run.results[name]
        assert result.status == 0, f"{name}: {result.output}"
    return run.results[scenario].checks()


def below(check: dict[str, Any]) -> bool:
    return str(check["cgroup"]).startswith(check["unit_cgroup"] + "/")


def test_podman_run_with_the_allocations_slice_as_cgroup_parent(containers: lab.Run) -> None:
    found = checks(containers, "parent")
    placed = found["parent"]
    assert placed["allowed"] == placed["allocation"] and below(placed), placed
    assert placed["cgroup"].endswith("/container") and "/libpod-" in placed["cgroup"]
    # podman's --cpuset-cpus on top: the kernel intersects it with the allocation, and a CPU
    # outside the allocation is ignored (the container runs on the allocation's CPUs)
    pinned = found["cpuset-cpus"]
    assert pinned["inside"]["allowed"] == [pinned["inside"]["asked"]], pinned
    assert pinned["outside"]["allowed"] == pinned["allocation"], pinned
    # hotplug repair reaches the container's cgroup
    repair = found["repair"]
    assert repair["offline"] not in repair["after"] and repair["allowed"] == repair["after"]
    # releasing the allocation stops its slice, and with it the container (at once: its PID 1
    # ends on SIGTERM, no 90 s stop timeout is waited out)
    released = found["released"]
    assert released["status"] != "running" and not released["held"], released
    assert released["release_s"] < 30, released


def test_cpuservice_run_podman_keeps_the_container_on_its_cpus(containers: lab.Run) -> None:
    found = checks(containers, "run")
    for check in ("run", "detached"):
        placed = found[check]
        assert placed["allowed"] == placed["allocation"] and below(placed), placed
    assert found["run-ended"]["exit"] == 0, found["run-ended"]
    # -d: podman returns at once, the allocation lives until the container stops
    assert found["detached-ended"]["returned_s"] < 60
    refused = found["refused"]
    assert refused["exit"] == 125 and "--cpuset-cpus is not allowed" in refused["stderr"]
    assert not refused["held"]


def test_a_container_service_allocated_with_unit_follows_across_restarts(
        containers: lab.Run) -> None:
    found = checks(containers, "service")
    first, again = found["service"], found["service-restarted"]
    for placed in (first, again):
        assert placed["allowed"] == placed["allocation"] and below(placed), placed
        assert placed["unit_cgroup"] == "/system.slice/container-db.service"
    assert first["pid"] != again["pid"]
