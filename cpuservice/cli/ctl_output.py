"""How cpuservicectl writes: JSON modes, values as systemctl prints them, tables, user names,
colour and the pager. Pure helpers plus the pager (a child process on a terminal)."""

from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, TextIO

from cpuservice.cli.client import NO_QUOTA, UNLIMITED

# D-Bus values that mean "none" or "no limit": JSON says null instead
SENTINELS = {"CPUQuotaPerSecUSec": NO_QUOTA, "cpu-quota-per-sec-usec": NO_QUOTA,
             "fragment-cpu": -1, "capacity": UNLIMITED,
             # systemd's "not counted" for a unit's accounting
             "TasksCurrent": NO_QUOTA, "CPUUsageNSec": NO_QUOTA, "MemoryCurrent": NO_QUOTA}


class JsonMode(StrEnum):
    """--json=MODE (and -o): as systemd's tools name them."""

    OFF = "off"
    SHORT = "short"
    PRETTY = "pretty"


# yaml: export only (cpuservicectl refuses it for the other commands)
OUTPUTS = {"text": JsonMode.OFF, "json": JsonMode.SHORT, "json-pretty": JsonMode.PRETTY,
           "yaml": JsonMode.OFF}


def json_mode(value: str | None, output: str | None, terminal: bool) -> JsonMode:
    """The JSON mode from --json / -j (``auto``: pretty on a terminal, short otherwise, as
    systemd's -j) and -o; the last word wins only in that -o is an alias."""
    if output is not None:
        return OUTPUTS[output]
    if value is None:
        return JsonMode.OFF
    if value == "auto":
        return JsonMode.PRETTY if terminal else JsonMode.SHORT
    return JsonMode(value)


def nulls(value: Any) -> Any:
    """A JSON-ready copy with the D-Bus sentinels (2^64-1 for no quota, ...) as null."""
    if isinstance(value, Mapping):
        return {str(k): None if SENTINELS.get(str(k)) == v and not isinstance(v, bool)
                else nulls(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nulls(v) for v in value]
    return value


def dumps(value: Any, mode: JsonMode) -> str:
    if mode is JsonMode.PRETTY:
        return json.dumps(nulls(value), indent=2, sort_keys=True, ensure_ascii=False)
    return json.dumps(nulls(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def timespan(usec: int) -> str:
    """A duration in microseconds the way systemd prints one (``1s 500ms``); ``infinity`` for
    the no-limit sentinel."""
    if usec == NO_QUOTA:
        return "infinity"
    if usec == 0:
        return "0"
    parts = []
    for unit, size in (("h", 3_600_000_000), ("min", 60_000_000), ("s", 1_000_000),
                       ("ms", 1000), ("us", 1)):
        if usec >= size:
            parts.append(f"{usec // size}{unit}")
            usec %= size
    return " ".join(parts)


def cpu_time(usec: int) -> str:
    """CPU time to the millisecond, as systemctl status prints it (``796ms``, ``1.796s``,
    ``2min 3.5s``)."""
    ms = round(usec / 1000)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    return " ".join(part for part in (f"{hours}h" if hours else "",
                                      f"{minutes}min" if minutes else "", seconds) if part)


def percent(usec: int) -> str:
    """A CPU quota per second as a percentage (``150%``), or ``none``."""
    return "none" if usec == NO_QUOTA else f"{usec / 10_000:g}%"


def shares(value: Mapping[Any, int]) -> str:
    return ",".join(f"{cpu}:{n}" for cpu, n in sorted((int(c), n) for c, n in value.items())) \
        or "-"


def show_value(key: str, value: Any) -> str:
    """A property's value as ``show`` prints it (systemctl show's habits)."""
    if key == "Shares":
        return shares(value)
    if key == "CPUQuotaPerSecUSec":
        return timespan(int(value))
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:  # a figure that is not known (GetStatistics)
        return "[not set]"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def table(rows: Sequence[Sequence[str]], legend: bool = True) -> str:
    """Columns padded to their widest cell; without the header when ``legend`` is false."""
    if not legend:
        rows = rows[1:]
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def colour_wanted(stream: TextIO, disabled: bool) -> bool:
    """Colour on a terminal unless --no-color, NO_COLOR, SYSTEMD_COLORS=0 or TERM=dumb."""
    if disabled or "NO_COLOR" in os.environ or os.environ.get("TERM") == "dumb":
        return False
    forced = os.environ.get("SYSTEMD_COLORS")
    if forced is not None:
        return forced.lower() not in ("0", "no", "false", "off")
    return stream.isatty()


def unicode_wanted(stream: TextIO) -> bool:
    """Whether line drawing characters may be used, as systemd decides: the locale the user
    set (LC_ALL, else LC_CTYPE, else LANG) is UTF-8, or none is set (the implicit C locale:
    terminals do UTF-8 nowadays); and the stream can encode them."""
    for var in ("LC_ALL", "LC_CTYPE", "LANG"):
        value = os.environ.get(var)
        if value:
            if "utf8" not in value.lower().replace("-", ""):
                return False
            break
    try:
        "└─".encode(stream.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def pager_command() -> str | None:
    """The pager systemctl would start: $SYSTEMD_PAGER, else $PAGER, else less/more; none
    when that is empty or ``cat``."""
    for var in ("SYSTEMD_PAGER", "PAGER"):
        if var in os.environ:
            value = os.environ[var].strip()
            return None if value in ("", "cat") else value
    for candidate in ("less", "more"):
        if shutil.which(candidate):
            return candidate
    return None


@contextmanager
def paged(enabled: bool) -> Iterator[None]:
    """Collect what is printed, then show it through the pager when standard output is a
    terminal and paging is enabled (less gets LESS=FRSXMK, so a short text just prints);
    otherwise print it as it comes."""
    command = pager_command() if enabled and sys.stdout.isatty() else None
    if command is None:
        yield
        return
    real, buffer = sys.stdout, io.StringIO()
    sys.stdout = buffer
    try:
        yield
    finally:
        sys.stdout = real
        _page(command, buffer.getvalue())


def _page(command: str, text: str) -> None:
    env = dict(os.environ)
    env.setdefault("LESS", os.environ.get("SYSTEMD_LESS", "FRSXMK"))
    env.setdefault("LESSCHARSET", "utf-8")
    try:
        pager = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, env=env)
    except OSError:
        sys.stdout.write(text)
        return
    assert pager.stdin is not None
    try:
        pager.stdin.write(text.encode())
        pager.stdin.close()
    except BrokenPipeError:  # the reader quit early (q in less)
        pass
    try:
        pager.wait()
    except KeyboardInterrupt:
        pager.wait()
