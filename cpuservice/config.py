"""Daemon configuration: ``cpuservice.toml`` plus ``cpuservice.toml.d/*.toml`` drop-ins."""

from __future__ import annotations

import re
import tomllib
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictStr, conint

from . import compat
from .cpuset import CPUSet, CPUSetError
from .errors import InvalidArgument
from .request import OPTION_KEYS, Options, parse_options

DEFAULT_PATH = Path("/etc/cpuservice/cpuservice.toml")
PER_REQUEST_ONLY = ("cpuset", "unit")
_CPU_LIMIT = re.compile(r"[0-9]{1,6}(\.[0-9]{1,3})?%?")


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file and the key."""


class Config(compat.StrictModel):
    sysfs_root: StrictStr = "/sys"
    state_file: StrictStr = "/var/lib/cpuservice/state.json"
    reserved_cpus: StrictStr = ""
    min_shared_cpus: conint(strict=True, ge=1) = 1  # type: ignore[valid-type]
    granularity: Literal[100, 1000] = 100
    confine_host: StrictBool = False
    isolate_irqs: StrictBool = False
    isolate_workqueues: StrictBool = False
    max_allocations_per_user: conint(strict=True, ge=0) = 64  # type: ignore[valid-type]
    max_cpus_per_user: StrictStr = "50%"
    lifetime_grace_seconds: conint(strict=True, ge=1, le=86400) = 60  # type: ignore[valid-type]
    defaults: dict[str, Any] = Field(default_factory=dict)

    def cpu_limit(self, online: int) -> Decimal | None:
        """The bound CPUs one unprivileged user may hold on ``online`` CPUs (None: no limit)."""
        text = self.max_cpus_per_user
        if text in ("", "0", "0%"):
            return None
        if text.endswith("%"):
            return Decimal(online) * Decimal(text[:-1]) / 100
        return Decimal(text)

    @property
    def reserved(self) -> CPUSet:
        return CPUSet.parse(self.reserved_cpus)

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


def load(path: Path | str = DEFAULT_PATH) -> Config:
    """Read the main file (missing = all defaults) and its drop-ins, in name order."""
    path = Path(path)
    data: dict[str, Any] = _read(path) if path.exists() else {}
    dropins = Path(f"{path}.d")
    for extra in sorted(dropins.glob("*.toml")) if dropins.is_dir() else []:
        data = _merge(data, _read(extra))
    return validate(data, str(path))


def validate(data: dict[str, Any], source: str = "config") -> Config:
    if isinstance(data.get("max_cpus_per_user"), int) and not isinstance(
            data["max_cpus_per_user"], bool):
        data = {**data, "max_cpus_per_user": str(data["max_cpus_per_user"])}
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
    for key in config.defaults:
        if key in PER_REQUEST_ONLY or key not in OPTION_KEYS:
            raise ConfigError(f"{source}: defaults.{key}: not an option that can have a default")
    try:
        config.default_options  # noqa: B018
    except InvalidArgument as exc:
        raise ConfigError(f"{source}: defaults: {exc}") from None
    return config
