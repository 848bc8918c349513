"""The durable checkpoint: the ledger and per-allocation records as versioned, checksummed JSON:
a snapshot written atomically and a journal of the changes since (see Store)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cpuservice.model import compat
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import CheckpointWriteError, CPUServiceError
from cpuservice.model.pools import Allocation, Fragment, InvariantError, Ledger, check_invariants
from cpuservice.model.request import Request, parse_options
from cpuservice.model.state import Record as Record
from cpuservice.model.state import State as State

VERSION = 1
FORMAT = "cpuservice-checkpoint"
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint is unreadable, from another version, or fails its checksum."""


def _prop_out(sig: str, value: Any) -> Any:
    return value.hex() if sig == "ay" else value


def prop_in(sig: str, value: Any) -> Any:
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
        **({"fresh": list(r.fresh)} if r.fresh else {}),
        **({"lent": r.lent.format()} if r.lent else {}),  # older checkpoints: nothing lent
        **({"gone": list(r.gone)} if r.gone else {}),  # devices of option near not found
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
            saved = {k: (sig, prop_in(sig, v)) for k, (sig, v) in row["saved"].items()}
            records[row["name"]] = Record(int(row["owner"]), str(row["unit"]), saved,
                                          bool(row["populated"]),
                                          tuple(str(n) for n in row.get("fresh", ())),
                                          CPUSet.parse(str(row.get("lent", ""))),
                                          tuple(str(n) for n in row.get("gone", ())))
    except (KeyError, TypeError, ValueError, CPUServiceError) as exc:
        raise CheckpointError(f"bad allocation in checkpoint: {exc}") from None
    ledger = Ledger(ledger.online, ledger.reserved, ledger.isolated,
                    int(payload.get("granularity", ledger.granularity)), ledger.min_shared_cpus,
                    MappingProxyType(allocations), keep=ledger.keep)
    _consistent(ledger)
    return State(ledger, records)


def _consistent(ledger: Ledger) -> None:
    """CheckpointError when the allocations contradict each other, whatever the machine is now
    (a CPU exclusive to two, exclusive and fragment at once, a fragment of more pieces than a
    CPU has): the invariants on every CPU they hold, nothing reserved and no shared minimum.
    What the topology or the configuration changed since (CPUs gone, reserved, a larger
    minimum) is not this file's fault; the startup repair mends it."""
    held = CPUSet.union_all(a.held for a in ledger.bound.values())
    try:
        check_invariants(Ledger(ledger.online | held, EMPTY, ledger.isolated, ledger.granularity,
                                0, ledger.allocations))
    except InvariantError as exc:
        raise CheckpointError(f"allocations in checkpoint contradict each other: {exc}") from None


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def fsync_dir(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class Store:
    """The checkpoint: a snapshot file and a journal beside it.

    The snapshot (``state.json``) is a header line (format, version, generation, checksum of the
    rest) and the payload as one line of JSON, written atomically (temp file, fsync, rename, fsync
    of the directory). Each later change appends one line to the journal (``state.json.journal``):
    a checksum and the JSON of the rows it puts and the names it deletes, stamped with the
    snapshot's generation, then fsync; so a change costs what it touches, not what exists. When
    the journal outgrows the snapshot, a new snapshot (the next generation) takes it in and the
    journal is emptied. Snapshot and journal are one generation: a load replays only the journal
    lines of the snapshot's generation, so a crash between a snapshot's rename and the journal's
    truncation never replays older changes onto the newer snapshot. A last line without its
    newline (a write that never returned) is dropped on load; any other damage is a
    CheckpointError (and the state is rebuilt from the units). A failed or short write leaves the
    files and this object as they were and raises CheckpointWriteError."""

    JOURNAL_MIN_BYTES = 64 * 1024

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.journal = self.path.with_name(f"{self.path.name}.journal")
        self._rows: dict[str, str] = {}  # allocation name -> its JSON row, as on disk
        self._granularity: int | None = None
        self._snapshot_bytes = 0
        self._journal_bytes: int | None = None  # None: not known to match the snapshot
        self._generation = 0  # the snapshot's, as loaded or last written
        # why the last write failed (disk full, read-only), until one succeeds: the service
        # says so in its status and refuses only the changes that need a write
        self.write_error: str | None = None
        self.write_failures = 0  # since the start, for the metrics

    def save(self, state: State, touched: set[str] | None = None) -> None:
        """Write ``state``; ``touched`` names the allocations changed since the last save (the
        others are as written before), None to write everything anew."""
        allocations, records = state.ledger.allocations, state.records
        granularity = state.ledger.granularity
        if touched is not None and self._journal_bytes is not None:
            names = {n for n in touched if n in allocations or n in self._rows}
            put = {n: _dump(_row(n, allocations[n], records.get(n, Record())))
                   for n in names if n in allocations}
            gone = names - put.keys()
            # the rows written before, with these changes, are every allocation (a count: the
            # touched names are the ones that changed; a full comparison would cost what
            # exists on every change)
            # (each term walks the touched names only: a set minus a dict's keys walks the keys)
            added = sum(1 for n in put if n not in self._rows)
            if len(self._rows) + added - sum(1 for n in gone if n in self._rows) == len(
                    allocations):
                if not names and granularity == self._granularity:
                    return
                if self._journal_bytes < max(self.JOURNAL_MIN_BYTES, self._snapshot_bytes):
                    self._append(put, gone, granularity)
                    return
                rows = {n: r for n, r in self._rows.items() if n not in gone}
                self._snapshot({**rows, **put}, granularity)
                return
        rows = {n: _dump(_row(n, a, records.get(n, Record()))) for n, a in allocations.items()}
        self._snapshot(rows, granularity)

    def _append(self, put: dict[str, str], gone: set[str], granularity: int) -> None:
        body = (f'{{"put":[{",".join(put[n] for n in sorted(put))}],'
                f'"del":{json.dumps(sorted(gone))},"granularity":{granularity},'
                f'"generation":{self._generation}}}')
        line = f"{_checksum(body)} {body}\n".encode()
        len_before = self._journal_bytes
        assert len_before is not None
        try:
            fd = _open_private(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                written = os.write(fd, line)
                if written != len(line):  # a short write (a nearly full disk) is a failed one
                    raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
                os.fsync(fd)
            except OSError:
                self._journal_bytes = None  # the next change writes a snapshot
                os.ftruncate(fd, len_before)  # as it was: no torn line left behind
                raise
            finally:
                os.close(fd)
            if len_before == 0:
                try:
                    fsync_dir(self.path.parent)
                except OSError:  # refused: the line must not be replayed at the next start
                    self._journal_bytes = None
                    with contextlib.suppress(OSError):
                        fd = _open_private(self.journal, os.O_WRONLY)
                        try:
                            os.ftruncate(fd, len_before)
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                    raise
        except OSError as exc:
            self.write_error = f"cannot write {self.journal}: {exc.strerror}"
            self.write_failures += 1
            raise CheckpointWriteError(self.write_error) from None
        self.write_error = None
        for name in gone:
            self._rows.pop(name, None)
        self._rows.update(put)
        self._granularity = granularity
        self._journal_bytes = len_before + len(line)

    def _snapshot(self, rows: dict[str, str], granularity: int) -> None:
        payload = f'{{"allocations":[{",".join(rows.values())}],"granularity":{granularity}}}'
        generation = self._generation + 1
        header = json.dumps({"format": FORMAT, "version": VERSION, "generation": generation,
                             "checksum": _checksum(payload)})
        temp = self.path.with_name(f".{self.path.name}.tmp")
        text = f"{header}\n{payload}\n".encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temp.unlink(missing_ok=True)  # O_EXCL below: never write through a planted link
            fd = _open_private(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                view = memoryview(text)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, self.path)
            fsync_dir(self.path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            # what is on disk is no longer known to match the rows kept here: the next
            # change writes a snapshot from the allocations themselves
            self._journal_bytes = None
            self.write_error = f"cannot write {self.path}: {exc.strerror}"
            self.write_failures += 1
            raise CheckpointWriteError(self.write_error) from None
        self.write_error = None
        self._rows, self._granularity, self._snapshot_bytes = rows, granularity, len(text)
        self._generation = generation
        self._journal_bytes = None
        try:  # the snapshot holds everything: the journal may go (replaying it is harmless)
            fd = _open_private(self.journal, os.O_WRONLY)
            try:
                os.ftruncate(fd, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._journal_bytes = 0
        except FileNotFoundError:
            self._journal_bytes = 0
        except OSError as exc:
            log.warning("cannot empty %s (%s): the next change writes a snapshot",
                        self.journal, exc.strerror)

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
        generation = header.get("generation", 0)
        if type(generation) is not int:
            raise CheckpointError(f"{self.path}: bad generation {generation!r}")
        try:
            payload = dict(json.loads(payload_text))
            rows = {row["name"]: row for row in payload["allocations"]}
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: unreadable payload: {exc}") from None
        granularity = payload.get("granularity")
        self._generation = generation
        for change in self._journal_lines():
            if change.get("generation", 0) != generation:
                continue  # an older snapshot's change, already in this one
            for row in change["put"]:
                rows[row["name"]] = row
            for name in change["del"]:
                rows.pop(name, None)
            granularity = change["granularity"]
        payload["allocations"], payload["granularity"] = list(rows.values()), granularity
        return payload

    @property
    def generation(self) -> int:
        """The snapshot generation last loaded or written."""
        return self._generation

    def _journal_lines(self) -> list[dict[str, Any]]:
        try:
            data = self.journal.read_bytes()
        except FileNotFoundError:
            return []
        *complete, tail = data.split(b"\n")
        if tail:
            log.warning("%s: ignoring a torn last line (no newline)", self.journal)
        out = []
        for i, raw in enumerate(complete):
            checksum, _, body = raw.decode(errors="replace").partition(" ")
            try:
                if checksum != _checksum(body):
                    raise ValueError("checksum mismatch")
                change = json.loads(body)
                if not isinstance(change.get("put"), list) or not isinstance(
                        change.get("del"), list) or not isinstance(change.get("granularity"), int):
                    raise ValueError("not a change")
            except ValueError as exc:
                raise CheckpointError(f"{self.journal}: line {i + 1}: {exc}") from None
            out.append(change)
        return out

    def set_aside(self) -> Path:
        """Rename a bad checkpoint (and its journal) out of the way; returns its new path."""
        stamp = int(time.time())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        os.replace(self.path, aside)
        if self.journal.exists():
            os.replace(self.journal, self.journal.with_name(f"{self.journal.name}.corrupt-{stamp}"))
        self._journal_bytes = None
        return aside


def _open_private(path: Path, flags: int) -> int:
    """open(2) for the daemon's own files: mode 0600, never through a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _dump(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True, separators=(",", ":"))
