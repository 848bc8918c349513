"""cpuservice-run and podman: a container started by ``podman run`` runs in a scope podman asks
systemd for, under machine.slice unless told otherwise, so it would escape the allocation that
cpuservice-run made for podman itself. cpuservice-run therefore recognises a ``podman run`` (or
``podman container run``) command and passes the allocation's slice as ``--cgroup-parent``:
the container's scope, and with it every process of the container, lands in the allocation's
slice, and the allocation lives as long as the container (also with ``-d``: the slice is not
empty while the container runs). Pure; no I/O.

Refused before anything is allocated, each with the reason:
- ``--cgroup-parent``: cpuservice-run chooses it;
- ``--cpuset-cpus``: the container gets its allocation's CPUs (the kernel would intersect
  the two sets, or ignore a set outside the allocation), so the CPUs are asked for with
  cpuservice-run's own options;
- ``--cgroups=disabled``: the container would have no cgroup of its own;
- podman's global ``--cgroup-manager=cgroupfs``: podman would create the container's cgroup
  itself, which systemd neither knows nor confines to the slice;
- podman run by a user other than root (rootless): its containers live in the user's own
  systemd manager, which the allocation's slice (in the system manager) cannot hold.
With ``--cgroups=split`` podman nests the container under its own cgroup (cpuservice-run's
scope in the slice), so nothing is added. Options are recognised anywhere after ``run`` (a
container command that passes one of these words to its own program is refused too).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# podman's global options that take a value as the next word (podman 4.3)
GLOBAL_VALUE = {"--cgroup-manager", "--conmon", "--connection", "-c", "--events-backend",
                "--hooks-dir", "--identity", "--log-level", "--network-cmd-path",
                "--network-config-dir", "--root", "--runroot", "--runtime", "--runtime-flag",
                "--storage-driver", "--storage-opt", "--tmpdir", "--url", "--volumepath",
                "--ssh", "--imagestore", "--module"}
REFUSED = {
    "--cgroup-parent": "cpuservice-run puts the container in its allocation's slice",
    "--cpuset-cpus": "the container runs on its allocation's CPUs: ask for them with "
                     "cpuservice-run's --cpus, --bind or --cpuset instead",
}


class PodmanUsage(ValueError):
    """A podman command line cpuservice-run refuses (exit 125)."""


def _value(args: Sequence[str], i: int, name: str) -> tuple[str | None, int]:
    """The value of option ``name`` at ``args[i]`` (``--x=v`` or ``--x v``) and the index of
    the last word it used; None when ``args[i]`` is not that option."""
    arg = args[i]
    if arg == name:
        return (args[i + 1] if i + 1 < len(args) else ""), i + 1
    if arg.startswith(name + "="):
        return arg[len(name) + 1:], i
    return None, i


def run_index(command: Sequence[str], root: bool = True) -> int | None:
    """Where podman's ``run`` subcommand is in ``command`` (a podman command line), or None
    when ``command`` is not a ``podman run`` / ``podman container run``; raises PodmanUsage
    for what cpuservice-run refuses (``root``: whether podman runs as root; rootless podman
    puts its containers in the user's own systemd manager, which a slice of the system manager
    cannot hold)."""
    if not command or os.path.basename(command[0]) != "podman":
        return None
    i = 1
    while i < len(command) and command[i].startswith("-"):
        manager, i = _value(command, i, "--cgroup-manager")
        if manager is not None and manager != "systemd":
            raise PodmanUsage(
                f"podman --cgroup-manager={manager} is not allowed: podman would create the "
                "container's cgroup itself, outside the allocation's slice (use systemd, "
                "podman's default)")
        if manager is None and command[i] in GLOBAL_VALUE:
            i += 1
        i += 1
    words = list(command[i:i + 2])
    if words[:1] == ["run"]:
        at = i
    elif words == ["container", "run"]:
        at = i + 1
    else:
        return None
    if not root:
        raise PodmanUsage("rootless podman run is not supported: its containers live in your "
                          "user manager's cgroups, outside the allocation's slice of the system "
                          "manager (run it as root: sudo cpuservice-run ... -- podman run ...)")
    _check_run(command[at + 1:])
    return at


def _check_run(args: Sequence[str]) -> None:
    for i in range(len(args)):
        for name, why in REFUSED.items():
            if _value(args, i, name)[0] is not None:
                raise PodmanUsage(f"podman run {name} is not allowed: {why}")
        cgroups, _ = _value(args, i, "--cgroups")
        if cgroups == "disabled":
            raise PodmanUsage("podman run --cgroups=disabled is not allowed: the container "
                              "would have no cgroup of its own in the allocation's slice")


def with_slice(command: Sequence[str], slice_unit: str) -> list[str]:
    """``command`` with the allocation's slice given to podman run (unchanged when it is not
    a podman run, or runs with --cgroups=split, which nests the container under podman)."""
    at = run_index(command)
    if at is None:
        return list(command)
    rest = command[at + 1:]
    if any(_value(rest, i, "--cgroups")[0] == "split" for i in range(len(rest))):
        return list(command)
    return [*command[:at + 1], f"--cgroup-parent={slice_unit}", *rest]
