"""The free view carried with the ledger (model/freeview.py, issue 40): after any sequence of
allocations, releases, resizes, re-packs and hotplug repairs, the view a ledger carries equals
one derived afresh from its pools, cell by cell, with the same counts and whole cores."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from dataclasses import replace
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs, InvalidArgument
from cpuservice.model.freeview import FreeView, classify
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology
from cpuservice.placement.repack import repack
from cpuservice.placement.repair import repair
from tests.props import examples

from .helpers import ledger_for

POLICIES = ("packed", "full-pcpus", "spread-pcpus")


def assert_fresh(topology: Topology, ledger: Ledger) -> None:
    carried = ledger.free_view(topology)
    fresh = FreeView.build(topology, Ledger(ledger.online, ledger.reserved, ledger.isolated,
                                            ledger.granularity, ledger.min_shared_cpus,
                                            ledger.allocations))
    assert carried.cells == fresh.cells
    assert list(carried.counts.items()) == list(fresh.counts.items())  # same order too
    assert (carried.shared, carried.isolated) == (fresh.shared, fresh.isolated)
    if topology.cells.nested:
        assert carried.whole_view() == fresh.whole_view()
    for cell in list(carried.cells):  # pack's classes of each cell, as classify has them
        assert [sorted(x) for x in carried.classes(cell)] == \
            [sorted(x) for x in classify(topology, fresh.cells[cell])]
        if topology.cells.nested:  # and of its whole cores, full-pcpus' candidates
            assert [sorted(x) for x in carried.full_classes(cell)] == \
                [sorted(x) for x in classify(topology, fresh.whole(cell))]
    if topology.cells.nested:  # spread-pcpus' primaries of each cell, as _pick finds them
        shy = spread_cores(topology, ledger)
        for cell, cpus in fresh.cells.items():
            got = carried.primaries(cell, shy)
            assert got is not None
            assert [sorted(x) for x in got] == primaries(topology, cpus, shy)
    if carried.spread is not None:  # the threads spread-pcpus allocations hold, per core
        core_of, spread = topology.levels[3], Counter[int]()
        for a in ledger.bound.values():
            if a.request.options.policy == "spread-pcpus":
                spread.update(core_of[c] for c in a.whole)
        assert carried.spread == dict(spread)
        assert set(carried.spread) == spread_cores(topology, ledger)


def spread_cores(topology: Topology, ledger: Ledger) -> frozenset[int]:
    """Cores on which a spread-pcpus allocation holds a thread, from the allocations."""
    core_of = topology.levels[3]
    return frozenset(core_of[c] for a in ledger.bound.values()
                     if a.request.options.policy == "spread-pcpus" for c in a.whole)


def primaries(topology: Topology, cands: frozenset[int], shy: frozenset[int]
              ) -> list[list[int]]:
    """The lowest candidate thread of each partly free core spread-pcpus uses (shy), of each
    wholly free core, of each other partly free core, by grouping the candidates by core."""
    core_of, size = topology.levels[3], topology.sizes[3]
    cores: dict[int, list[int]] = {}
    for c in cands:
        cores.setdefault(core_of[c], []).append(c)
    return [sorted(min(t) for k, t in cores.items() if len(t) != size[k] and k in shy),
            sorted(min(t) for k, t in cores.items() if len(t) == size[k]),
            sorted(min(t) for k, t in cores.items() if len(t) != size[k] and k not in shy)]


def walk(topology: Topology, ledger: Ledger, rng: random.Random, steps: int) -> None:
    full = topology
    ledger.free_view(topology)  # the first view is derived; every later one carried
    for serial in range(steps):
        op = rng.random()
        names = sorted(ledger.allocations)
        opts: dict[str, object] = {"bind": rng.random() < 0.9,
                                   "policy": rng.choice(POLICIES)}
        if opts["bind"] and rng.random() < 0.3:
            opts["movable"] = "anywhere"
        cpus = str(rng.randint(1, 6)) if rng.random() < 0.7 else f"{rng.randint(0, 3)}.5"
        try:
            request = Request.parse(cpus, opts)
            if op < 0.55:
                try:
                    ledger, _ = placement.allocate(topology, ledger, f"a{serial}", request)
                except InsufficientCPUs:
                    found = repack(topology, ledger, f"a{serial}", request)
                    if found is not None:
                        ledger = found[0]
            elif op < 0.8 and names:
                ledger = placement.release(ledger, rng.choice(names))
            elif op < 0.9 and names:
                ledger, _ = placement.resize(topology, ledger, rng.choice(names),
                                             Decimal(cpus))
            else:
                cpu = CPUSet([rng.choice(full.all.sorted())])
                now = (topology.online | cpu if rng.random() < 0.4
                       else topology.online - cpu)
                if now:
                    topology = full.with_online(now)
                    ledger, _ = repair(topology, ledger)
                    ledger.free_view(topology)
        except (InsufficientCPUs, InvalidArgument):
            pass
        if serial % 7 == 3:  # a choice that asks for the spread cores (then carried on)
            with contextlib.suppress(InsufficientCPUs, InvalidArgument):
                placement.place(topology, ledger, Request.parse("1", {"bind": True}))
        assert_fresh(topology, ledger)


@pytest.mark.parametrize("name", ["b", "c", "d", "hybrid", "offline", "bulldozer"])
@settings(max_examples=examples(25))
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 60),
       reserved=st.lists(st.integers(0, 99), max_size=3), min_shared=st.integers(1, 3))
def test_the_carried_view_is_the_derived_one(machine, name: str, seed: int, steps: int,
                                             reserved: list[int], min_shared: int) -> None:
    topology = machine(name)
    online = topology.online.sorted()  # reserved CPUs may be isolated ones too (machine d)
    ledger = ledger_for(topology, reserved=CPUSet(online[i % len(online)] for i in reserved),
                        min_shared_cpus=min_shared)
    walk(topology, ledger, random.Random(seed), steps)


def test_a_ledger_made_without_its_parent_derives_its_view(machine) -> None:
    """with_online (a replace, as repair makes) carries nothing: the view is derived again."""
    topology = machine("b")
    ledger = ledger_for(topology)
    ledger, _ = placement.allocate(topology, ledger, "x", Request.parse("2", {"bind": True}))
    view = ledger.free_view(topology)
    other = ledger.with_online(ledger.online)
    assert other.free_view(topology) is not view
    assert_fresh(topology, other)


def test_a_reserved_isolated_cpu_is_never_allocated(machine) -> None:
    """Found while building the carried view: on machine d (CPUs 20-21 isolated) with CPU 20
    reserved, free_isolated offered 20 to bound allocations and check_invariants then failed
    ("reserved CPUs 20 are allocated"); the empty ledger already broke "the shared pool holds
    every reserved CPU". A reserved CPU is never allocated, isolated or not."""
    topology = machine("d")
    assert {20, 21} <= set(topology.isolated.ids)
    ledger = ledger_for(topology, reserved=CPUSet([20]))
    from cpuservice.model.pools import check_invariants
    check_invariants(ledger)
    taken: set[int] = set()
    for i in range(len(topology.online)):
        try:
            ledger, a = placement.allocate(topology, ledger, f"a{i}",
                                           Request.parse("1", {"bind": True}))
        except InsufficientCPUs:
            break
        check_invariants(ledger)
        taken |= set(a.whole.ids)
    assert 21 in taken and 20 not in taken
    assert_fresh(topology, ledger)


@pytest.mark.parametrize("name", ["c", "d", "hybrid"])
@settings(max_examples=examples(25))
@given(seed=st.integers(0, 2**32 - 1))
def test_many_changes_at_once_are_the_changes_in_turn(machine, name: str, seed: int) -> None:
    """Ledger.with_allocations (re-packing's relaxed ledgers and evictions, issue 40) is
    with_allocation of each in turn: the same allocations in the same order, the same pools
    carried (exclusive, fragment pieces, borrowers) and a view equal to a derived one, spread
    cores included."""
    topology, rng = machine(name), random.Random(seed)
    ledger = ledger_for(topology)
    for i in range(40):
        bind = rng.random() < 0.9
        opts = {"bind": bind, "policy": rng.choice(POLICIES),
                "borrow": not bind and rng.random() < 0.5}
        cpus = str(rng.randint(1, 4)) if rng.random() < 0.7 else f"{rng.randint(0, 2)}.5"
        with contextlib.suppress(InsufficientCPUs, InvalidArgument):
            ledger, _ = placement.allocate(topology, ledger, f"a{i}", Request.parse(cpus, opts))
    with contextlib.suppress(InsufficientCPUs, InvalidArgument):  # the spread cores asked for
        placement.place(topology, ledger, Request.parse("1", {"bind": True}))
    _ = ledger.exclusive, ledger.fragment_pieces, ledger.borrowers
    names = sorted(ledger.allocations)
    changed = []
    for n in rng.sample(names, min(len(names), rng.randint(2, 12))):
        a = ledger.allocations[n]
        drop = CPUSet(c for c in a.whole if rng.random() < 0.5)
        changed.append(replace(a, whole=a.whole - drop))
    changed.append(Allocation("new", Request.parse("1", {"borrow": True})))  # a borrower
    at_once = ledger.with_allocations(changed)
    in_turn = ledger
    for a in changed:
        in_turn = in_turn.with_allocation(a)
    assert list(at_once.allocations.items()) == list(in_turn.allocations.items())
    assert list(at_once.bound.items()) == list(in_turn.bound.items())
    assert at_once.exclusive == in_turn.exclusive
    assert at_once.fragment_pieces == in_turn.fragment_pieces
    assert at_once.borrowers == in_turn.borrowers
    assert_fresh(topology, at_once)
    assert at_once.free_view(topology).spread == in_turn.free_view(topology).spread
