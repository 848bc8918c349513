"""cpuservicectl export nrt: the machine as a Kubernetes NodeResourceTopology object (the
Manager's ExportNodeResourceTopology), as YAML (the default) or JSON; with --watch, a new object
after every committed change, at most once a second, and once a minute regardless (the resync
publishers of NRT objects do), so that ``cpuservicectl export nrt --watch | <publisher>`` keeps
the cluster's copy current. When to print is decided by Pacer, on an injected clock."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dbus_fast import Message, MessageType

from cpuservice.cli.client import DEST, NOT_RUNNING, PATH, Client, explain
from cpuservice.cli.ctl_output import JsonMode
from cpuservice.host import dbuscall

KINDS = ("nrt",)
MIN_INTERVAL = 1.0  # seconds between two objects printed for changes
RESYNC = 60.0  # seconds after which an object is printed whether or not anything changed


class Pacer:
    """When --watch fetches and prints: at once, then after a change (a signal of the service)
    but not sooner than ``min_interval`` after the last fetch, and ``resync`` after the last
    print in any case. A fetch after a signal prints only an object that differs from the last
    one printed (a signal need not be a change); the resync prints it regardless. ``clock`` is
    monotonic seconds (injected: the tests drive it)."""

    def __init__(self, clock: Callable[[], float], min_interval: float = MIN_INTERVAL,
                 resync: float = RESYNC) -> None:
        self.clock = clock
        self.min_interval = min_interval
        self.resync = resync
        self.last: float | None = None  # the last fetch
        self.last_shown: float | None = None  # the last print
        self.dirty = False
        self.shown: object = None  # the last object printed

    def resync_due(self) -> bool:
        """The minute is over (or nothing was printed yet): print even what did not change."""
        return self.last_shown is None or self.clock() - self.last_shown >= self.resync

    def changed(self) -> None:
        """Something was committed (a signal of the service arrived)."""
        self.dirty = True

    def due(self) -> bool:
        if self.last is None or self.resync_due():
            return True
        return self.dirty and self.clock() - self.last >= self.min_interval

    def printed(self) -> None:
        """An object is about to be fetched: changes after this need another fetch."""
        self.last = self.clock()
        self.dirty = False

    def show(self, obj: object, forced: bool) -> bool:
        """Whether to print ``obj`` (fetched; ``forced``: the resync); remembers it if so."""
        if not forced and obj == self.shown:
            return False
        self.shown, self.last_shown = obj, self.clock()
        return True

    def failed(self) -> None:
        """The fetch failed (the daemon is away): try again at the next signal, or after the
        resync interval, not at once."""
        self.last_shown = self.clock()

    def wait(self) -> float:
        """Seconds until due() may turn true without another change (0: due now)."""
        if self.last is None or self.last_shown is None:
            return 0.0
        now = self.clock()
        until = self.last_shown + self.resync
        if self.dirty:
            until = min(until, self.last + self.min_interval)
        return max(0.0, until - now)


def yaml(value: Any, indent: int = 0) -> str:
    """``value`` (JSON values) as block-style YAML; strings double-quoted in JSON's escapes,
    which YAML reads the same way, so no value is ever read as another type."""
    return "\n".join(_yaml_lines(value, indent))


def _scalar(value: Any) -> str:
    return json.dumps(value)  # strings, numbers, true/false, null: YAML reads these alike


def _empty_or_scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    return "[]" if isinstance(value, list) else _scalar(value)


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:")
                lines += _yaml_lines(item, indent + 2)
            else:
                lines.append(f"{pad}{key}: {_empty_or_scalar(item)}")
    elif isinstance(value, list):
        for item in value:
            inner = _yaml_lines(item, indent + 2) if isinstance(item, (dict, list)) and item \
                else [f"{pad}  {_empty_or_scalar(item)}"]
            lines.append(f"{pad}- {inner[0][indent + 2:]}")
            lines += inner[1:]
    else:
        lines.append(f"{pad}{_scalar(value)}")
    return lines


def render(obj: Any, args: argparse.Namespace) -> str:
    """One object as asked: JSON with -o json/json-pretty, --json or -j; YAML otherwise (a
    document of its own, so that a stream of them is a stream of YAML documents)."""
    if args.json_mode is not JsonMode.OFF:
        if args.json_mode is JsonMode.PRETTY:
            return json.dumps(obj, indent=2)
        return json.dumps(obj, separators=(",", ":"))
    return f"---\n{yaml(obj)}"


def add_parser(sub: Any) -> None:
    export = sub.add_parser("export", help="the machine as a Kubernetes object (nrt: "
                            "NodeResourceTopology v1alpha2)")
    export.add_argument("kind", choices=KINDS, metavar="KIND",
                        help="nrt: NodeResourceTopology (topology.node.k8s.io/v1alpha2)")
    export.add_argument("--node-name", default="", metavar="NAME",
                        help="the object's name (default: this host's name, lower-cased)")
    export.add_argument("--watch", action="store_true",
                        help="a new object on every change (at most 1/s), and every minute")


def check_output(args: argparse.Namespace) -> str | None:
    """-o yaml is for export only: the error to give for any other command."""
    if args.output == "yaml" and args.command != "export":
        return "-o yaml is only for export; use -o json, -o json-pretty or -o text"
    return None


async def export(c: Client, args: argparse.Namespace) -> int:
    async def fetch() -> Any:
        (text,) = await c.call("ExportNodeResourceTopology", "s", [args.node_name])
        return json.loads(text)

    if not args.watch:
        print(render(await fetch(), args))
        return 0
    pacer, wake = Pacer(time.monotonic), asyncio.Event()
    owner = dbuscall.NameOwner(c.bus, DEST)
    await owner.follow()
    await dbuscall.call(c.bus, *dbuscall.BUS, "AddMatch", "s",
                        [f"type='signal',sender='{DEST}',path_namespace='{PATH}'"])

    def on(msg: Message) -> bool:
        restarted = msg.sender == dbuscall.BUS[0] and msg.member == "NameOwnerChanged" \
            and msg.body and msg.body[0] == DEST and msg.body[2]
        if msg.message_type == MessageType.SIGNAL and (owner.sent(msg) or restarted):
            pacer.changed()
            wake.set()
        return False

    async def sleep(seconds: float) -> None:
        """Until a change, or ``seconds``."""
        wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), seconds)

    c.bus.add_message_handler(on)
    await follow(pacer, fetch, lambda obj: print(render(obj, args), flush=True), sleep)
    return 0


async def follow(pacer: Pacer, fetch: Callable[[], Awaitable[Any]],
                 emit: Callable[[Any], None], sleep: Callable[[float], Awaitable[None]],
                 rounds: int | None = None) -> None:
    """--watch's loop: fetch and emit an object whenever the pacer says so, else sleep until
    a change or until it may say so (``rounds``: stop after that many, for the tests). While
    the daemon is not there (a restart), it says so once on standard error and goes on."""
    failing = ""
    while rounds is None or rounds > 0:
        rounds = None if rounds is None else rounds - 1
        if pacer.due():
            forced = pacer.resync_due()
            pacer.printed()
            try:
                obj = await fetch()
            except dbuscall.CallError as exc:
                if not exc.name.startswith(NOT_RUNNING):
                    raise
                pacer.failed()
                if failing != exc.name:
                    print(f"cpuservicectl: {explain(exc, False)}; retrying", file=sys.stderr)
                failing = exc.name
            else:
                failing = ""
                if pacer.show(obj, forced):
                    emit(obj)
        await sleep(pacer.wait())
