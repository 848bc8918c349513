"""How allocations fare, for cpuservicectl (issue 39): the Manager's GetStatistics in batches,
the figures as ``status NAME`` prints them, and ``show NAME`` (an allocation's properties and
its figures); ``top`` is in ctl_top."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from cpuservice.cli.client import EXIT_USAGE, Client, unwrap
from cpuservice.cli.ctl_output import JsonMode, cpu_time, dumps, show_value
from cpuservice.host import dbuscall
from cpuservice.model.figures import FIGURES, MAX_NAMES, show_name

UNKNOWN_METHOD = "org.freedesktop.DBus.Error.UnknownMethod"
SHOW_NAMES = {show_name(key): key for key, _, _ in FIGURES}  # show's name -> the key
NOT_SET = "[not set]"  # as systemctl show prints a value it does not know


async def statistics(c: Client, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """name -> its figures (GetStatistics, MAX_NAMES at a time); empty from a daemon that has
    no GetStatistics (older than issue 39)."""
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(names), MAX_NAMES):
        try:
            (found,) = await c.call("GetStatistics", "as", [list(names[i:i + MAX_NAMES])])
        except dbuscall.CallError as exc:
            if exc.name == UNKNOWN_METHOD:
                return {}
            raise
        out.update({str(n): unwrap(v) for n, v in found.items()})
    return out


def shown(figures: Mapping[str, Any] | None) -> dict[str, Any]:
    """The figures by the names ``show`` prints (None where unknown)."""
    figures = figures or {}
    return {name: figures.get(key) for name, key in SHOW_NAMES.items()}


def size(n: int) -> str:
    """Bytes as systemctl status prints memory (``12.0K``, ``1.5G``)."""
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            return f"{int(value)}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"


def status_lines(f: Mapping[str, Any], memory_nodes: str) -> list[tuple[str, str]]:
    """The figures as ``status NAME`` prints them (label, value); what is unknown says so."""
    unreadable = list(f.get("unreadable") or ())
    lines = []
    if "cpu-usage-usec" in f:
        lines.append(("CPU", f"{cpu_time(int(f['cpu-usage-usec']))}"
                      + (f" (user {cpu_time(int(f['cpu-user-usec']))}, system "
                         f"{cpu_time(int(f['cpu-system-usec']))})"
                         if "cpu-user-usec" in f and "cpu-system-usec" in f else "")))
    if "cpu-pressure-some-avg10" in f:
        full = (f", full {f['cpu-pressure-full-avg10']:.2f}% {f['cpu-pressure-full-avg60']:.2f}%"
                if "cpu-pressure-full-avg10" in f else "")
        lines.append(("Pressure", f"some {f['cpu-pressure-some-avg10']:.2f}% "
                      f"{f['cpu-pressure-some-avg60']:.2f}%{full} (avg10 avg60; waited "
                      f"{cpu_time(int(f['cpu-pressure-some-total-usec']))} in all)"))
    else:
        lines.append(("Pressure", "unknown (cpu.pressure cannot be read: cgroup v1 or hybrid, "
                      "or the unit is not running)"))
    if f.get("cpu-periods") == 0:  # the cpu controller counts, but no quota was enforced
        lines.append(("Throttled", "never (no CPU quota)"))
    elif "cpu-throttled-periods" in f and "cpu-periods" in f:
        lines.append(("Throttled", f"{f['cpu-throttled-periods']} of {f['cpu-periods']} periods, "
                      f"{cpu_time(int(f.get('cpu-throttled-usec', 0)))}"))
    if "memory-remote-percent" in f:
        lines.append(("Remote memory", f"{f['memory-remote-percent']:.1f}% "
                      f"({size(int(f['memory-remote-bytes']))} of "
                      f"{size(int(f['memory-remote-bytes']) + int(f['memory-local-bytes']))} "
                      f"outside nodes {memory_nodes or '-'})"))
    elif "memory.numa_stat" in unreadable:
        lines.append(("Remote memory", "unknown (memory.numa_stat cannot be read)"))
    return lines


async def for_show(c: Client, name: str, wanted: Sequence[str]) -> dict[str, Any]:
    """``show``'s values: the allocation's properties and, when all of them or one of the
    figures is wanted, its figures by their show names (None where unknown; none at all from
    a daemon without GetStatistics)."""
    props = await c.allocation(name)
    props.pop("Path")
    if wanted and not any(w in SHOW_NAMES for w in wanted):
        return props
    found = await statistics(c, [name])
    return props | shown(found[name]) if name in found else props


def _wanted(args: argparse.Namespace) -> list[str]:
    return [p for item in args.property for p in item.split(",") if p]


async def show(c: Client, args: argparse.Namespace) -> int:
    """``show NAME [-p PROPERTY]... [--value]``: as systemctl show prints a unit."""
    props = await for_show(c, args.name, _wanted(args))
    wanted = _wanted(args) or sorted(props)
    unknown = [p for p in wanted if p not in props]
    if unknown:
        print(f"cpuservicectl: no property {', '.join(unknown)}; known: "
              f"{', '.join(sorted(props))}", file=sys.stderr)
        return EXIT_USAGE
    if args.json_mode is not JsonMode.OFF:
        print(dumps({k: props[k] for k in wanted}, args.json_mode))
        return 0
    for key in wanted:
        value = show_value(key, props[key])
        print(value if args.value else f"{key}={value}")
    return 0


GUARD = "admission-guard"  # GetHostPressure's entry of the guard (cpuservice.bus.statistics)


async def host_pressure(c: Client) -> dict[str, dict[str, Any]] | None:
    """The Manager's GetHostPressure (the shared pool's holders, the admission guard); None
    from a daemon that has none."""
    try:
        (found,) = await c.call("GetHostPressure", "", [])
    except dbuscall.CallError as exc:
        if exc.name == UNKNOWN_METHOD:
            return None
        raise
    return {str(n): unwrap(v) for n, v in found.items()}


def host_lines(reply: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """``status``'s lines of the host's pressure and the guard (label, value)."""
    shown = []
    for name, f in reply.items():
        if name == GUARD:
            continue
        if "cpu-pressure-some-avg10" in f:
            shown.append(f"{name} some {f['cpu-pressure-some-avg10']:.2f}% "
                         f"{f['cpu-pressure-some-avg60']:.2f}%")
        else:
            shown.append(f"{name} unknown")
    lines = [("Pressure", "; ".join(shown) + " (avg10 avg60)")]
    g = reply.get(GUARD) or {}
    limit = f"above {g.get('limit-percent', 0):g}% per {int(g.get('window-usec', 0)) // 10**6} s"
    if not g.get("enabled"):
        lines.append(("Guard", "off (admission_guard_percent = 0)"))
    elif not g.get("available"):
        lines.append(("Guard", f"unavailable, admits everything: {g.get('unavailable', '')}"))
    elif g.get("starving"):
        lines.append(("Guard", f"STARVING for {int(g['starving-usec']) / 1e6:.0f} s "
                      f"({', '.join(g.get('cgroups', []))} {limit}): requests that take "
                      "shared CPUs are refused"))
    else:
        lines.append(("Guard", f"admitting (refuses while the pressure is {limit})"))
    return lines
