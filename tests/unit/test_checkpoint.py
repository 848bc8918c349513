from __future__ import annotations

from pathlib import Path

import pytest

from cpuservice import placement
from cpuservice.checkpoint import CheckpointError, Record, State, Store, from_payload
from cpuservice.request import Request

from .helpers import bind, ledger_for


def _state(machine) -> State:  # type: ignore[no-untyped-def]
    t = machine("b")
    ledger = ledger_for(t)
    ledger, _ = placement.allocate(t, ledger, "a", bind("2.5", policy="spread-pcpus"))
    ledger, _ = placement.allocate(t, ledger, "u", Request.parse("1.5", {"memory-nodes": True}))
    records = {"a": Record(1000, "cpuservice-bound-a.slice", populated=True),
               "u": Record(0, "x.service",
                           {"CPUWeight": ("t", 42), "AllowedCPUs": ("ay", b"\x03")})}
    return State(ledger, records)


def test_roundtrip(tmp_path: Path, machine) -> None:
    state = _state(machine)
    store = Store(tmp_path / "state.json")
    assert store.load() is None
    store.save(state)
    store.save(state)  # second save reuses the cached rows
    back = from_payload(store.load() or {}, ledger_for(machine("b")))
    assert back.ledger == state.ledger and back.records == state.records
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty", "version"])
def test_damage_is_detected_and_set_aside(tmp_path: Path, machine, damage: str) -> None:
    store = Store(tmp_path / "state.json")
    store.save(_state(machine))
    text = store.path.read_text()
    broken = {
        "flip": text.replace('"a"', '"b"', 1),
        "truncate": text[: len(text) // 2],
        "header": "{" + text,
        "empty": "",
        "version": text.replace('"version": 1', '"version": 2'),
    }[damage]
    store.path.write_text(broken)
    with pytest.raises(CheckpointError):
        store.load()
    aside = store.set_aside()
    assert aside.read_text() == broken and not store.path.exists()


def _grow(machine, state: State, name: str, cpus: str) -> State:  # type: ignore[no-untyped-def]
    ledger, _ = placement.allocate(machine("b"), state.ledger, name, bind(cpus))
    return State(ledger, {**state.records, name: Record(0, f"cpuservice-bound-{name}.slice")})


def _loaded(store: Store, machine) -> State:  # type: ignore[no-untyped-def]
    return from_payload(Store(store.path).load() or {}, ledger_for(machine("b")))


def test_changes_go_to_the_journal_and_come_back(tmp_path: Path, machine) -> None:
    store = Store(tmp_path / "state.json")
    state = _state(machine)
    store.save(state)
    snapshot = store.path.read_bytes()
    state = _grow(machine, state, "j", "1")
    store.save(state, {"j"})
    state = State(placement.release(state.ledger, "a"),
                  {k: v for k, v in state.records.items() if k != "a"})
    store.save(state, {"a"})
    assert store.path.read_bytes() == snapshot  # only the journal was written
    assert len(store.journal.read_text().splitlines()) == 2
    back = _loaded(store, machine)
    assert back.ledger == state.ledger and back.records == state.records


def test_a_torn_last_line_is_ignored_damage_before_it_is_not(tmp_path: Path, machine) -> None:
    store = Store(tmp_path / "state.json")
    first = _state(machine)
    store.save(first)
    second = _grow(machine, first, "j", "1")
    store.save(second, {"j"})
    third = _grow(machine, second, "k", "1")
    store.save(third, {"k"})
    lines = store.journal.read_bytes().split(b"\n")
    store.journal.write_bytes(lines[0] + b"\n" + lines[1][:20])  # the write of k never ended
    assert _loaded(store, machine).ledger == second.ledger
    for damaged in (lines[0].replace(b'"j"', b'"x"') + b"\n" + lines[1] + b"\n",
                    lines[0] + b"\n" + lines[1].replace(b'"k"', b'"x"') + b"\n"):
        store.journal.write_bytes(damaged)
        with pytest.raises(CheckpointError):
            store.load()


def test_the_journal_is_folded_into_a_new_snapshot(tmp_path: Path, machine) -> None:
    store = Store(tmp_path / "state.json")
    store.JOURNAL_MIN_BYTES = 0
    state = _state(machine)
    store.save(state)
    for i in range(6):
        state = _grow(machine, state, f"j{i}", "0.1")
        store.save(state, {f"j{i}"})
    assert store.journal.stat().st_size < store.path.stat().st_size
    assert _loaded(store, machine).ledger == state.ledger


def test_a_failed_write_changes_nothing(tmp_path: Path, machine, monkeypatch) -> None:
    """Disk full while writing a change: the files and the store are as before, a named error
    is raised, and the next write records each CPU once."""
    import errno
    import os

    from cpuservice import checkpoint

    store = Store(tmp_path / "state.json")
    state = _state(machine)
    store.save(state)
    store.save(_grow(machine, state, "j", "1"), {"j"})
    files = (store.path.read_bytes(), store.journal.read_bytes())

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "write", full)
    failed = _grow(machine, _grow(machine, state, "j", "1"), "k", "2")
    with pytest.raises(checkpoint.CheckpointWriteError):
        store.save(failed, {"k"})
    assert (store.path.read_bytes(), store.journal.read_bytes()) == files
    monkeypatch.setattr(checkpoint.os, "write", os.write)
    other = _grow(machine, _grow(machine, state, "j", "1"), "m", "2")
    store.save(other, {"m"})
    back = _loaded(store, machine)
    assert set(back.ledger.allocations) == {"a", "u", "j", "m"}
    held = [c for a in back.ledger.allocations.values() for c in a.whole]
    assert len(held) == len(set(held))
