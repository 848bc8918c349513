"""The request options on the command line, derived from cpuservice.model.vocab.OPTIONS:
the arguments cpuservicectl and cpuservice-run take, and the option map they send."""

from __future__ import annotations

import argparse
from enum import Enum
from typing import Any, get_args

from cpuservice.model import vocab


def choices(vocabulary: Any) -> tuple[str, ...]:
    """The accepted words of one of cpuservice.model.vocab's vocabularies (a StrEnum, or a
    Literal in older trees): the CLI and the service speak one vocabulary."""
    if isinstance(vocabulary, type) and issubclass(vocabulary, Enum):
        return tuple(str(v.value) for v in vocabulary)
    return tuple(str(v) for v in get_args(vocabulary))


def add_option_args(p: argparse.ArgumentParser, bind_flag: bool = True,
                    allocate: bool = False, also: tuple[str, ...] = ()) -> None:
    """The request options as arguments (cpuservice.model.vocab.OPTIONS); ``allocate``: also
    those only Allocate takes (unit, lifetime); ``also``: these of them."""
    for spec in vocab.OPTIONS:
        if spec.key == "bind" and not bind_flag:
            continue
        if not (spec.shapes_placement or allocate or spec.key in also):
            continue
        flag = f"--{spec.key}"
        if spec.kind is vocab.OptionKind.FLAG:
            p.add_argument(flag, action="store_true", help=spec.help)
        elif spec.vocabulary is not None:
            p.add_argument(flag, choices=choices(spec.vocabulary), help=spec.help)
        elif spec.repeat:
            p.add_argument(flag, action="append", metavar=spec.key.upper(), help=spec.help)
        else:
            p.add_argument(flag, help=spec.help)


def options_of(args: argparse.Namespace) -> dict[str, Any]:
    """The Allocate/Plan/Capacity option map from parsed arguments (only what was given)."""
    opts: dict[str, Any] = {}
    for spec in vocab.OPTIONS:
        value = getattr(args, spec.key.replace("-", "_"), None)
        if spec.kind is vocab.OptionKind.FLAG:
            if value:
                opts[spec.key] = True
        elif isinstance(value, list):  # repeated: one comma-separated value
            opts[spec.key] = ",".join(value)
        elif value is not None:
            opts[spec.key] = str(value)
    if opts.get("cpuset") or opts.get("near"):
        opts["bind"] = True
    return opts
