"""check_invariants' quick look at the allocations (a few set operations over all of them, on
every change) says "fine" exactly when the CPU-by-CPU walk finds nothing (issue 40)."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.pools import (
    Allocation,
    Fragment,
    InvariantError,
    Ledger,
    _allocation_problems,
    _allocations_hold_well,
    check_invariants,
)
from cpuservice.model.request import Request
from tests.props import examples

BIND = Request.parse("1", {"bind": True})
ONLINE = CPUSet(range(8))


def _ledger(allocations: list[Allocation], granularity: int = 100) -> Ledger:
    return Ledger(ONLINE, granularity=granularity, min_shared_cpus=0,
                  allocations=MappingProxyType({a.name: a for a in allocations}))


ALLOCATION = st.tuples(
    st.sets(st.integers(0, 9), max_size=3),  # 8 and 9 are offline
    st.none() | st.tuples(st.integers(0, 9), st.integers(-1, 101)),
)


@settings(max_examples=examples(300))
@given(st.lists(ALLOCATION, max_size=5))
def test_the_quick_look_agrees_with_the_walk(spec: list[tuple[set[int], tuple[int, int] | None]]
                                             ) -> None:
    ledger = _ledger([Allocation(f"a{i}", BIND, CPUSet(whole), Fragment(*frag) if frag else None)
                      for i, (whole, frag) in enumerate(spec)])
    assert _allocations_hold_well(ledger) == (not _allocation_problems(ledger))


@pytest.mark.parametrize("allocations, named", [
    ([Allocation("a", BIND, CPUSet({1, 2})), Allocation("b", BIND, CPUSet({2}))],
     "CPU 2 is exclusive to both 'a' and 'b'"),
    ([Allocation("a", BIND, CPUSet({7, 8}))], "allocation 'a' holds offline CPUs 8"),
    ([Allocation("a", BIND, fragment=Fragment(9, 50))], "allocation 'a' holds offline CPUs 9"),
    ([Allocation("a", BIND, fragment=Fragment(3, 100))],
     "allocation 'a' has a fragment of 100 pieces"),
    ([Allocation("a", BIND, fragment=Fragment(3, 0))], "allocation 'a' has a fragment of 0"),
])
def test_each_broken_allocation_is_named(allocations: list[Allocation], named: str) -> None:
    with pytest.raises(InvariantError, match=named):
        check_invariants(_ledger(allocations))


def test_sound_allocations_pass() -> None:
    check_invariants(_ledger([Allocation("a", BIND, CPUSet({1, 2})),
                              Allocation("b", BIND, CPUSet({3}), Fragment(4, 30)),
                              Allocation("c", BIND, fragment=Fragment(4, 70))]))
