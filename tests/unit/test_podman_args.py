"""cpuservice-run with podman (cpuservice/cli/podman.py): the allocation's slice goes to podman
run as --cgroup-parent; what would take the container out of it is refused before anything is
allocated. The lab proves the container lands there (tests/lab/test_lab_containers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpuservice.cli import podman, run

SLICE = "cpuservice-bound-web.slice"


@pytest.mark.parametrize("command,expected", [
    (["podman", "run", "--rm", "img", "sleep", "1"],
     ["podman", "run", f"--cgroup-parent={SLICE}", "--rm", "img", "sleep", "1"]),
    (["/usr/bin/podman", "--log-level", "debug", "--root=/x", "container", "run", "-d", "img"],
     ["/usr/bin/podman", "--log-level", "debug", "--root=/x", "container", "run",
      f"--cgroup-parent={SLICE}", "-d", "img"]),
    (["podman", "--cgroup-manager", "systemd", "run", "img"],
     ["podman", "--cgroup-manager", "systemd", "run", f"--cgroup-parent={SLICE}", "img"]),
    (["podman", "--namespace", "ns", "run", "img"],  # unknown options take a value
     ["podman", "--namespace", "ns", "run", f"--cgroup-parent={SLICE}", "img"]),
    (["podman", "container", "--log-level=debug", "run", "img"],
     ["podman", "container", "--log-level=debug", "run", f"--cgroup-parent={SLICE}", "img"]),
    (["podman", "run", "--cgroups=no-conmon", "img"],
     ["podman", "run", f"--cgroup-parent={SLICE}", "--cgroups=no-conmon", "img"]),
    (["podman", "images"], ["podman", "images"]),
    (["podman", "exec", "web", "run"], ["podman", "exec", "web", "run"]),
    (["make", "run"], ["make", "run"]),
    (["podman-remote", "run", "img"], ["podman-remote", "run", "img"]),
])
def test_podman_run_gets_the_slice(command: list[str], expected: list[str]) -> None:
    assert podman.with_slice(command, SLICE) == expected


@pytest.mark.parametrize("command,named", [
    (["podman", "run", "--cgroup-parent=machine.slice", "img"], "--cgroup-parent"),
    (["podman", "run", "--cgroup-parent", "machine.slice", "img"], "--cgroup-parent"),
    (["podman", "run", "--cpuset-cpus=0-3", "img"], "--cpuset-cpus"),
    (["podman", "container", "run", "--cpuset-cpus", "1", "img"], "--cpuset-cpus"),
    (["podman", "run", "--cgroups", "disabled", "img"], "--cgroups=disabled"),
    (["podman", "--cgroup-manager=cgroupfs", "run", "img"], "cgroupfs"),
    (["podman", "--cgroup-manager", "cgroupfs", "run", "img"], "cgroupfs"),
    (["podman", "run", "--cgroup-manager=cgroupfs", "img"], "cgroupfs"),
    (["podman", "run", "--cgroups=split", "img"], "--cgroups=split"),
    (["podman", "run", "--cgroups=split", "--cgroups=enabled", "img"], "--cgroups=split"),
    (["podman", "run", "img", "app", "--cgroups=split"], "--cgroups=split"),
    (["podman", "run", "--cgroup-conf=cpuset.cpus=1", "img"], "--cgroup-conf"),
    (["podman", "--url", "unix:///run/user/1000/podman/podman.sock", "run", "img"], "--url"),
    (["podman", "-r", "run", "img"], "-r"),
    (["podman", "--connection=other", "run", "img"], "--connection"),
    (["podman", "--unknown-flag", "run", "img"], "--option=value"),
    (["podman", "--root", "run", "ps"], "--option=value"),  # run may be the subcommand
    (["podman", "container", "--unknown-flag", "run", "img"], "--option=value"),
])
def test_what_would_leave_the_slice_is_refused(command: list[str], named: str) -> None:
    with pytest.raises(podman.PodmanUsage, match=named):
        podman.run_index(command)


def test_a_remote_podman_from_the_environment_is_refused() -> None:
    with pytest.raises(podman.PodmanUsage, match="CONTAINER_HOST"):
        podman.run_index(["podman", "run", "img"], env={"CONTAINER_HOST": "ssh://x/run/p.sock"})


@pytest.mark.parametrize("argv,refused", [
    (["--uid=1000"], True), (["--uid", "alice"], True), (["-p", "User=alice"], True),
    (["--property=DynamicUser=yes"], True), (["-pUser=bob"], True), (["--uid=0"], False),
    (["-p", "User=root"], False), (["-E", "CONTAINER_HOST=tcp://h:1"], True), ([], False),
])
def test_podman_as_another_user_or_remote_through_systemd_run(argv: list[str],
                                                              refused: bool) -> None:
    """systemd-run's --uid / -p User= make the podman it starts rootless, and -E can point it
    at another podman service: cpuservice-run refuses them with a podman run as well."""
    line = run.scan([*argv, "podman", "run", "img"])
    root = not run._other_user(line)
    env = run._setenv(line)
    if refused:
        with pytest.raises(podman.PodmanUsage):
            podman.run_index(line.command, root=root, env=env)
    else:
        assert podman.run_index(line.command, root=root, env=env) == 1


def test_rootless_podman_is_refused() -> None:
    with pytest.raises(podman.PodmanUsage, match="rootless"):
        podman.run_index(["podman", "run", "img"], root=False)
    assert podman.run_index(["podman", "images"], root=False) is None


def test_cpuservice_run_refuses_before_allocating(tmp_path: Path) -> None:
    """Exit 125 with the reason, and no bus was asked (the address does not exist: reaching
    for it would say so)."""
    fake = tmp_path / "podman"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(
        [sys.executable, "-m", "cpuservice.cli.run", "--bus-address", "unix:path=/nonexistent",
         "--", "podman", "run", "--cpuset-cpus=0", "img"],
        capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 125
    assert "podman run --cpuset-cpus is not allowed" in out.stderr
    assert "bus" not in out.stderr
