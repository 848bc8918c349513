from __future__ import annotations

from cpuservice.cpuset import CPUSet
from cpuservice.pools import check_invariants
from cpuservice.repair import repair

from .helpers import alloc, bind, ledger_for


def test_offline_cpu_replaced_by_its_sibling_first(machine) -> None:
    t = machine("b")
    ledger, a = alloc(t, ledger_for(t), "a", bind("1"))  # cpu 0; sibling 8 free
    lost = a.whole.first()
    ledger, changes = repair(t.with_online(t.online - a.whole), ledger)
    check_invariants(ledger)
    new = ledger.allocations["a"]
    assert lost not in new.whole and len(new.whole) == 1 and not new.degraded
    assert t.cpus[new.whole.first()].core == t.cpus[lost].core
    assert [c.reason for c in changes] == [f"lost {lost}, gained {new.whole}"]


def test_nothing_fits_then_degraded_then_heals_first(machine) -> None:
    t = machine("a")
    ledger, a = alloc(t, ledger_for(t), "a", bind("4"))
    ledger, _b = alloc(t, ledger, "b", bind("3"))
    down = t.with_online(t.online - CPUSet(list(a.whole)[:2]))
    ledger, changes = repair(down, ledger)
    check_invariants(ledger)
    assert ledger.allocations["a"].degraded and len(ledger.allocations["a"].whole) == 2
    assert changes[0].degraded and "degraded" in changes[0].reason
    ledger, changes = repair(t, ledger)  # back online: the degraded one heals
    check_invariants(ledger)
    assert not ledger.allocations["a"].degraded and len(ledger.allocations["a"].whole) == 4
    assert any("healed" in c.reason for c in changes)


def test_fragment_offline_moves_its_pieces(machine) -> None:
    t = machine("b")
    ledger, a = alloc(t, ledger_for(t), "a", bind("1.5"))
    ledger, b = alloc(t, ledger, "b", bind("0.3"))
    assert a.fragment and b.fragment and a.fragment.cpu == b.fragment.cpu
    ledger, _changes = repair(t.with_online(t.online - CPUSet([a.fragment.cpu])), ledger)
    check_invariants(ledger)
    na, nb = ledger.allocations["a"], ledger.allocations["b"]
    assert na.fragment and nb.fragment and na.fragment.cpu != a.fragment.cpu
    assert na.fragment.pieces == 50 and nb.fragment.pieces == 30
    assert t.cpus[na.fragment.cpu].l3 == t.cpus[na.whole.first()].l3


def test_shared_pool_keeps_its_minimum(machine) -> None:
    t = machine("a")
    ledger, a = alloc(t, ledger_for(t), "a", bind("7"))
    ledger, _changes = repair(t.with_online(a.whole), ledger)  # the only shared CPU went away
    check_invariants(ledger)
    assert len(ledger.shared) == 1 and ledger.allocations["a"].degraded


def test_pinned_allocation_waits_for_its_cpu(machine) -> None:
    t = machine("a")
    ledger, _ = alloc(t, ledger_for(t), "p", bind("2", cpuset="2-3"))
    ledger, _ = repair(t.with_online(t.online - CPUSet([3])), ledger)
    assert ledger.allocations["p"].whole == CPUSet([2]) and ledger.allocations["p"].degraded
    ledger, _ = repair(t, ledger)
    assert ledger.allocations["p"].whole == CPUSet([2, 3]) and not ledger.allocations["p"].degraded


def test_new_cpus_join_the_shared_pool(machine) -> None:
    t = machine("a")
    ledger, _ = alloc(t, ledger_for(t).with_online(CPUSet.parse("0-3")), "x", bind("2"))
    ledger, changes = repair(t, ledger)
    assert changes == [] and ledger.shared == t.online - ledger.allocations["x"].whole


def test_newly_reserved_cpu_is_given_back(machine) -> None:
    from dataclasses import replace

    t = machine("a")
    ledger, a = alloc(t, ledger_for(t), "a", bind("2"))
    ledger = replace(ledger, reserved=a.whole)
    ledger, _ = repair(t, ledger)
    check_invariants(ledger)
    assert ledger.allocations["a"].whole.isdisjoint(a.whole)
    assert len(ledger.allocations["a"].whole) == 2
