"""``cpuservicectl top``: every allocation, how much CPU it uses, how much it waits for one and how
often its quota throttles it, refreshed every second like systemd-cgtop (issue 39).

Each refresh is two reads: the allocations' properties (GetManagedObjects) and their figures
(GetStatistics, 512 at a time). CPU use and throttling are rates between two refreshes, so the
first refresh shows "-" for them, as systemd-cgtop's does; pressure is the kernel's own 10 s
average. ``-b`` prints plain tables one after the other (for scripts), ``-n N`` stops after N
refreshes, ``-o json`` prints one JSON object per refresh."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cpuservice.cli import ctl_figures
from cpuservice.cli.client import Client
from cpuservice.cli.ctl_output import JsonMode, dumps, table
from cpuservice.model.figures import rates
from cpuservice.model.health import REASONS

ORDERS = ("cpu", "pressure", "throttled", "name", "cpus")
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _delay(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0.1 to 3600 seconds")
    return value


def add_parser(sub: Any) -> None:
    top = sub.add_parser("top", help="every allocation's CPU use, pressure and throttling, "
                         "refreshed like systemd-cgtop")
    top.add_argument("-b", "--batch", action="store_true",
                     help="plain tables one after the other, no screen handling (for scripts)")
    top.add_argument("-n", "--iterations", type=_positive_int, metavar="N",
                     help="stop after N refreshes (default: run until interrupted)")
    top.add_argument("-d", "--delay", type=_delay, default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (default 1)")
    top.add_argument("--order", choices=ORDERS, default="cpu",
                     help="sort by CPU use (default), pressure, throttling, name or CPUs")


@dataclass(frozen=True)
class Row:
    name: str
    cpus: str
    cpuset: str
    cpu_percent: float | None  # of one CPU's time, as systemd-cgtop: 250 = 2.5 CPUs busy
    pressure: float | None  # cpu.pressure some avg10, percent
    throttled: float | None  # percent of the quota's periods since the last refresh
    lent: str
    health: str
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"Name": self.name, "CPUs": self.cpus, "CPUSet": self.cpuset,
                "CPUPercent": self.cpu_percent, "PressureSomeAvg10": self.pressure,
                "ThrottledPercent": self.throttled, "LentCPUs": self.lent,
                "Health": self.health, "HealthReason": self.reason}


def rows(allocations: Sequence[Mapping[str, Any]], before: Mapping[str, Mapping[str, Any]],
         after: Mapping[str, Mapping[str, Any]]) -> list[Row]:
    """One row per allocation, from its properties and two readings of its figures."""
    out = []
    for a in allocations:
        name = str(a["Name"])
        now = after.get(name, {})
        r = rates(before.get(name), now) if now else rates(None, {})
        out.append(Row(name, str(a["CPUs"]), str(a["CPUSet"]),
                       None if r.cpus_used is None else 100 * r.cpus_used,
                       now.get("cpu-pressure-some-avg10"), r.throttled_percent,
                       str(a.get("LentCPUs", "")), str(a.get("Health", "ok")),
                       str(a.get("HealthReason", ""))))
    return out


def ordered(found: Sequence[Row], order: str) -> list[Row]:
    """Largest first (unknown last), then by name; by name or requested CPUs ascending."""
    if order == "name":
        return sorted(found, key=lambda r: r.name)
    if order == "cpus":
        return sorted(found, key=lambda r: (-float(r.cpus), r.name))
    attr = {"cpu": "cpu_percent", "pressure": "pressure", "throttled": "throttled"}[order]

    def key(r: Row) -> tuple[bool, float, str]:
        value = getattr(r, attr)
        return (value is None, -(value or 0.0), r.name)
    return sorted(found, key=key)


def health_word(health: str, reason: str) -> str:
    """The HEALTH column: ok, degraded, or the reasons its figures raised (pressured, ...)."""
    raised = [r for r in REASONS if any(part.startswith(f"{r}:")
                                        for part in reason.split("; "))]
    if health != "ok" and raised:
        return ",".join(raised) + ("" if len(raised) == len(reason.split("; ")) else
                                   ",degraded")
    return health


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def text(found: Sequence[Row], legend: bool = True) -> str:
    out = [("NAME", "CPUS", "CPUSET", "%CPU", "PRESSURE%", "THROTTLED%", "LENT", "HEALTH")]
    out += [(r.name, r.cpus, r.cpuset or "-", _num(r.cpu_percent, 1), _num(r.pressure, 2),
             _num(r.throttled, 1), r.lent or "-", health_word(r.health, r.reason))
            for r in found]
    return table(out, legend)


async def top(c: Client, args: argparse.Namespace,
              sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> int:
    live = sys.stdout.isatty() and not args.batch and args.json_mode is JsonMode.OFF
    before: dict[str, dict[str, Any]] = {}
    done = 0
    while args.iterations is None or done < args.iterations:
        if done:
            await sleep(args.delay)
        allocations = await c.allocations()
        after = await ctl_figures.statistics(c, [str(a["Name"]) for a in allocations])
        found = ordered(rows(allocations, before, after), args.order)
        before, done = after, done + 1
        now = time.time()
        if args.json_mode is not JsonMode.OFF:
            print(dumps({"realtime_usec": int(now * 1e6),
                         "allocations": [r.as_json() for r in found]}, args.json_mode),
                  flush=True)
            continue
        if live:
            size = shutil.get_terminal_size()
            head = (f"cpuservice top: {len(found)} allocation(s), "
                    f"{time.strftime('%H:%M:%S', time.localtime(now))}, by {args.order}, "
                    f"every {args.delay:g}s; Ctrl-C quits")
            lines = text(found, not args.no_legend).splitlines()[:max(1, size.lines - 2)]
            print(CLEAR + head[:size.columns] + "\n" + "\n".join(lines), flush=True)
        else:
            print(("\n" if done > 1 else "") + text(found, not args.no_legend), flush=True)
    return 0
