"""cpuservice-run and option near (issue 38): --near DEVICE goes to Allocate as it is, and
--near-from-devices names the devices a podman run passes in with --device."""

from __future__ import annotations

import pytest

from cpuservice.cli import options, podman, run


def parsed(argv: list[str]) -> tuple[run.Line, object]:
    line = run.scan(argv)
    return line, run.parser().parse_args(line.ours)


def test_near_goes_to_allocate_and_binds() -> None:
    _, args = parsed(["--near", "eth0", "--near-policy", "preferred", "--", "true"])
    assert options.options_of(args) == {  # type: ignore[arg-type]
        "near": "eth0", "near-policy": "preferred", "bind": True}


@pytest.mark.parametrize(("command", "found"), [
    (["podman", "run", "--device", "/dev/nvidia0", "--device=/dev/nvidiactl:/dev/nvidiactl:rw",
      "img"], ["/dev/nvidia0", "/dev/nvidiactl"]),
    (["podman", "run", "--device=/dev/nvme0n1:/dev/xvdc:rwm", "--device", "/dev/nvme0n1", "img"],
     ["/dev/nvme0n1"]),
    (["podman", "container", "run", "--device", "nvidia.com/gpu=0", "--gpus", "all", "img"], []),
])
def test_the_devices_of_a_podman_run(command: list[str], found: list[str]) -> None:
    assert podman.devices(command) == found


def test_near_from_devices_adds_them_to_near() -> None:
    line, args = parsed(["--near", "mlx5_0,/dev/nvidia1", "--near-from-devices", "--",
                         "podman", "run", "--device", "/dev/nvidia0", "--device",
                         "/dev/nvidia1", "img"])
    run.near_from_devices(args, line.command)  # type: ignore[arg-type]
    assert options.options_of(args)["near"] == (  # type: ignore[arg-type]
        "mlx5_0,/dev/nvidia1,/dev/nvidia0")


@pytest.mark.parametrize(("command", "says"), [
    (["sleep", "1"], "needs a podman run command"),
    (["podman", "run", "img"], "passes no --device /dev/"),
])
def test_near_from_devices_without_devices_is_refused(command: list[str], says: str) -> None:
    line, args = parsed(["--near-from-devices", "--", *command])
    with pytest.raises(run.Usage, match=says):
        run.near_from_devices(args, line.command)  # type: ignore[arg-type]


def test_main_refuses_it_before_allocating(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--near-from-devices", "--", "sleep", "1"]) == run.EXIT_WRAPPER
    assert "needs a podman run command" in capsys.readouterr().err


def test_without_the_flag_nothing_is_derived() -> None:
    line, args = parsed(["--", "podman", "run", "--device", "/dev/nvidia0", "img"])
    run.near_from_devices(args, line.command)  # type: ignore[arg-type]
    assert "near" not in options.options_of(args)  # type: ignore[arg-type]
