"""cpuservice-run: run a command on allocated CPUs through the real systemd-run.

    cpuservice-run [--cpus N] [--bind] [policy options] [--name NAME] [systemd-run options] \\
        -- COMMAND [ARG...]

It allocates with lifetime=unit, moves itself into a scope in the allocation's slice (so the
slice is never empty from then on), then becomes ``systemd-run --scope --slice=...`` (or
``--service --wait`` with --service), which moves the command into its own scope in that slice.
The daemon releases the allocation when the slice has no process left: when the command ends, is
killed, or this wrapper is SIGKILLed before starting it. The exit status is the command's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from . import __version__, dbuscall
from .client import ALLOCATION, EXIT_FAILURE, Client, exit_code
from .ctl import add_option_args, options_of


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpuservice-run", usage="cpuservice-run [OPTIONS] [systemd-run OPTIONS] -- COMMAND",
        description="Run COMMAND on CPUs allocated by cpuserviced, released when it ends.")
    p.add_argument("--cpus", default="1", help="CPU amount (default 1)")
    add_option_args(p)
    p.add_argument("--name", help="allocation name (default run-PID)")
    p.add_argument("--service", action="store_true",
                   help="run as a transient service (systemd-run --service --wait)")
    p.add_argument("--scope", action="store_true", help="run in a transient scope (default)")
    p.add_argument("--no-ask-password", action="store_true")
    p.add_argument("--bus-address", help="D-Bus address instead of the system bus")
    p.add_argument("--version", action="version", version=__version__)
    return p


def split(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(our options, systemd-run options, command)."""
    argv = list(argv)
    if "--" not in argv:
        if {"-h", "--help", "--version"} & set(argv):
            parser().parse_args(argv)  # prints and exits
        parser().error("missing -- before the command")
    cut = argv.index("--")
    ours, passthrough = parser().parse_known_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        parser().error("no command after --")
    return ours, passthrough, command


async def prepare(args: argparse.Namespace) -> tuple[str, str]:
    """Allocate, attach this process to the allocation's slice; (name, slice)."""
    name = args.name or f"run-{os.getpid()}"
    options = options_of(args) | {"lifetime": "unit"}
    client = await Client.connect(args.bus_address, interactive=not args.no_ask_password)
    try:
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
    args, passthrough, command = split(sys.argv[1:] if argv is None else argv)
    try:
        _, slice_unit = asyncio.run(prepare(args))
    except dbuscall.CallError as exc:
        print(f"cpuservice-run: {exc.text}", file=sys.stderr)
        return exit_code(exc)
    except (OSError, ConnectionError) as exc:
        print(f"cpuservice-run: cannot reach cpuserviced: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    mode = ["--service", "--wait"] if args.service else ["--scope"]
    if args.no_ask_password:
        mode.append("--no-ask-password")
    try:
        os.execvp("systemd-run", ["systemd-run", *mode, f"--slice={slice_unit}", *passthrough,
                                  "--", *command])
    except OSError as exc:
        print(f"cpuservice-run: cannot start systemd-run: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
