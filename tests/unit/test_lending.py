"""Lending idle exclusive CPUs (issue 26), the pure part (cpuservice.model.lending): what may be
lent, what is lent now, which CPUs the borrow slice may share during a change (the controller:
test_lending_control.py); the options, the checkpoint rows and the Descriptions that carry it."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import pytest

from cpuservice.apply import units
from cpuservice.host.checkpoint import Store, from_payload
from cpuservice.model import config
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.fixtures import MACHINES
from cpuservice.model.lending import (
    all_lent,
    borrowed,
    lendable,
    lent,
    lent_by,
    shareable,
    with_lent,
)
from cpuservice.model.pools import Allocation, Fragment
from cpuservice.model.request import Request
from cpuservice.model.state import Record, State

from .helpers import bind, ledger_for

B = MACHINES["b"].topology()  # 2 nodes x 4 cores x 2 threads; CPU n and n+8 are siblings
CFG = config.validate({})


def owner(cpus: str, name: str = "o", **options: object) -> Allocation:
    held = CPUSet.parse(cpus)
    return Allocation(name, bind(str(len(held)), **{"lend": True, **options}), held)


def state_of(*allocations: Allocation, lent_cpus: dict[str, str] | None = None) -> State:
    ledger = ledger_for(B)
    for a in allocations:
        ledger = ledger.with_allocation(a)
    records = {a.name: Record(unit=f"cpuservice-bound-{a.name}.slice",
                              lent=CPUSet.parse((lent_cpus or {}).get(a.name, "")))
               for a in allocations}
    return State(ledger, records)


def test_only_whole_cores_of_whole_cpus_are_lendable() -> None:
    assert lendable(B, owner("0,8,1,9")) == CPUSet.parse("0-1,8-9")
    assert lendable(B, owner("0,8,1")) == CPUSet.parse("0,8")  # 1's sibling 9 is not its own
    frac = Allocation("f", bind("2.5", lend=True), CPUSet.parse("0,8"),
                      fragment=Fragment(1, 50))
    assert lendable(B, frac) == CPUSet.parse("0,8")  # never the fragment CPU
    assert lendable(B, owner("0,8", lend=False)) == EMPTY
    assert lendable(B, replace(owner("0,8"), degraded=True)) == EMPTY


def test_a_core_with_an_offline_thread_counts_its_online_threads() -> None:
    t = B.with_online(B.online - CPUSet((8,)))
    assert lendable(t, owner("0")) == CPUSet((0,))  # SMT off for that core: one thread


def test_isolated_cpus_are_never_lent() -> None:
    t = replace(B, isolated=CPUSet.parse("0,8"))
    assert lendable(t, owner("0-1,8-9")) == CPUSet.parse("1,9")


def test_lent_is_the_record_within_what_may_be_lent_now() -> None:
    s = state_of(owner("0,8,1,9"), lent_cpus={"o": "0-1,8-9"})
    assert lent(B, s, "o") == CPUSet.parse("0-1,8-9")
    shrunk = owner("0,8")  # a Resize took core 1 away: the record is stale there
    s2 = State(s.ledger.with_allocation(shrunk), s.records)
    assert lent(B, s2, "o") == CPUSet.parse("0,8")
    assert all_lent(B, s2) == CPUSet.parse("0,8")
    assert lent(B, s2, "nobody") == EMPTY
    assert borrowed(B, s2) == s2.ledger.shared | CPUSet.parse("0,8")
    off = State(s.ledger.with_allocation(owner("0,8,1,9", lend=False)), s.records)
    assert all_lent(B, off) == EMPTY  # lending turned off: nothing is lent, whatever it said


def test_with_lent_records_what_is_lent() -> None:
    s = with_lent(state_of(owner("0,8")), {"o": CPUSet.parse("0,8")})
    assert lent_by(B, s) == {0: "o", 8: "o"}
    assert with_lent(s, {"o": EMPTY}).records["o"].lent == EMPTY


def test_shareable_cpus_are_lent_on_one_side_and_nobody_elses() -> None:
    before = state_of(owner("0,8,1,9"), lent_cpus={"o": "0-1,8-9"})
    withdrawn = with_lent(before, {"o": EMPTY})
    assert shareable((B, before), (B, withdrawn)) == CPUSet.parse("0-1,8-9")
    assert shareable((B, withdrawn), (B, before)) == CPUSet.parse("0-1,8-9")  # lend
    released = State(before.ledger.without("o"), {})
    assert shareable((B, before), (B, released)) == CPUSet.parse("0-1,8-9")
    # the owner was moved off core 1 and another allocation took it in the same change
    moved = before.ledger.with_allocation(owner("0,8,2,10"))
    taken = State(moved.with_allocation(owner("1,9", name="new", lend=False)),
                  {**before.records, "new": Record()})
    assert shareable((B, before), (B, taken)) == CPUSet.parse("0,8")


# ---- the options ----


def test_lend_needs_bind_and_no_partition() -> None:
    assert Request.parse("2", {"bind": True, "lend": True}).options.lend
    assert Request.parse("2", {"bind": True, "lend": True, "cpuset": "0-1"}).options.lend
    with pytest.raises(InvalidArgument, match=r"'lend'.*bind"):
        Request.parse("2", {"lend": True})
    with pytest.raises(InvalidArgument, match=r"'lend'.*partition"):
        Request.parse("2", {"bind": True, "lend": True, "partition": "root"})


def test_borrow_is_for_unbound_allocations_of_their_own_slice() -> None:
    assert Request.parse("1", {"borrow": True}).options.borrow
    with pytest.raises(InvalidArgument, match=r"'borrow'.*unbound"):
        Request.parse("1", {"borrow": True, "bind": True})
    with pytest.raises(InvalidArgument, match=r"'borrow'.*slice"):
        Request.parse("1", {"borrow": True, "unit": "app.service"})


def test_a_default_that_cannot_apply_is_off() -> None:
    defaults = {"lend": True, "borrow": True}
    assert not Request.parse("1", {}, defaults).options.lend
    assert Request.parse("1", {}, defaults).options.borrow
    bound = Request.parse("2", {"bind": True}, defaults).options
    assert bound.lend and not bound.borrow
    with pytest.raises(InvalidArgument):  # asked for explicitly: refused
        Request.parse("1", {"lend": True}, defaults)
    # a configured default partition yields to an explicit lend (and refuses only a default)
    asked = Request.parse("2", {"bind": True, "lend": True}, {"partition": "root"}).options
    assert asked.lend and asked.partition == "none"
    assert not Request.parse("2", {"bind": True}, {"partition": "root", "lend": True}
                             ).options.lend


def test_old_checkpoints_and_descriptions_lend_nothing(tmp_path: Path) -> None:
    base = ledger_for(B)
    row = {"name": "o", "cpus": "2", "options": {"bind": True}, "whole": "0,8",
           "fragment": None, "degraded": False, "owner": 0,
           "unit": "cpuservice-bound-o.slice", "saved": {}, "populated": False}
    s = from_payload({"allocations": [row]}, base)
    assert s.records["o"].lent == EMPTY and not s.ledger.allocations["o"].request.options.lend
    fields = {"name": "o", "cpus": "2", "bind": "true", "policy": "packed", "exclusive": "none",
              "numa-strategy": "most-allocated", "numa-alignment": "best-effort",
              "memory-nodes": "false", "lifetime": "persistent", "owner": "0", "whole": "0,8"}
    a, _ = units.from_description(fields, "cpuservice-bound-o.slice")
    assert not a.request.options.lend and not a.request.options.borrow


def test_the_checkpoint_and_the_description_carry_lending(tmp_path: Path) -> None:
    a = owner("0,8")
    s = with_lent(state_of(a), {"o": CPUSet.parse("0,8")})
    store = Store(tmp_path / "state.json")
    store.save(s)
    again = from_payload(store.load() or {}, ledger_for(B))
    assert again.records["o"].lent == CPUSet.parse("0,8")
    assert again.ledger.allocations["o"].request.options.lend
    store.save(with_lent(again, {"o": EMPTY}), {"o"})
    assert "lent" not in (store.load() or {})["allocations"][0]  # only when something is
    fields = units.description_fields(a, s.records["o"])
    assert fields["lend"] == "true" and "borrow" not in fields
    back, _ = units.from_description({**fields, "name": "o"}, "cpuservice-bound-o.slice")
    assert back == a
    borrower = Allocation("u", Request.parse("1.5", {"borrow": True}))
    fields = units.description_fields(borrower, Record())
    back, _ = units.from_description({**fields, "name": "u"}, "x")
    assert back == borrower and back.request.cpus == Decimal("1.5")


# ---- the configuration ----


def test_lending_configuration_is_bounded() -> None:
    assert (CFG.lend_busy_percent, CFG.lend_idle_percent, CFG.lend_idle_seconds,
            CFG.lend_sample_ms) == (20, 5, 2.0, 50)
    assert config.validate({"lend_idle_seconds": 1}).lend_idle_seconds == 1.0
    for bad in ({"lend_sample_ms": 5}, {"lend_sample_ms": 1001}, {"lend_busy_percent": 0},
                {"lend_busy_percent": 101}, {"lend_idle_seconds": -1},
                {"lend_idle_seconds": 3601}, {"lend_idle_seconds": "2"},
                {"lend_idle_seconds": True}, {"lend_idle_percent": 20},
                {"lend_idle_percent": 30, "lend_busy_percent": 25}):
        with pytest.raises(config.ConfigError, match=next(iter(bad))):
            config.validate(bad)


def test_usage_is_read_from_cpu_stat(tmp_path: Path) -> None:
    from cpuservice.host.cgroup import read_usage
    unit = tmp_path / "cpuservice.slice/cpuservice-bound-o.slice"
    unit.mkdir(parents=True)
    (unit / "cpu.stat").write_text("usage_usec 1234567\nuser_usec 1000000\nsystem_usec 234567\n")
    assert read_usage("/cpuservice.slice/cpuservice-bound-o.slice", tmp_path) == 1234567
    for bad in ("cpuservice.slice", "/cpuservice.slice/../etc", "/nothing/here"):
        assert read_usage(bad, tmp_path) is None
    (unit / "cpu.stat").write_text("user_usec 1\n")  # no usage_usec (no cpu controller)
    assert read_usage("/cpuservice.slice/cpuservice-bound-o.slice", tmp_path) is None
