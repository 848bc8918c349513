"""cpuservicectl lend: whether a bound allocation lends its idle whole cores (issue 26)."""

from __future__ import annotations

import argparse
from typing import Any

from cpuservice.cli.client import Client

COMMANDS = ("lend",)


def add_parsers(sub: Any) -> None:
    lend = sub.add_parser("lend", help="whether a bound allocation lends its idle whole cores "
                          "to borrowers")
    lend.add_argument("name")
    lend.add_argument("value", choices=("on", "off"), metavar="on|off",
                      help="on: lend them while it is idle; off: take them back now")


async def lend(c: Client, args: argparse.Namespace) -> int:
    await c.call("SetLending", "sb", [args.name, args.value == "on"])
    return 0
