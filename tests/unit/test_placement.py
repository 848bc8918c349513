from __future__ import annotations

from decimal import Decimal

import pytest

from cpuservice import placement
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import (
    AllocationExists,
    InsufficientCPUs,
    InvalidArgument,
    NoSuchAllocation,
)
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.request import Request

from .helpers import alloc, bind, ledger_for, nodes_of


def test_seed_example(machine) -> None:
    t = machine("a")
    ledger = ledger_for(t)
    ledger, u1 = alloc(t, ledger, "u1", Request.parse("1"))
    p = placement.describe(t, ledger, u1)
    assert p.cpus == CPUSet.parse("0-7") and p.cpu_quota_usec == 1_000_000

    ledger, b1 = alloc(t, ledger, "b1", bind("1"))
    assert len(b1.whole) == 1 and b1.fragment is None
    assert len(ledger.shared) == 7 and placement.describe(t, ledger, u1).cpus == ledger.shared
    assert placement.describe(t, ledger, b1).cpu_quota_usec is None

    ledger, b12 = alloc(t, ledger, "b12", bind("1.2"))
    p = placement.describe(t, ledger, b12)
    assert len(p.whole) == 1 and p.fragment is not None and p.fragment.pieces == 20
    assert p.cpu_quota_usec == 1_200_000 and p.cpu_weight == 2000
    assert p.shares == {next(iter(p.whole)): 100, p.fragment.cpu: 20}
    assert len(ledger.shared) == 5 and ledger.fragment == CPUSet([p.fragment.cpu])

    ledger, u12 = alloc(t, ledger, "u12", Request.parse("1.2"))
    p = placement.describe(t, ledger, u12)
    assert p.cpus == ledger.shared and len(p.cpus) == 5 and p.cpu_quota_usec == 1_200_000


def test_socket_sized_request_takes_a_whole_socket(machine) -> None:
    for name, size in (("b", 8), ("c", 64)):
        t = machine(name)
        _, a = alloc(t, ledger_for(t), "s", bind(str(size)))
        assert a.whole in t.sockets.values(), name


def test_two_cpus_on_smt2_take_one_core(machine) -> None:
    for name in ("b", "c", "lab"):
        t = machine(name)
        _, a = alloc(t, ledger_for(t), "x", bind("2"))
        assert a.whole in t.cores.values(), name


def test_three_cpus_whole_core_plus_thread_same_socket(machine) -> None:
    for name in ("b", "c"):
        t = machine(name)
        _, a = alloc(t, ledger_for(t), "x", bind("3"))
        cores = {t.cpus[c].core for c in a.whole}
        assert len(cores) == 2 and any(t.cores[k] <= a.whole for k in cores)
        assert len({t.cpus[c].socket for c in a.whole}) == 1
        assert len({t.cpus[c].l3 for c in a.whole}) == 1


def test_single_thread_prefers_a_partly_used_core(machine) -> None:
    t = machine("b")
    ledger, a = alloc(t, ledger_for(t), "a", bind("1"))
    ledger, b = alloc(t, ledger, "b", bind("1"))
    assert t.cpus[a.whole.first()].core == t.cpus[b.whole.first()].core


def test_reserved_cpus_never_handed_out(machine) -> None:
    t = machine("b")
    ledger = ledger_for(t, reserved=CPUSet.parse("0,8"), min_shared_cpus=2)
    for i in range(7):
        ledger, a = alloc(t, ledger, f"x{i}", bind("2"))
        assert not a.whole & ledger.reserved
    assert ledger.shared == CPUSet.parse("0,8")
    with pytest.raises(InsufficientCPUs):
        placement.allocate(t, ledger, "more", bind("1"))
    with pytest.raises(InvalidArgument, match="reserved"):
        placement.allocate(t, ledger_for(t, reserved=CPUSet([0])), "p", bind("1", cpuset="0"))


def test_spread_pcpus_one_thread_per_core(tmp_path) -> None:
    from cpuservice.host.sysfs import discover
    from cpuservice.model.fixtures import Machine, write_sysfs

    t = discover(write_sysfs(tmp_path, Machine(1, 8, 2)))  # 8 cores, 16 threads
    _, a = alloc(t, ledger_for(t), "s", bind("8", policy="spread-pcpus"))
    assert len({t.cpus[c].core for c in a.whole}) == 8
    _, p = alloc(t, ledger_for(t), "p", bind("8"))
    assert len({t.cpus[c].core for c in p.whole}) == 4  # packed takes whole cores


def test_spread_pcpus_across_nodes_only_without_numa_alignment(machine) -> None:
    t = machine("b")  # 2 nodes of 4 cores: NUMA locality first, unless told otherwise
    _, a = alloc(t, ledger_for(t), "s", bind("8", policy="spread-pcpus"))
    assert len(nodes_of(t, a.whole)) == 1
    _, b = alloc(t, ledger_for(t), "s", bind("8", policy="spread-pcpus", numa_alignment="none"))
    assert len({t.cpus[c].core for c in b.whole}) == 8


def test_spread_pcpus_within_a_node(machine) -> None:
    t = machine("c")
    _, a = alloc(t, ledger_for(t), "s", bind("8", policy="spread-pcpus"))
    assert len({t.cpus[c].core for c in a.whole}) == 8 and len(nodes_of(t, a.whole)) == 1


def test_full_pcpus(machine) -> None:
    t = machine("b")
    with pytest.raises(InvalidArgument, match="multiple of 2"):
        placement.allocate(t, ledger_for(t), "x", bind("3", policy="full-pcpus"))
    ledger, a = alloc(t, ledger_for(t), "single", bind("1"))
    ledger, b = alloc(t, ledger, "f", bind("4", policy="full-pcpus"))
    for k in {t.cpus[c].core for c in b.whole}:
        assert t.cores[k] <= b.whole
    assert not {t.cpus[c].core for c in a.whole} & {t.cpus[c].core for c in b.whole}


def test_exclusive_pcpu_avoids_cores_of_same_policy(machine) -> None:
    t = machine("b")
    ledger, a = alloc(t, ledger_for(t), "a", bind("1", exclusive="pcpu"))
    ledger, b = alloc(t, ledger, "b", bind("1", exclusive="pcpu"))
    assert t.cpus[a.whole.first()].core != t.cpus[b.whole.first()].core
    ledger, c = alloc(t, ledger, "c", bind("1"))  # no exclusivity: may share a core
    assert t.cpus[c.whole.first()].core in {t.cpus[a.whole.first()].core,
                                           t.cpus[b.whole.first()].core}


def test_exclusive_numa_then_falls_back_to_pcpu(machine) -> None:
    t = machine("b")
    ledger, a = alloc(t, ledger_for(t), "a", bind("2", exclusive="numa"))
    ledger, b = alloc(t, ledger, "b", bind("2", exclusive="numa"))
    assert nodes_of(t, a.whole).isdisjoint(nodes_of(t, b.whole))
    ledger, c = alloc(t, ledger, "c", bind("2", exclusive="numa"))  # both nodes used: pcpu level
    used = {t.cpus[x].core for x in a.whole | b.whole}
    assert used.isdisjoint({t.cpus[x].core for x in c.whole})


def test_numa_single_node_fails_rather_than_span(machine) -> None:
    t = machine("b")
    ledger, _ = alloc(t, ledger_for(t), "a", bind("4"))
    ledger, _ = alloc(t, ledger, "b", bind("4", numa_strategy="least-allocated"))
    with pytest.raises(InsufficientCPUs, match="single-numa-node"):
        placement.allocate(t, ledger, "c", bind("5", numa_alignment="single-numa-node"))
    ledger, c = alloc(t, ledger, "c", bind("5"))  # best-effort spans
    assert len(nodes_of(t, c.whole)) == 2


def test_best_effort_never_spans_when_a_node_has_room(machine) -> None:
    t = machine("c")
    ledger = ledger_for(t)
    ledger, _ = alloc(t, ledger, "a", bind("20"))
    for i, size in enumerate((12, 16, 7, 30)):
        ledger, a = alloc(t, ledger, f"x{i}", bind(str(size)))
        assert len(nodes_of(t, a.whole)) == 1, size


def test_restricted_requires_the_minimal_number_of_nodes(machine) -> None:
    t = machine("c")  # 4 nodes of 32
    ledger, _ = alloc(t, ledger_for(t), "a", bind("20"))
    ledger, _ = alloc(t, ledger, "b", bind("20"))
    ledger, _ = alloc(t, ledger, "c", bind("20"))
    ledger, _ = alloc(t, ledger, "d", bind("20"))  # every node has 12 free
    with pytest.raises(InsufficientCPUs, match="restricted"):
        placement.allocate(t, ledger, "r", bind("20", numa_alignment="restricted"))
    _, spanning = alloc(t, ledger, "r", bind("20"))
    assert len(nodes_of(t, spanning.whole)) == 2
    _, r = alloc(t, ledger_for(t), "r", bind("40", numa_alignment="restricted"))
    assert len(nodes_of(t, r.whole)) == 2


def test_numa_strategies(machine) -> None:
    t = machine("b")
    ledger, _ = alloc(t, ledger_for(t), "a", bind("2"))
    _, most = alloc(t, ledger, "m", bind("2"))
    _, least = alloc(t, ledger, "l", bind("2", numa_strategy="least-allocated"))
    assert nodes_of(t, most.whole) == {0} and nodes_of(t, least.whole) == {1}
    _, even = alloc(t, ledger_for(t, min_shared_cpus=0), "e",
                    bind("12", numa_strategy="distribute-evenly"))
    assert [len(even.whole & n) for n in t.nodes.values()] == [6, 6]


def test_socket_sized_on_epyc_stays_in_one_socket(machine) -> None:
    t = machine("c")
    ledger, _ = alloc(t, ledger_for(t), "a", bind("1"))
    _, a = alloc(t, ledger, "s", bind("64"))
    assert a.whole == t.sockets[1]


def test_fractional_prefers_fragment_near_whole_cpus(machine) -> None:
    t = machine("b")
    ledger, a = alloc(t, ledger_for(t), "a", bind("1.3"))
    assert a.fragment is not None
    assert t.cpus[a.fragment.cpu].core == t.cpus[a.whole.first()].core  # SMT sibling
    ledger, b = alloc(t, ledger, "b", bind("0.5"))
    assert b.fragment is not None and b.fragment.cpu == a.fragment.cpu  # existing fragment first
    assert ledger.free_pieces(a.fragment.cpu) == 20
    ledger, c = alloc(t, ledger, "c", bind("2.4"))
    assert c.fragment is not None and c.fragment.cpu != a.fragment.cpu
    assert t.cpus[c.fragment.cpu].l3 == t.cpus[c.whole.first()].l3


def test_fractional_zero_whole_and_weights(machine) -> None:
    t = machine("a")
    ledger, a = alloc(t, ledger_for(t, granularity=1000), "a", bind("0.005"))
    p = placement.describe(t, ledger, a)
    assert p.whole == CPUSet() and p.fragment is not None and p.fragment.pieces == 5
    assert p.cpu_weight == 50 and p.cpu_quota_usec == 5_000
    with pytest.raises(InvalidArgument, match="granularity 100"):
        placement.allocate(t, ledger_for(t), "b", bind("0.005"))


def test_explicit_cpuset(machine) -> None:
    t = machine("d")
    ledger, a = alloc(t, ledger_for(t), "p", bind("2", cpuset="4-5"))
    assert a.whole == CPUSet.parse("4-5")
    with pytest.raises(InsufficientCPUs, match="held by p"):
        placement.allocate(t, ledger, "q", bind("1", cpuset="5"))
    with pytest.raises(InvalidArgument, match="offline"):
        placement.allocate(t, ledger, "q", bind("1", cpuset="3"))
    with pytest.raises(InvalidArgument, match="does not exist"):
        placement.allocate(t, ledger, "q", bind("1", cpuset="9"))
    with pytest.raises(InvalidArgument, match="names 1 CPUs"):
        placement.allocate(t, ledger, "q", bind("2", cpuset="9"))


def test_isolated_cpus_only_for_bound(machine) -> None:
    t = machine("d")
    ledger = ledger_for(t)
    assert not ledger.shared & t.isolated
    ledger, _a = alloc(t, ledger, "iso", bind("2", cpuset="20-21"))
    ledger, u = alloc(t, ledger, "u", Request.parse("2"))
    assert not placement.describe(t, ledger, u).cpus & t.isolated


def test_capacity(machine) -> None:
    import tempfile

    from cpuservice.host.sysfs import discover
    from cpuservice.model.fixtures import Machine, write_sysfs

    t = discover(write_sysfs(tempfile.mkdtemp(), Machine(2, 2, nodes=2)))
    ledger = ledger_for(t, min_shared_cpus=0)
    one = bind("1", numa_alignment="single-numa-node")
    two = bind("2", numa_alignment="single-numa-node")
    assert placement.capacity(t, ledger, one) == 4
    assert placement.capacity(t, ledger, two) == 2
    ledger, _ = alloc(t, ledger, "x", one)
    assert placement.capacity(t, ledger, one) == 3
    assert placement.capacity(t, ledger, two) == 1
    assert placement.capacity(t, ledger, bind("0.5")) == 6
    assert placement.capacity(t, ledger, Request.parse("3")) == placement.UNLIMITED
    with pytest.raises(InsufficientCPUs):
        placement.capacity(t, ledger, Request.parse("5"))


def test_resize_keeps_cpus(machine) -> None:
    t = machine("c")
    ledger, a = alloc(t, ledger_for(t), "a", bind("4"))
    ledger, grown = placement.resize(t, ledger, "a", Decimal("6"))
    check_invariants(ledger)
    assert a.whole <= grown.whole and len(grown.whole) == 6
    assert len({t.cpus[c].l3 for c in grown.whole}) == 1
    ledger, shrunk = placement.resize(t, ledger, "a", Decimal("2.5"))
    check_invariants(ledger)
    assert shrunk.whole <= grown.whole and shrunk.whole in t.cores.values()
    assert shrunk.fragment is not None and shrunk.fragment.pieces == 50
    ledger, again = placement.resize(t, ledger, "a", Decimal("2.7"))
    assert again.fragment is not None and again.fragment.cpu == shrunk.fragment.cpu
    ledger, _u = alloc(t, ledger, "u", Request.parse("1"))
    ledger, u2 = placement.resize(t, ledger, "u", Decimal("3"))
    assert placement.describe(t, ledger, u2).cpu_quota_usec == 3_000_000
    with pytest.raises(NoSuchAllocation):
        placement.resize(t, ledger, "zz", Decimal("1"))


def test_errors_leave_the_ledger_unchanged(machine) -> None:
    t = machine("b")
    ledger, _ = alloc(t, ledger_for(t), "a", bind("2"))
    before = (ledger.shared, dict(ledger.allocations))
    for cpus, opts, error in [
        ("100", {"bind": True}, InsufficientCPUs),
        ("15", {"bind": True}, InsufficientCPUs),
        ("1.234", {"bind": True}, InvalidArgument),
        ("17", {}, InsufficientCPUs),
    ]:
        with pytest.raises(error):
            placement.allocate(t, ledger, "b", Request.parse(cpus, opts))
    with pytest.raises(AllocationExists):
        placement.allocate(t, ledger, "a", bind("1"))
    with pytest.raises(InvalidArgument, match="allocation name"):
        placement.allocate(t, ledger, "../x", bind("1"))
    assert (ledger.shared, dict(ledger.allocations)) == before
    assert placement.release(ledger, "a").shared == t.online
    with pytest.raises(NoSuchAllocation):
        placement.release(ledger, "nope")


def test_min_shared_cpus(machine) -> None:
    t = machine("a")
    ledger, _ = alloc(t, ledger_for(t, min_shared_cpus=2), "a", bind("6"))
    with pytest.raises(InsufficientCPUs, match="min_shared_cpus"):
        placement.allocate(t, ledger, "b", bind("0.5"))
    assert Ledger(t.online, min_shared_cpus=0).shared_budget == 8


def test_a_fragment_joins_a_fragment_cpu_rather_than_take_the_pools_last_cpu(machine) -> None:
    """The shared pool's floor is part of the choice: 1.5 CPUs where 2 are shared and
    min_shared_cpus is 1 take one of them whole and join the fragment CPU on the other node,
    rather than be refused for taking both (the fragment's nearest fresh CPU). Capacity counts
    the same; with alignment restricted the fragment may not leave the node, and the refusal
    names the floor."""
    t = machine("b")
    ledger, _ = alloc(t, ledger_for(t, min_shared_cpus=1), "f", bind("0.5"))
    assert ledger.fragment == CPUSet.parse("0")
    ledger, _ = alloc(t, ledger, "w", bind("13", cpuset="1-13"))
    assert ledger.shared == CPUSet.parse("14-15")
    new, a = alloc(t, ledger, "x", bind("1.5"))
    assert len(a.whole) == 1 and a.whole <= CPUSet.parse("14-15")
    assert a.fragment is not None and a.fragment.cpu == 0
    assert len(new.shared) == 1
    check_invariants(new)
    assert placement.capacity(t, ledger, bind("1.5")) == 1
    with pytest.raises(InsufficientCPUs,
                       match=r"min_shared_cpus=1 CPUs in the shared pool \(2 now, 2 needed"):
        placement.allocate(t, ledger, "x", bind("1.5", numa_alignment="restricted"))
