"""Daemon configuration: ``cpuservice.toml`` plus drop-ins, found as systemd finds its own
configuration files (see cpuservice.toml(5)):

- the main file is the first ``cpuservice.toml`` of DIRS, in their order of priority: local
  (``/etc/cpuservice``), runtime (``/run/cpuservice``), then the vendor's (``/usr/local/lib``,
  ``/usr/lib``); it masks the others;
- drop-ins are the ``cpuservice.toml.d/*.toml`` (or ``*.conf``) files of all of DIRS, a file in a
  directory of higher priority masking one of the same name in a lower (an empty file or a link
  to /dev/null masks and adds nothing); they are applied in the order of their file names,
  whatever their directory, so a later name wins.

``cpuserviced --config PATH`` reads just PATH and ``PATH.d/``. Every error names the file (a
drop-in's error the drop-in) and the key.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictStr, confloat, conint

from cpuservice.model import compat, keep
from cpuservice.model.cpuset import CPUSet, CPUSetError
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.health import Limits
from cpuservice.model.request import OPTION_KEYS, Options, parse_options
from cpuservice.model.starvation import Guard

NAME = "cpuservice.toml"
# highest priority first, as systemd orders /etc, /run and /usr/lib for its own configuration
DIRS = (Path("/etc/cpuservice"), Path("/run/cpuservice"), Path("/usr/local/lib/cpuservice"),
        Path("/usr/lib/cpuservice"))
DROPIN_SUFFIXES = (".toml", ".conf")
PER_REQUEST_ONLY = ("cpuset", "unit", "near")
_CPU_LIMIT = re.compile(r"[0-9]{1,6}(\.[0-9]{1,3})?%?")
# the default paths, which the errors about the keys offer as the fix
STATE_EXAMPLE = "/var/lib/cpuservice/state.json"
METRICS_EXAMPLE = "/var/lib/prometheus/node-exporter/cpuservice.prom"
HEALTH_NUMBERS = ("health_pressure_percent", "health_throttled_percent",
                  "health_memory_remote_percent", "health_seconds", "admission_guard_percent",
                  "admission_guard_hold_seconds")


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file and the key."""


class Config(compat.StrictModel):
    sysfs_root: StrictStr = "/sys"
    procfs_root: StrictStr = "/proc"  # only /proc/driver/nvidia (option near) is read there
    state_file: StrictStr = STATE_EXAMPLE
    reserved_cpus: StrictStr = ""
    min_shared_cpus: conint(strict=True, ge=1) = 1  # type: ignore[valid-type]
    granularity: Literal[100, 1000] = 100
    confine_host: StrictBool = False
    isolate_irqs: StrictBool = False
    isolate_workqueues: StrictBool = False
    max_allocations_per_user: conint(strict=True, ge=0) = 64  # type: ignore[valid-type]
    max_cpus_per_user: StrictStr = "50%"
    lifetime_grace_seconds: conint(strict=True, ge=1, le=86400) = 60  # type: ignore[valid-type]
    max_changes_per_user_per_minute: conint(  # type: ignore[valid-type]
        strict=True, ge=0, le=1_000_000) = 600
    metrics_file: StrictStr = METRICS_EXAMPLE
    # how often the daemon reads every allocation's figures (pressure, usage, throttling,
    # remote memory: issue 39) for its health and the metrics file (0: never by itself), and
    # the thresholds of the health reasons they raise, in percent (0: that reason is off), with
    # how long a figure must stay past its threshold (below half of it to clear the reason)
    statistics_seconds: conint(strict=True, ge=0, le=3600) = 10  # type: ignore[valid-type]
    health_pressure_percent: confloat(ge=0.0, le=100.0) = 20.0  # type: ignore[valid-type]
    health_throttled_percent: confloat(ge=0.0, le=100.0) = 20.0  # type: ignore[valid-type]
    health_memory_remote_percent: confloat(ge=0.0, le=100.0) = 20.0  # type: ignore[valid-type]
    health_seconds: confloat(ge=0.0, le=86400.0) = 30.0  # type: ignore[valid-type]
    # the admission guard (cpuservice.model.starvation): while the CPU pressure of the shared
    # pool's holders is above admission_guard_percent of a window of
    # admission_guard_window_seconds (the kernel's PSI trigger: some tasks waiting), an Allocate
    # or Resize that would take CPUs out of the shared pool is refused; the pressure counts as
    # gone once the kernel has not reported it for admission_guard_hold_seconds. 0: off
    admission_guard_percent: confloat(ge=0.0, le=100.0) = 0.0  # type: ignore[valid-type]
    admission_guard_window_seconds: Literal[2, 4, 6, 8, 10] = 2
    admission_guard_hold_seconds: confloat(ge=2.0, le=3600.0) = 10.0  # type: ignore[valid-type]
    max_moves_per_allocation_per_hour: conint(  # type: ignore[valid-type]
        strict=True, ge=0, le=3600) = 4
    # lending idle whole cores (option lend, cpuservice.model.lending): the owner's load on
    # them, in percent, above which they are withdrawn, below which they count as idle, and
    # for how long they must be idle before they are lent (again); how often the load is read
    lend_busy_percent: conint(strict=True, ge=1, le=100) = 20  # type: ignore[valid-type]
    lend_idle_percent: conint(strict=True, ge=1, le=99) = 5  # type: ignore[valid-type]
    lend_idle_seconds: confloat(ge=0.0, le=3600.0) = 2.0  # type: ignore[valid-type]
    lend_sample_ms: conint(strict=True, ge=10, le=1000) = 50  # type: ignore[valid-type]
    # whole cores kept next to devices for the allocations naming them (cpuservice.model.keep)
    keep_near: list[dict[str, Any]] = Field(default_factory=list)
    keep_near_others: Literal["never", "when-full"] = "never"
    defaults: dict[str, Any] = Field(default_factory=dict)

    def cpu_limit(self, online: int) -> Decimal | None:
        """The bound CPUs one unprivileged user may hold on ``online`` CPUs (None: no limit)."""
        text = self.max_cpus_per_user
        number = Decimal(text.rstrip("%"))
        if not number:  # 0, "0", "0.0", "0%": one meaning, no limit
            return None
        if text.endswith("%"):
            return Decimal(online) * number / 100
        return number

    @property
    def health_limits(self) -> Limits:
        return Limits(self.health_pressure_percent, self.health_throttled_percent,
                      self.health_memory_remote_percent, self.health_seconds)

    @property
    def guard(self) -> Guard:
        return Guard(self.admission_guard_percent, self.admission_guard_window_seconds,
                     self.admission_guard_hold_seconds)

    @property
    def reserved(self) -> CPUSet:
        return CPUSet.parse(self.reserved_cpus)

    @property
    def keep_rules(self) -> tuple[keep.Rule, ...]:
        return keep.rules(self.keep_near)

    @property
    def default_options(self) -> Options:
        return parse_options(self.defaults)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _dropins(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.name.endswith(DROPIN_SUFFIXES)
            and not p.name.startswith(".") and not p.is_dir()]


def sources(path: Path | str | None = None, dirs: Sequence[Path] = DIRS) -> list[Path]:
    """The files that make the configuration, in the order they apply: the main file (when
    there is one), then the drop-ins. ``path``: just that file and ``PATH.d/``."""
    if path is not None:
        main: Path | None = Path(path)
        found = {p.name: p for p in _dropins(Path(f"{path}.d"))}
    else:
        main = next((d / NAME for d in dirs if (d / NAME).exists()), None)
        found = {}
        for directory in reversed(dirs):  # lowest priority first: a higher one masks it
            found.update((p.name, p) for p in _dropins(directory / f"{NAME}.d"))
    head = [main] if main is not None and main.exists() else []
    return head + [found[name] for name in sorted(found)]


def load(path: Path | str | None = None, dirs: Sequence[Path] = DIRS) -> Config:
    """Read the main file (none: all defaults) and the drop-ins (see sources()). Each file is
    checked on its own first, so an error names the file that has it."""
    data: dict[str, Any] = {}
    files = sources(path, dirs)
    for source in files:
        extra = _read(source)
        validate(extra, str(source))
        data = _merge(data, extra)
    where = " + ".join(str(f) for f in files) or "the built-in defaults"
    return validate(data, where)


def validate(data: dict[str, Any], source: str = "config") -> Config:
    if isinstance(data.get("max_cpus_per_user"), int) and not isinstance(
            data["max_cpus_per_user"], bool):
        data = {**data, "max_cpus_per_user": str(data["max_cpus_per_user"])}
    idle = data.get("lend_idle_seconds")
    if idle is not None and (isinstance(idle, bool) or not isinstance(idle, int | float)):
        raise ConfigError(f"{source}: lend_idle_seconds: {idle!r} is not a number of seconds")
    for key in HEALTH_NUMBERS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigError(f"{source}: {key}: {value!r} is not a number")
    limit = data.get("max_cpus_per_user")
    if isinstance(limit, str) and not _CPU_LIMIT.fullmatch(limit):
        raise ConfigError(f"{source}: max_cpus_per_user: {limit!r} is not a number of CPUs "
                          "(e.g. 8) or a share of the online CPUs (e.g. \"50%\")")
    try:
        config = compat.load(Config, data)
    except compat.ValidationError as exc:
        raise ConfigError(f"{source}: {compat.describe(exc)}") from None
    try:
        config.reserved  # noqa: B018 - validates the cpu list
    except CPUSetError as exc:
        raise ConfigError(f"{source}: reserved_cpus: {exc}") from None
    try:
        config.keep_rules  # noqa: B018 - validates the [[keep_near]] entries
    except keep.RuleError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _check_state_file(config.state_file, source)
    limit_text = config.max_cpus_per_user
    if limit_text.endswith("%") and Decimal(limit_text[:-1]) > 100:
        raise ConfigError(f"{source}: max_cpus_per_user: {limit_text!r} is more than every "
                          "online CPU; use \"0\" for no limit")
    if config.metrics_file and not (config.metrics_file.startswith("/")
                                    and ".." not in Path(config.metrics_file).parts
                                    and config.metrics_file.endswith(".prom")):
        raise ConfigError(f"{source}: metrics_file: {config.metrics_file!r} is not an absolute "
                          "path (without ..) ending in .prom (the node exporter reads *.prom), "
                          "nor \"\" (off)")
    if config.metrics_file:
        _check_harmless("metrics_file", config.metrics_file, source, METRICS_EXAMPLE)
    if config.lend_idle_percent >= config.lend_busy_percent:
        raise ConfigError(f"{source}: lend_idle_percent: {config.lend_idle_percent} must be "
                          f"below lend_busy_percent ({config.lend_busy_percent}): between them "
                          "lent cores stay lent and withdrawn ones stay withdrawn")
    if config.admission_guard_percent and \
            config.admission_guard_hold_seconds < config.admission_guard_window_seconds:
        window = config.admission_guard_window_seconds
        raise ConfigError(f"{source}: admission_guard_hold_seconds: "
                          f"{config.admission_guard_hold_seconds:g} is shorter than "
                          f"admission_guard_window_seconds ({window}): the kernel reports a "
                          "lasting pressure once per window")
    for key in config.defaults:
        if key in PER_REQUEST_ONLY or key not in OPTION_KEYS:
            raise ConfigError(f"{source}: defaults.{key}: not an option that can have a default")
    try:
        config.default_options  # noqa: B018
    except InvalidArgument as exc:
        raise ConfigError(f"{source}: defaults: {exc}") from None
    return config


# temporary directories: cleaned behind the daemon's back, private to the unit (PrivateTmp), or
# writable by every user; the checkpoint must survive and be the daemon's alone
VOLATILE_DIRS = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
# where a file the daemon writes can harm the host: its configuration (/etc/cron.d,
# /etc/sudoers.d, ...), programs and libraries (/usr; /bin, /sbin and /lib* where they are not
# links into /usr), boot files, the kernel's interfaces and devices. The keys whose paths the
# daemon writes (state_file, with the files it keeps beside it, and metrics_file) are refused
# there, as they are written or as their links resolve; sysfs_root is only read.
SYSTEM_DIRS = tuple(Path(p) for p in ("/etc", "/usr", "/boot", "/proc", "/sys", "/dev", "/bin",
                                      "/sbin", "/lib", "/lib32", "/lib64", "/libx32"))


def _check_harmless(key: str, text: str, source: str, example: str) -> None:
    """A ConfigError when the absolute path ``text`` lies in SYSTEM_DIRS, as written or once
    its links are resolved (a link can lead from /var/lib into /etc)."""
    path = Path(text)
    for where in (path, Path(os.path.realpath(path))):
        system = next((d for d in SYSTEM_DIRS if where.is_relative_to(d)), None)
        if system is not None:
            via = "" if where == path else f" (its links lead to {where})"
            raise ConfigError(f"{source}: {key}: {text!r} is under {system}{via}, where a file "
                              f"the daemon writes can harm the host; use a path under /var/lib "
                              f"(e.g. {example})")


def _check_state_file(text: str, source: str) -> None:
    """state_file must be an absolute path of a file (not a directory) outside the temporary
    directories; what is wrong with it is a ConfigError that says what works."""
    path = Path(text)
    where = f"{source}: state_file: {text!r}"
    if not path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"{where} is not an absolute path (e.g. {STATE_EXAMPLE})")
    if any(path.is_relative_to(t) for t in VOLATILE_DIRS):
        raise ConfigError(f"{where} is under a temporary directory, which is cleaned and private "
                          f"to the service; use {STATE_EXAMPLE}")
    _check_harmless("state_file", text, source, STATE_EXAMPLE)
    if path.is_dir():
        raise ConfigError(f"{where} is a directory; name a file in it (e.g. {path}/state.json)")
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"{where}: {path.parent} is not a directory")
