from __future__ import annotations

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import check_invariants
from cpuservice.placement.repair import repair

from .helpers import alloc, bind, ledger_for, nodes_of


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


def test_shared_pool_short_moves_onto_free_isolated_cpus(machine) -> None:
    """Hypothesis' example: on d (10 online, 20-21 isolated) CPU 17 comes online, 7.01 bound
    takes the 7 + 1 shared CPUs it may (not the isolated ones), and 17 goes offline again: the
    shared pool is empty, and the allocation moves a CPU onto a free isolated one instead of
    giving it back (7 + 1 of the 8 non-isolated CPUs, one left to the shared pool)."""
    full = machine("d")
    assert full.isolated == CPUSet([20, 21]) and 17 not in full.online
    up = full.with_online(full.online | CPUSet([17]))
    ledger, a = alloc(up, ledger_for(full).with_online(up.online), "a", bind("7.01"))
    assert a.fragment and not a.held & full.isolated and 17 not in a.held
    ledger, changes = repair(full, ledger)
    check_invariants(ledger)
    new = ledger.allocations["a"]
    assert not new.degraded and len(new.whole) == 7 and new.fragment == a.fragment
    assert len(new.whole - a.whole) == 1 and new.whole - a.whole <= full.isolated
    assert len(ledger.shared) == 1 and ledger.shared <= a.whole
    assert [c.reason for c in changes] == [f"lost {a.whole - new.whole}, "
                                           f"gained {new.whole - a.whole}"]


def test_allocation_that_fits_only_elsewhere_moves_rather_than_degrades(machine) -> None:
    """numa-alignment restricted on b (two nodes of 8): "x" and "y" fill node 0, a CPU of "x"
    goes offline; the 3 it keeps anchor it to node 0, which is full, but all 4 fit in node 1:
    repair places it there instead of leaving it degraded."""
    t = machine("b")
    ledger, x = alloc(t, ledger_for(t), "x", bind("4", numa_alignment="restricted"))
    ledger, y = alloc(t, ledger, "y", bind("4", numa_alignment="restricted"))
    assert nodes_of(t, x.whole | y.whole) == {0}
    down = t.with_online(t.online - CPUSet([x.whole.first()]))
    ledger, _ = repair(down, ledger)
    check_invariants(ledger)
    new = ledger.allocations["x"]
    assert not new.degraded and len(new.whole) == 4 and nodes_of(t, new.whole) == {1}
    assert ledger.allocations["y"] == y


def test_partial_regrowth_never_takes_its_own_fragment_cpu(machine) -> None:
    """Hypothesis' example on d (0.01 placed, CPU 4 offline): full-pcpus 3.01 holds 0-1,16
    and the fragment CPU 2; CPU 0
    goes offline, so it keeps 16 (its core 0-1 is no longer whole) and cannot be made whole.
    Partial regrowth must not take CPU 2, which it already holds as its fragment, as a whole
    CPU."""
    full = machine("d")
    t = full.with_online(full.online - CPUSet([4]))
    ledger, _ = alloc(full, ledger_for(full), "z", bind("0.01"))
    ledger, _ = repair(t, ledger)
    ledger, a = alloc(t, ledger, "a", bind("3.01", policy="full-pcpus", numa_alignment="none"))
    ledger, _ = alloc(t, ledger.without("z"), "b", bind("2.01"))
    assert a.whole == CPUSet([0, 1, 16]) and a.fragment and a.fragment.cpu == 2
    ledger, _ = repair(full.with_online(t.online - CPUSet([0])), ledger)
    check_invariants(ledger)
    new = ledger.allocations["a"]
    assert new.degraded and new.fragment == a.fragment and 2 not in new.whole
