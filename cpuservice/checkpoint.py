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
FORMAT = "cpuservice-checkpoint"


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


def _row(name: str, a: Allocation, r: Record) -> dict[str, Any]:
    return {
        "name": name,
        "cpus": str(a.request.cpus),
        "options": compat.dump(a.request.options, exclude_defaults=True),
        "whole": a.whole.format(),
        "fragment": [a.fragment.cpu, a.fragment.pieces] if a.fragment else None,
        "degraded": a.degraded,
        "owner": r.owner,
        "unit": r.unit,
        "saved": {k: [sig, _prop_out(sig, v)] for k, (sig, v) in r.saved.items()},
        "populated": r.populated,
    }


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


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Store:
    """The checkpoint file: a header line (format, version, checksum of the rest), then the
    payload as one line of JSON. Rows of unchanged allocations are serialized once and reused."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._rows: dict[str, str] = {}  # allocation name -> its JSON row

    def _payload_text(self, state: State, touched: set[str] | None) -> str:
        allocations, records = state.ledger.allocations, state.records
        if touched is None or len(self._rows) + sum(
            (n in allocations) - (n in self._rows) for n in touched
        ) != len(allocations):
            touched = set(allocations) | set(self._rows)
        for name in touched:
            if name in allocations:
                row = _row(name, allocations[name], records.get(name, Record()))
                self._rows[name] = json.dumps(row, sort_keys=True, separators=(",", ":"))
            else:
                self._rows.pop(name, None)
        rows = ",".join(self._rows.values())
        return f'{{"allocations":[{rows}],"granularity":{state.ledger.granularity}}}'

    def save(self, state: State, touched: set[str] | None = None) -> None:
        """Write ``state``; ``touched`` names the allocations changed since the last save (the
        others' rows are reused), None for all."""
        payload = self._payload_text(state, touched)
        header = json.dumps({"format": FORMAT, "version": VERSION, "checksum": _checksum(payload)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.tmp")
        with open(temp, "w") as f:
            f.write(f"{header}\n{payload}\n")
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
        header_text, _, payload_text = text.partition("\n")
        payload_text = payload_text.rstrip("\n")
        try:
            header = json.loads(header_text)
            version, checksum = header["version"], header["checksum"]
            if header.get("format") != FORMAT:
                raise ValueError("not a cpuservice checkpoint")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: unreadable: {exc}") from None
        if version != VERSION:
            raise CheckpointError(f"{self.path}: version {version}, expected {VERSION}")
        if checksum != _checksum(payload_text):
            raise CheckpointError(f"{self.path}: checksum mismatch")
        try:
            payload = json.loads(payload_text)
        except ValueError as exc:
            raise CheckpointError(f"{self.path}: unreadable payload: {exc}") from None
        return dict(payload)

    def set_aside(self) -> Path:
        """Rename a bad checkpoint out of the way; returns its new path."""
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        os.replace(self.path, aside)
        return aside
