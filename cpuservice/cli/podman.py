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
- ``--cgroups`` other than enabled and no-conmon: disabled leaves the container without a
  cgroup of its own, split nests it where --cgroup-parent would not apply;
- ``--cgroup-conf cpuset.*``: as --cpuset-cpus;
- a remote podman (``--remote``, ``--url``, ``--connection``, ``--identity``, or
  CONTAINER_HOST / CONTAINER_CONNECTION in its environment): another podman would make the
  container, perhaps a user's, perhaps on another host;
- podman's global ``--cgroup-manager=cgroupfs``: podman would create the container's cgroup
  itself, which systemd neither knows nor confines to the slice;
- podman run by a user other than root (rootless): its containers live in the user's own
  systemd manager, which the allocation's slice (in the system manager) cannot hold.
Options are recognised anywhere after ``run`` (a container command that passes one of these
words to its own program is refused too); a global option written without "=" whose value
could be taken for the subcommand is refused with a request to write ``--option=value``. Only
``podman run`` is handled: containers started otherwise (``podman start``, ``kube play``, the
docker shim) are not given the slice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

# podman's global options that take no value (podman 4.3); any other option written without
# "=" is taken to use the next word, so an option unknown here cannot hide the subcommand
GLOBAL_FLAGS = {"--help", "-h", "--version", "-v", "--syslog", "--trace", "--noout"}
# global options that hand the container to another podman: a remote service (perhaps a
# user's, perhaps on another host), like systemd-run's --host and --machine
REMOTE = ("--remote", "-r", "--url", "--connection", "-c", "--identity")
REMOTE_ENV = ("CONTAINER_HOST", "CONTAINER_CONNECTION")
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


def _globals(command: Sequence[str], i: int) -> int:
    """Check podman's global options from ``command[i]`` on; the index of the first word that
    is not one of them."""
    while i < len(command) and command[i].startswith("-"):
        name = command[i].partition("=")[0]
        if name in REMOTE:
            raise PodmanUsage(
                f"podman {name} is not allowed: the container would be made by another podman "
                "service, outside the allocation's slice")
        manager, _ = _value(command, i, "--cgroup-manager")
        if manager is not None and manager != "systemd":
            raise PodmanUsage(
                f"podman --cgroup-manager={manager} is not allowed: podman would create the "
                "container's cgroup itself, outside the allocation's slice (use systemd, "
                "podman's default)")
        if "=" not in command[i] and command[i] not in GLOBAL_FLAGS:
            i += 1  # its value
        i += 1
    return i


def run_index(command: Sequence[str], root: bool = True,
              env: Mapping[str, str] | None = None) -> int | None:
    """Where podman's ``run`` subcommand is in ``command`` (a podman command line), or None
    when ``command`` is not a ``podman run`` / ``podman container run``; raises PodmanUsage
    for what cpuservice-run refuses (``root``: whether podman runs as root; rootless podman
    puts its containers in the user's own systemd manager, which a slice of the system manager
    cannot hold; ``env``: the environment podman gets)."""
    if not command or os.path.basename(command[0]) != "podman":
        return None
    i = _globals(command, 1)
    at: int | None = None
    hidden = "run" in command[1:i]  # taken for an option's value: maybe the subcommand
    if command[i:i + 1] == ["run"]:
        at = i
    elif command[i:i + 1] == ["container"]:
        j = _globals(command, i + 1)
        hidden = hidden or "run" in command[i + 1:j]
        at = j if command[j:j + 1] == ["run"] else None
    if at is None:
        if hidden:
            raise PodmanUsage(
                "cannot tell podman's subcommand from its options here: write podman's "
                "options as --option=value")
        return None
    remote = [k for k in REMOTE_ENV if (env or {}).get(k)]
    if remote:
        raise PodmanUsage(f"podman run with {remote[0]} set is not allowed: the container "
                          "would be made by another podman service, outside the allocation's "
                          "slice")
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
        if cgroups is not None and cgroups not in ("enabled", "no-conmon"):
            raise PodmanUsage(f"podman run --cgroups={cgroups} is not allowed: the container "
                              "must have a cgroup of its own under the allocation's slice "
                              "(enabled or no-conmon)")
        manager, _ = _value(args, i, "--cgroup-manager")
        if manager is not None and manager != "systemd":
            raise PodmanUsage(f"podman --cgroup-manager={manager} is not allowed: podman would "
                              "create the container's cgroup itself, outside the slice")
        conf, _ = _value(args, i, "--cgroup-conf")
        if conf is not None and conf.startswith("cpuset."):
            raise PodmanUsage(f"podman run --cgroup-conf={conf} is not allowed: "
                              + REFUSED["--cpuset-cpus"])


def devices(command: Sequence[str]) -> list[str]:
    """The host paths of the devices a ``podman run`` command passes in (``--device
    /dev/X[:CONTAINER-PATH[:rwm]]``), each once, in order: what ``cpuservice-run
    --near-from-devices`` names in option near. Only ``/dev`` paths; CDI names
    (``nvidia.com/gpu=0``) and ``--gpus`` are not derived (name those with --near). Like
    the refusals above, an option is recognised anywhere after ``run``. PodmanUsage when
    ``command`` is no podman run."""
    at = run_index(command)
    if at is None:
        raise PodmanUsage("--near-from-devices needs a podman run command (its --device "
                          "options name the devices)")
    args = command[at + 1:]
    out: list[str] = []
    for i in range(len(args)):
        value, _ = _value(args, i, "--device")
        host = (value or "").split(":", 1)[0]
        if host.startswith("/dev/") and host not in out:
            out.append(host)
    return out


def with_slice(command: Sequence[str], slice_unit: str) -> list[str]:
    """``command`` with the allocation's slice given to podman run (unchanged when it is not
    a podman run)."""
    at = run_index(command)
    if at is None:
        return list(command)
    return [*command[:at + 1], f"--cgroup-parent={slice_unit}", *command[at + 1:]]
