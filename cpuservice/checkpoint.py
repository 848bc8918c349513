"""The durable checkpoint: the ledger and per-allocation records as versioned, checksummed JSON,
written atomically (temp file, fsync, rename, fsync the directory)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any

from . import compat
from .cpuset import CPUSet
from .errors import CPUServiceError
from .pools import Allocation, Fragment, Ledger
from .request import Request, parse_options

VERSION = 1


class CheckpointError(ValueError):
    """The checkpoint is unreadable, from another version, or fails its checksum."""


@dataclass(frozen=True)
class Record:
    """What the service knows of an allocation beyond the ledger."""

    owner: int = 0
    unit: str = ""
    saved: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    populated: bool = False


@dataclass(frozen=True)
class State:
    ledger: Ledger
    records: Mapping[str, Record]


def _prop_out(sig: str, value: Any) -> Any:
    return value.hex() if sig == "ay" else value


def _prop_in(sig: str, value: Any) -> Any:
    return bytes.fromhex(value) if sig == "ay" else int(value)


def to_payload(state: State) -> dict[str, Any]:
    rows = []
    for name in sorted(state.ledger.allocations):
        a = state.ledger.allocations[name]
        r = state.records.get(name, Record())
        rows.append({
            "name": name,
            "cpus": str(a.request.cpus),
            "options": compat.dump(a.request.options),
            "whole": a.whole.format(),
            "fragment": [a.fragment.cpu, a.fragment.pieces] if a.fragment else None,
            "degraded": a.degraded,
            "owner": r.owner,
            "unit": r.unit,
            "saved": {k: [sig, _prop_out(sig, v)] for k, (sig, v) in r.saved.items()},
            "populated": r.populated,
        })
    return {"granularity": state.ledger.granularity, "allocations": rows}


def from_payload(payload: Mapping[str, Any], ledger: Ledger) -> State:
    """Allocations from a payload, on ``ledger`` (which carries the configured pools)."""
    allocations: dict[str, Allocation] = {}
    records: dict[str, Record] = {}
    try:
        for row in payload["allocations"]:
            request = Request.build(Decimal(row["cpus"]), parse_options(row["options"]))
            fragment = Fragment(*row["fragment"]) if row["fragment"] else None
            allocations[row["name"]] = Allocation(
                row["name"], request, CPUSet.parse(row["whole"]), fragment, bool(row["degraded"])
            )
            saved = {k: (sig, _prop_in(sig, v)) for k, (sig, v) in row["saved"].items()}
            records[row["name"]] = Record(int(row["owner"]), str(row["unit"]), saved,
                                          bool(row["populated"]))
    except (KeyError, TypeError, ValueError, CPUServiceError) as exc:
        raise CheckpointError(f"bad allocation in checkpoint: {exc}") from None
    ledger = Ledger(ledger.online, ledger.reserved, ledger.isolated,
                    int(payload.get("granularity", ledger.granularity)), ledger.min_shared_cpus,
                    MappingProxyType(allocations))
    return State(ledger, records)


def _checksum(payload: Mapping[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class Store:
    """The checkpoint file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def save(self, state: State) -> None:
        payload = to_payload(state)
        document = {"version": VERSION, "checksum": _checksum(payload), "payload": payload}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.tmp")
        with open(temp, "w") as f:
            json.dump(document, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def load(self) -> dict[str, Any] | None:
        """The payload, None when there is no checkpoint; CheckpointError when it is bad."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            document = json.loads(text)
            payload = document["payload"]
            version, checksum = document["version"], document["checksum"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: unreadable: {exc}") from None
        if version != VERSION:
            raise CheckpointError(f"{self.path}: version {version}, expected {VERSION}")
        if checksum != _checksum(payload):
            raise CheckpointError(f"{self.path}: checksum mismatch")
        return dict(payload)

    def set_aside(self) -> Path:
        """Rename a bad checkpoint out of the way; returns its new path."""
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        os.replace(self.path, aside)
        return aside
