"""Whole-core preference (issue 14 §1): packed takes whole cores for every even part and a lone
thread only for an odd remainder, the free sibling of a half-used core first; full-pcpus takes
whole cores of any size; spread-pcpus shares its cores with later spread-pcpus requests."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.pools import Ledger
from cpuservice.model.topology import CPU, Topology
from cpuservice.placement.repair import repair
from tests.props import examples

from .helpers import alloc, bind, ledger_for
from .test_capacity import POOLS, SEED, STEPS, build


def _lone(t: Topology, cpus: CPUSet) -> set[int]:
    """Cores of which ``cpus`` holds some threads but not all."""
    return {t.cpus[c].core for c in cpus} - {k for k, th in t.cores.items() if th <= cpus}


def _pinned(t: Topology, ledger: Ledger, cpus: str, name: str = "pin") -> Ledger:
    ledger, _ = alloc(t, ledger, name, bind(str(len(CPUSet.parse(cpus))), cpuset=cpus))
    return ledger


def test_two_packed_cpus_take_a_whole_core_while_whole_cores_are_free(machine) -> None:
    """The issue's example: one thread of each core of L3 group 1 (cores 8-15) is held, so that
    group has 8 loose threads, the best fit for 2 CPUs; packed still takes one whole core."""
    t = machine("c")
    ledger = _pinned(t, ledger_for(t, reserved=t.cores[0]), "8-15")
    _, a = alloc(t, ledger, "x", bind("2"))
    assert a.whole in t.cores.values(), a.whole
    assert not a.whole & CPUSet.parse("72-79")


def test_even_packed_requests_take_only_whole_cores(machine) -> None:
    t = machine("c")
    ledger = _pinned(t, ledger_for(t, reserved=t.cores[0]), "8-15,17,19")
    for i, size in enumerate((2, 4, 6)):  # node 0 keeps whole cores 1-7 for them
        ledger, a = alloc(t, ledger, f"x{i}", bind(str(size)))
        assert not _lone(t, a.whole), (size, a.whole)


def test_odd_remainder_takes_the_free_sibling_of_an_l3_neighbour(machine) -> None:
    """3 CPUs: one whole core and, for the odd CPU, the loose thread of core 1 (its other thread
    held) in the same L3 group, rather than a thread of another whole core."""
    t = machine("c")
    ledger = _pinned(t, ledger_for(t), "1")
    _, a = alloc(t, ledger, "x", bind("3"))
    assert 65 in a.whole
    assert len(_lone(t, a.whole)) == 1
    assert len({t.cpus[c].l3 for c in a.whole}) == 1


def test_growing_an_odd_allocation_takes_its_own_sibling(machine) -> None:
    t = machine("c")
    ledger, a = alloc(t, ledger_for(t), "x", bind("3"))
    ledger, b = placement.resize(t, ledger, "x", placement.Decimal(4))
    assert a.whole <= b.whole and not _lone(t, b.whole)


def test_packed_uses_loose_threads_when_no_whole_core_is_left(machine) -> None:
    t = machine("b")  # 8 cores, siblings N and N+8
    ledger = _pinned(t, ledger_for(t), "0-7")
    _, a = alloc(t, ledger, "x", bind("4"))
    assert a.whole <= CPUSet.parse("8-15") and len(a.whole) == 4


def test_fragment_goes_to_a_loose_thread_before_a_whole_core(machine) -> None:
    t = machine("c")
    ledger = _pinned(t, ledger_for(t), "8")
    _, a = alloc(t, ledger, "f", bind("0.5"))
    assert a.fragment is not None and a.fragment.cpu == 72


def test_full_pcpus_shortage_counts_cpus(machine) -> None:
    t = machine("b")
    ledger = _pinned(t, ledger_for(t), "0-2")
    with pytest.raises(InsufficientCPUs) as exc:
        placement.allocate(t, ledger, "x", bind("12", policy="full-pcpus"))
    assert str(exc.value) == (
        "12 CPUs requested but only 10 CPUs on whole free cores are available")
    with pytest.raises(InsufficientCPUs, match=r"^14 CPUs requested but only 13 CPUs are"):
        placement.allocate(t, ledger, "y", bind("14"))


def test_spread_pcpus_share_cores_with_spread_pcpus_not_packed(machine) -> None:
    t = machine("c")
    ledger, s1 = alloc(t, ledger_for(t), "s1", bind("4", policy="spread-pcpus"))
    assert len({t.cpus[c].core for c in s1.whole}) == 4
    ledger = _pinned(t, ledger, "10")  # core 10's thread 74 is loose too
    ledger, p = alloc(t, ledger, "p", bind("1"))
    assert p.whole == CPUSet([74])
    ledger, s2 = alloc(t, ledger, "s2", bind("4", policy="spread-pcpus"))
    assert len({t.cpus[c].core for c in s2.whole}) == 4
    assert {t.cpus[c].core for c in s2.whole} == {t.cpus[c].core for c in s1.whole}


# 4 two-thread cores (0-3) and 4 one-thread cores (4-7), one node, one L3 group
HYBRID = Topology({c: CPU(c, core, 0, 0, 0, 0, True) for c, core in enumerate(
    (0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7))})


def test_full_pcpus_on_a_hybrid_machine_take_whole_cores_of_any_size() -> None:
    t = HYBRID
    ledger = ledger_for(t, min_shared_cpus=0)
    ledger, a = alloc(t, ledger, "a", bind("3", policy="full-pcpus"))
    assert not _lone(t, a.whole) and len(a.whole) == 3
    ledger, b = alloc(t, ledger, "b", bind("1", policy="full-pcpus"))
    assert len(b.whole) == 1 and t.cpus[b.whole.first()].core >= 4
    # left: three two-thread cores and two one-thread cores
    two = bind("2", policy="full-pcpus")
    assert placement.capacity(t, ledger, two) == 4
    ledger, c = alloc(t, ledger, "c", bind("5", policy="full-pcpus"))
    assert not _lone(t, c.whole)
    ledger, d = alloc(t, ledger, "d", bind("1", policy="full-pcpus"))
    assert t.cpus[d.whole.first()].core >= 4
    # left: one two-thread core
    with pytest.raises(InsufficientCPUs, match="whole free cores cannot make exactly 1 CPUs"):
        placement.allocate(t, ledger, "e", bind("1", policy="full-pcpus"))
    assert placement.capacity(t, ledger, bind("1", policy="full-pcpus")) == 0


def test_packed_odd_cpu_prefers_a_one_thread_core_to_splitting_one() -> None:
    t = HYBRID
    _, a = alloc(t, ledger_for(t), "a", bind("3"))
    assert not _lone(t, a.whole)


def test_repair_replaces_a_lost_thread_with_a_loose_one(machine) -> None:
    """A packed allocation of two whole cores loses a thread (offline): its replacement is the
    loose thread 65 in the same L3 group (core 1, other thread held), not a thread of a whole
    core."""
    t = machine("c")
    ledger = _pinned(t, ledger_for(t), "1")
    ledger, a = alloc(t, ledger, "x", bind("4"))
    assert not _lone(t, a.whole) and {t.cpus[c].l3 for c in a.whole} == {0}
    lost = a.whole.first()
    repaired, _ = repair(t.with_online(t.online - CPUSet([lost])), ledger)
    x = repaired.allocations["x"]
    assert x.whole == a.whole - CPUSet([lost]) | CPUSet([65]) and not x.degraded


def _only_free(full: Topology, offline: int, node: str, free: str) -> tuple[Topology, Ledger]:
    """``full`` with CPU ``offline`` offline and, of ``node``'s CPUs, only ``free`` free."""
    t = full.with_online(full.online - CPUSet([offline]))
    held = CPUSet.parse(node) - CPUSet.parse(free) - CPUSet([offline])
    return t, _pinned(t, ledger_for(t), held.format())


def test_packed_takes_a_one_thread_core_before_a_second_lone_thread(machine) -> None:
    """Regression (issue 23, found by hypothesis on a fresh machine): 10 packed CPUs in node 1
    of fixture c, where only three cores are wholly free, core 28 has one thread online (92 is
    offline) and four cores have one free thread. The engine took the three cores and four loose
    threads, leaving core 28 untaken. Whole cores of any size come first for the even part: the
    three cores, core 28, then three loose threads for what no whole core is left to make up."""
    t, ledger = _only_free(machine("c"), 92, "16-31,80-95", "16,18,27,80,82,91,81,88,89,95,28")
    _, a = alloc(t, ledger, "x", bind("10"))
    assert CPUSet.parse("16,18,27,28,80,82,91") <= a.whole, a.whole
    assert len(_lone(t, a.whole)) == 3


def test_even_part_takes_whole_cores_before_loose_threads_in_the_chosen_node(machine) -> None:
    """The same rule where whole cores suffice: 8 CPUs in node 3 with three wholly free cores
    (60-62), one core with its sibling offline (59 offline: core 59 = {123}) and two loose threads
    (48, 63): three cores, core 59 and one loose thread; the old engine took both loose threads
    and left core 59."""
    t, ledger = _only_free(machine("c"), 59, "48-63,112-127", "48,60-63,123-126")
    _, a = alloc(t, ledger, "x", bind("8"))
    assert CPUSet.parse("60-62,123-126") <= a.whole, a.whole
    assert len(_lone(t, a.whole)) == 1


@settings(max_examples=examples(150))
@given(pools=POOLS, steps=STEPS, seed=SEED, size=st.integers(1, 12),
       policy=st.sampled_from(["packed", "full-pcpus"]),
       options=st.fixed_dictionaries({}, optional={
           "numa-alignment": st.sampled_from(["none", "best-effort", "restricted"]),
           "numa-strategy": st.sampled_from(["most-allocated", "least-allocated"])}))
def test_no_core_split_that_need_not_be(machine, pools, steps: int, seed: int,
                                        size: int, policy: str, options: dict[str, Any]) -> None:
    """On any ledger (random allocations, releases and hotplug): a full-pcpus allocation holds
    whole cores only; a packed one holds more than n mod 2 lone threads only when no wholly free
    core was left untaken in the NUMA nodes it landed in."""
    t, ledger = build(machine("c"), pools, steps, seed)
    if policy == "full-pcpus":
        size += size % 2
    try:
        _, a = placement.allocate(t, ledger, "probe", bind(str(size), policy=policy, **{
            k.replace("-", "_"): v for k, v in options.items()}))
    except InsufficientCPUs:
        return
    lone = _lone(t, a.whole)
    if policy == "full-pcpus":
        assert not lone
    elif len(lone) > size % 2:
        free = ledger.allocatable
        nodes = {t.cpus[c].node for c in a.whole}
        untaken = [k for k, th in t.cores.items()
                   if th <= free and t.cpus[th.first()].node in nodes and not th <= a.whole]
        assert not untaken, (a.whole, untaken)
