"""cpuservicectl defrag and movable: moving movable allocations (issue 27)."""

from __future__ import annotations

import argparse
from typing import Any

from cpuservice.cli.client import Client
from cpuservice.cli.ctl_output import JsonMode, dumps, table
from cpuservice.model.vocab import Movable

COMMANDS = ("defrag", "movable")


def add_parsers(sub: Any) -> None:
    defrag = sub.add_parser("defrag", help="move movable allocations so that free CPUs form "
                            "whole cores")
    defrag.add_argument("--dry-run", action="store_true",
                        help="only show which allocations would move where")
    movable = sub.add_parser("movable", help="whether an allocation may be moved")
    movable.add_argument("name")
    movable.add_argument("value", choices=[str(m) for m in Movable], metavar="VALUE",
                         help=", ".join(str(m) for m in Movable))


def moves_text(moves: list[list[str]], dry_run: bool, legend: bool) -> str:
    """The plan, one move per line (empty: nothing to move)."""
    if not moves:
        return "nothing to move: no move of a movable allocation frees a whole core"
    rows = [["ALLOCATION", "FROM", "TO"], *([n, old, new] for n, old, new in moves)]
    text = table(rows, legend)
    if legend:
        count = f"{len(moves)} move{'' if len(moves) == 1 else 's'}"
        text += f"\n\n{count} {'would be made (dry run)' if dry_run else 'made'}."
    return text


async def defrag(c: Client, args: argparse.Namespace, mode: JsonMode | None) -> int:
    (moves,) = await c.call("Defragment", "b", [args.dry_run])
    moves = [list(m) for m in moves]  # dbus-fast 1.84 gives lists, later ones tuples
    if mode is not None:
        print(dumps([{"allocation": n, "from": old, "to": new} for n, old, new in moves], mode))
    elif not args.quiet or moves:
        print(moves_text(moves, args.dry_run, not args.no_legend))
    return 0


async def movable(c: Client, args: argparse.Namespace) -> int:
    await c.call("SetMovable", "ss", [args.name, args.value])
    return 0
