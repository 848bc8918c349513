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
