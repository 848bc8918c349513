"""cpuservice-run: run a command on allocated CPUs through the real systemd-run.

    cpuservice-run [--cpus N] [--bind] [policy options] [--lend | --borrow] [--name NAME] \\
        [systemd-run options] [--] COMMAND [ARG...]

It allocates with lifetime=unit, moves itself into a scope in the allocation's slice (so the
slice is never empty from then on), then becomes ``systemd-run --scope --slice=...`` (or
``--service --wait`` with --service), which moves the command into its own scope in that slice.
The daemon releases the allocation when the slice has no process left: when the command ends, is
killed, or this wrapper is SIGKILLed before starting it. The exit status is the command's; the
wrapper's own failures exit 125 (126: the command cannot be run, 127: it was not found), as
timeout(1) and env(1) do.

As for systemd-run, the first word that is not an option starts the command (``--`` is
optional). systemd-run's options pass through, except those that would move the command out of
its allocation (another slice, the user manager, another host or container, a timer, socket or
path unit that starts it later), which are refused before anything is allocated.

A ``podman run`` command gets the allocation's slice as ``--cgroup-parent``, so that the
container itself runs on the allocation's CPUs (cpuservice/cli/podman.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from cpuservice import __version__
from cpuservice.cli import podman
from cpuservice.cli.client import ALLOCATION, Client, explain, explain_connect, polkit_agent
from cpuservice.cli.options import add_option_args, options_of
from cpuservice.host import dbuscall

EXIT_WRAPPER, EXIT_CANNOT_RUN, EXIT_NOT_FOUND = 125, 126, 127

# systemd-run's own options (systemd 252), passed through: those that take a value, flags
RUN_VALUE = {"--unit": "-u", "--property": "-p", "--description": None, "--setenv": "-E",
             "--service-type": None, "--uid": None, "--gid": None, "--nice": None,
             "--working-directory": None}
RUN_FLAGS = {"--no-block": None, "--remain-after-exit": "-r", "--send-sighup": None,
             "--same-dir": "-d", "--pty": "-t", "--pipe": "-P", "--quiet": "-q",
             "--collect": "-G", "--system": None}
TIMER = ("--on-active", "--on-boot", "--on-startup", "--on-unit-active", "--on-unit-inactive",
         "--on-calendar", "--on-timezone-change", "--on-clock-change", "--timer-property",
         "--path-property", "--socket-property")
# option -> why it would break the allocation
REFUSED = {
    "--slice": "the command runs in its allocation's slice, which cpuservice-run chooses",
    "--slice-inherit": "the command runs in its allocation's slice, which cpuservice-run "
                       "chooses",
    "--user": "the allocation's slice is in the system manager, not a user manager",
    "--host": "the allocation is made on this machine",
    "--machine": "the allocation is made on this machine, not in a container",
    "--wait": "cpuservice-run already waits for the command (with --service)",
    "--no-block": "cpuservice-run waits for the command: its exit status is the result",
} | {opt: "the allocation ends when its slice is empty, before a timer, socket or path "
     "unit would start the command" for opt in TIMER}
REFUSED_SHORT = {"-H": "--host", "-M": "--machine"}
REFUSED_PROPERTIES = {"Slice": "--slice"}
VALUE_TIMER = set(TIMER) - {"--on-timezone-change", "--on-clock-change"}

# cpuservice-run's own options that take a value
OWN_VALUE = {"--cpus", "--policy", "--exclusive", "--numa-strategy", "--numa-alignment",
             "--cpuset", "--partition", "--name", "--bus-address", "--near", "--near-policy"}
# Allocate-only options cpuservice-run takes too (unit and lifetime are its own to choose)
RUN_ALLOCATE = ("lend", "borrow", "near-irqs")
OWN_FLAGS = {"--bind", "--memory-nodes", *(f"--{key}" for key in RUN_ALLOCATE), "--service",
             "--scope", "--no-ask-password", "--near-from-devices", "--help", "--version"}


class Usage(Exception):
    """A command line cpuservice-run refuses (exit 125)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_WRAPPER, f"{self.prog}: {message}\n")


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="cpuservice-run",
        usage="cpuservice-run [OPTIONS] [systemd-run OPTIONS] [--] COMMAND [ARG...]",
        description="Run COMMAND on CPUs allocated by cpuserviced, released when it ends.",
        epilog="systemd-run options passed through: -u/--unit, -p/--property, --description, "
               "-E/--setenv, --uid, --gid, --nice, --working-directory, -d/--same-dir, "
               "--service-type, -r/--remain-after-exit, --send-sighup, -t/--pty, -P/--pipe, "
               "-q/--quiet, -G/--collect. Refused: --slice, --slice-inherit, -p Slice=, "
               "--user, -H/--host, -M/--machine, --wait, --no-block and the timer, socket "
               "and path options. A podman run command gets --cgroup-parent=<the "
               "allocation's slice> (its own --cgroup-parent, --cpuset-cpus and "
               "--cgroups=disabled are refused). Exit status: the command's; 125 "
               "cpuservice-run failed, 126 the command cannot be run, 127 the command was not "
               "found.")
    p.add_argument("--cpus", default="1", help="CPU amount (default 1)")
    add_option_args(p, also=RUN_ALLOCATE)
    p.add_argument("--name", help="allocation name (default run-PID)")
    p.add_argument("--service", action="store_true",
                   help="run as a transient service (systemd-run --service --wait)")
    p.add_argument("--scope", action="store_true", help="run in a transient scope (default)")
    p.add_argument("--no-ask-password", action="store_true",
                   help="do not ask for a password when polkit wants one")
    p.add_argument("--bus-address", help="D-Bus address instead of the system bus")
    p.add_argument("--near-from-devices", action="store_true",
                   help="place next to the devices a podman run command passes in with "
                        "--device /dev/X (added to --near)")
    p.add_argument("--version", action="version", version=__version__)
    return p


def near_from_devices(args: argparse.Namespace, command: Sequence[str]) -> None:
    """``args.near`` with the host devices of a podman run's --device options added
    (--near-from-devices); Usage when there is none to add."""
    if not args.near_from_devices:
        return
    try:
        found = podman.devices(command)
    except podman.PodmanUsage as exc:
        raise Usage(str(exc)) from None
    if not found:
        raise Usage("--near-from-devices: the podman run command passes no --device /dev/...")
    given = ",".join(args.near or []).split(",")  # --near repeats, each comma-separated
    args.near = [*(args.near or []), *(d for d in found if d not in given)]


@dataclass
class Line:
    ours: list[str] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)


def _refuse(option: str, shown: str | None = None) -> NoReturn:
    raise Usage(f"{shown or option} is not allowed: {REFUSED[option]}")


def _check_property(value: str) -> None:
    name = value.partition("=")[0]
    if name in REFUSED_PROPERTIES:
        raise Usage(f"-p {name}= is not allowed: {REFUSED[REFUSED_PROPERTIES[name]]}")


def scan(argv: Sequence[str]) -> Line:
    """Split the command line into cpuservice-run's options, systemd-run's and the command:
    the command starts at ``--`` or at the first word that is not an option."""
    line = Line()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            line.command = list(argv[i + 1:])
            return line
        if not arg.startswith("-") or arg == "-":
            line.command = list(argv[i:])
            return line
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            needs = name in OWN_VALUE or name in RUN_VALUE or name in VALUE_TIMER
            if needs and not eq:
                if i + 1 >= len(argv):
                    raise Usage(f"option {name} needs a value")
                value, i = argv[i + 1], i + 1
            if name in REFUSED:
                _refuse(name)
            if name == "--property":
                _check_property(value)
            if name in OWN_VALUE:
                line.ours += [name, value]
            elif name in OWN_FLAGS:
                line.ours.append(arg)
            elif name in RUN_VALUE:
                line.passthrough += [name, value]
            elif name in RUN_FLAGS:
                line.passthrough.append(arg)
            else:
                raise Usage(f"unknown option {name} (see cpuservice-run --help)")
        else:
            i = _short(argv, i, line)
        i += 1
    return line


def _short(argv: Sequence[str], i: int, line: Line) -> int:
    """One cluster of short options (``-qP``, ``-pCPUWeight=10``, ``-p X``); the index of the
    last word it used."""
    cluster = argv[i][1:]
    short_value = {v: k for k, v in RUN_VALUE.items() if v}
    short_flags = {v for v in RUN_FLAGS.values() if v}
    for j, ch in enumerate(cluster):
        opt = f"-{ch}"
        if opt in REFUSED_SHORT:
            _refuse(REFUSED_SHORT[opt], f"{opt}/{REFUSED_SHORT[opt]}")
        if opt == "-h":
            line.ours.append("--help")
        elif opt in short_flags:
            line.passthrough.append(opt)
        elif opt in short_value:
            value = cluster[j + 1:]
            if not value:
                if i + 1 >= len(argv):
                    raise Usage(f"option {opt} needs a value")
                value, i = argv[i + 1], i + 1
            if opt == "-p":
                _check_property(value)
            line.passthrough += [opt, value]
            return i
        else:
            raise Usage(f"unknown option {opt} (see cpuservice-run --help)")
    return i


def _pairs(line: Line, names: Sequence[str]) -> list[str]:
    """The values systemd-run's options ``names`` get in ``line``."""
    out = []
    words = line.passthrough
    for i, word in enumerate(words[:-1]):
        if word in names:
            out.append(words[i + 1])
    return out


def _other_user(line: Line) -> bool:
    """Whether systemd-run runs the command as a user other than root (--uid, -p User=,
    -p DynamicUser=): a podman there is rootless."""
    users = _pairs(line, ("--uid",))
    for prop in _pairs(line, ("--property", "-p")):
        name, _, value = prop.partition("=")
        if name == "User":
            users.append(value)
        elif name == "DynamicUser" and value.lower() in ("1", "yes", "true", "on"):
            return True
    return any(u not in ("0", "root") for u in users)


def _setenv(line: Line) -> dict[str, str]:
    """The environment systemd-run's -E/--setenv adds."""
    out = {}
    for pair in _pairs(line, ("--setenv", "-E")):
        name, _, value = pair.partition("=")
        out[name] = value if value or "=" in pair else os.environ.get(name, "")
    return out


def find_command(command: Sequence[str]) -> int:
    """0 when ``command`` can be run; else the exit code, with the reason printed."""
    name = command[0]
    path = name if "/" in name else shutil.which(name)
    if path is None or not os.path.exists(path):
        print(f"cpuservice-run: {name}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        print(f"cpuservice-run: {name}: cannot run it (not an executable file)",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    return 0


async def prepare(args: argparse.Namespace) -> tuple[str, str]:
    """Allocate, attach this process to the allocation's slice; (name, slice)."""
    name = args.name or f"run-{os.getpid()}"
    options = options_of(args) | {"lifetime": "unit"}
    try:
        client = await Client.connect(args.bus_address, interactive=not args.no_ask_password)
    except (OSError, ConnectionError) as exc:
        raise ConnectionError(explain_connect(exc, args.bus_address)) from None
    try:
        with polkit_agent(not args.no_ask_password):
            path = await client.allocate(name, args.cpus, options)
            try:
                slice_unit = (await client.properties(path, ALLOCATION))["Unit"]
                await client.attach(name, [os.getpid()])
            except BaseException:
                await client.release(name)
                raise
        return name, str(slice_unit)
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        line = scan(sys.argv[1:] if argv is None else argv)
    except Usage as exc:
        print(f"cpuservice-run: {exc}", file=sys.stderr)
        return EXIT_WRAPPER
    args = parser().parse_args(line.ours)
    if not line.command:
        parser().error("no command to run")
    if args.service and args.scope:
        parser().error("--service and --scope exclude each other")
    missing = find_command(line.command)
    if missing:
        return missing
    try:
        podman.run_index(line.command, root=os.geteuid() == 0 and not _other_user(line),
                         env={**os.environ, **_setenv(line)})
        near_from_devices(args, line.command)
    except (podman.PodmanUsage, Usage) as exc:
        print(f"cpuservice-run: {exc}", file=sys.stderr)
        return EXIT_WRAPPER
    try:
        _, slice_unit = asyncio.run(prepare(args))
    except dbuscall.CallError as exc:
        print(f"cpuservice-run: {explain(exc, not args.no_ask_password)}", file=sys.stderr)
        return EXIT_WRAPPER
    except (OSError, ConnectionError, EOFError) as exc:
        print(f"cpuservice-run: {exc}", file=sys.stderr)
        return EXIT_WRAPPER
    except KeyboardInterrupt:
        return EXIT_WRAPPER
    mode = ["--service", "--wait"] if args.service else ["--scope"]
    if args.no_ask_password:
        mode.append("--no-ask-password")
    try:
        os.execvp("systemd-run", ["systemd-run", *mode, f"--slice={slice_unit}",
                                  *line.passthrough, "--",
                                  *podman.with_slice(line.command, slice_unit)])
    except OSError as exc:
        print(f"cpuservice-run: cannot start systemd-run: {exc}", file=sys.stderr)
        return EXIT_WRAPPER
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
