"""capacity's walks on per-cell classes (choose._packed: packed and full-pcpus on cores of
several threads) choose exactly what allocate's pack chooses: choice after choice on one steps
view, against a fresh view of the ledger with the earlier choices committed (issue 40: capacity
on 2,048 CPUs)."""


from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.fixtures import MACHINES, SHAPES, Machine
from cpuservice.model.pools import Allocation, Ledger
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology
from cpuservice.placement import choose
from cpuservice.placement.free import Free
from tests.props import examples

from .test_capacity import POOLS, SEED, STEPS, build

WALK_MACHINES: dict[str, Machine] = {
    "c": MACHINES["c"], "snc": SHAPES["snc"], "hybrid": SHAPES["hybrid"],
    "offline": SHAPES["offline"],
    "smt4": Machine(1, 8, 4, nodes=2),
    "iso": Machine(2, 16, 2, nodes=4, l3_cores=4, isolated=frozenset(range(24, 32))),
    "wide-l3": Machine(2, 24, 2, nodes=4, l3_cores=3),
}
_topologies: dict[str, Topology] = {}
OPTIONS = st.fixed_dictionaries({}, optional={
    "policy": st.sampled_from(["packed", "full-pcpus"]),
    "exclusive": st.sampled_from(["none", "pcpu", "numa"]),
    "numa-alignment": st.sampled_from(["none", "best-effort", "restricted",
                                       "single-numa-node"]),
    "numa-strategy": st.sampled_from(["most-allocated", "least-allocated"]),
})
LIMIT = 80


def _outcome(free: Free, n: int) -> set[int] | str:
    try:
        return set(choose.take_whole(free, n))
    except InsufficientCPUs as exc:  # the shared pool's note reads the view's first ledger
        return f"InsufficientCPUs: {str(exc).split('; the shared pool')[0]}"


def assert_same_choices(topology: Topology, ledger: Ledger, request: Request) -> int:
    """Choices on one steps view (capacity's) equal allocate's on the ledger of the moment;
    how many were compared."""
    steps = Free(topology, ledger, request.options, steps=True)
    for count in range(LIMIT):
        fast = _outcome(steps, request.whole)
        slow = _outcome(Free(topology, ledger, request.options), request.whole)
        assert fast == slow, f"{request} choice {count} on {len(ledger.allocations)} allocations"
        if isinstance(fast, str) or steps.from_shared(fast) > steps.budget():
            return count
        whole = sorted(fast)
        steps.take(whole, None, False, 0)
        # not a valid allocation name, so it never replaces one
        ledger = ledger.with_allocation(Allocation(f"#{count}", request, CPUSet(whole)))
    return LIMIT


@pytest.mark.parametrize("name", sorted(WALK_MACHINES))
@settings(max_examples=examples(40))
@given(pools=POOLS, steps=STEPS, seed=SEED, whole=st.integers(1, 8), options=OPTIONS)
def test_capacity_walk_is_pack(name: str, pools: Any, steps: int, seed: int, whole: int,
                               options: dict[str, str]) -> None:
    if name not in _topologies:
        _topologies[name] = WALK_MACHINES[name].topology()
    topology, ledger = build(_topologies[name], pools, steps, seed)
    assert_same_choices(topology, ledger, Request.parse(str(whole), {"bind": True, **options}))


def test_capacity_walk_on_a_busy_smt_machine() -> None:
    """Many choices on one view: loose threads of spread-pcpus cores last, whole cores, a
    thread of a wholly free core."""
    topology = MACHINES["c"].topology()
    ledger = Ledger(topology.online, granularity=100)
    for i, (amount, policy) in enumerate([("3", "packed"), ("5", "spread-pcpus"),
                                          ("1", "packed"), ("7", "spread-pcpus")] * 4):
        request = Request.parse(amount, {"bind": True, "policy": policy})
        whole = choose.take_whole(Free(topology, ledger, request.options), request.whole)
        ledger = ledger.with_allocation(Allocation(f"b{i}", request, CPUSet(whole)))
    for amount in ("1", "2", "3"):
        assert assert_same_choices(topology, ledger, Request.parse(amount, {"bind": True})) >= 20
