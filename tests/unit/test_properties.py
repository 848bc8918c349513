"""Random allocate/release/resize/offline/online sequences on every fixture machine."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs, InvalidArgument
from cpuservice.model.pools import Ledger, check_index, check_invariants
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology
from cpuservice.placement.repair import repair
from tests.props import examples

from .helpers import PLACEMENT_OPTIONS, ledger_for

OPTIONS = st.fixed_dictionaries({}, optional={"bind": st.booleans(), **PLACEMENT_OPTIONS})
AMOUNT = st.decimals(min_value=Decimal("0.01"), max_value=Decimal(20), places=2)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), AMOUNT, OPTIONS),
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("resize"), st.integers(0, 30), AMOUNT),
        st.tuples(st.just("offline"), st.integers(0, 2000)),
        st.tuples(st.just("online"), st.integers(0, 2000)),
    ),
    max_size=40,
)


def assert_degraded_only_when_it_cannot_fit(topology: Topology, ledger: Ledger) -> None:
    """After repair: an allocation that is not degraded has its full size, and a degraded one
    cannot be placed in full next to the others, neither around what it keeps nor afresh
    (allocations made while more CPUs were online may not all fit any more)."""
    for a in ledger.bound.values():
        if not a.degraded:
            assert len(a.whole) == a.request.whole, a
            assert (a.fragment is None) == (a.request.fraction == 0), a
            continue
        base = ledger.without(a.name)
        for keep, fragment in ((a.whole, a.fragment), (CPUSet(), None)):
            try:
                fits = placement.bound_cpus(topology, base, a.request, keep, fragment)
            except (InsufficientCPUs, InvalidArgument):
                continue
            raise AssertionError(f"{a} is degraded but fits as {fits}")


@pytest.mark.parametrize("name", ["a", "b", "c", "d", "lab"])
@settings(max_examples=examples(60))
@given(ops=OPS, granularity=st.sampled_from([100, 1000]))
@example(  # on d: the shared pool empties, 7.01 must move onto an isolated CPU, not degrade
    ops=[("online", 187), ("allocate", Decimal("7.01"), {"bind": True})], granularity=100
)
@example(  # on d: a degraded full-pcpus allocation must not take its own fragment CPU whole
    ops=[("allocate", Decimal("0.01"), {"bind": True}), ("offline", 508),
         ("allocate", Decimal("3.01"), {"bind": True, "policy": "full-pcpus",
                                        "numa-alignment": "none"}),
         ("release", 0), ("allocate", Decimal("2.01"), {"bind": True}), ("offline", 0)],
    granularity=100,
)
def test_random_sequences_keep_invariants(machine, name: str, ops, granularity: int) -> None:
    full = machine(name)
    topology = full
    initial = ledger_for(full, granularity=granularity)
    ledger = initial
    serial = 0
    for op in ops:
        names = sorted(ledger.allocations)
        try:
            if op[0] == "allocate":
                request = Request.parse(str(op[1]), op[2])
                ledger, _ = placement.allocate(topology, ledger, f"a{serial}", request)
                serial += 1
            elif op[0] == "release" and names:
                ledger = placement.release(ledger, names[op[1] % len(names)])
            elif op[0] == "resize" and names:
                ledger, _ = placement.resize(topology, ledger, names[op[1] % len(names)], op[2])
            elif op[0] in ("offline", "online"):
                cpus = full.all.sorted()
                cpu = CPUSet([cpus[op[1] % len(cpus)]])
                online = topology.online - cpu if op[0] == "offline" else topology.online | cpu
                if online:
                    topology = full.with_online(online)
                    ledger, _ = repair(topology, ledger)
                    assert_degraded_only_when_it_cannot_fit(topology, ledger)
        except (InsufficientCPUs, InvalidArgument):
            pass
        check_invariants(ledger)
        check_index(ledger)
        for a in ledger.allocations.values():
            assert a.held <= topology.online
    topology = full
    ledger, _ = repair(topology, ledger)
    check_invariants(ledger)
    assert_degraded_only_when_it_cannot_fit(topology, ledger)
    for n in sorted(ledger.allocations):
        ledger = placement.release(ledger, n)
    assert ledger.shared == initial.shared and ledger.free_isolated == initial.free_isolated
