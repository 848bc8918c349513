"""Random allocate/release/resize/offline/online sequences on every fixture machine."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.cpuset import CPUSet
from cpuservice.errors import InsufficientCPUs, InvalidArgument
from cpuservice.pools import check_index, check_invariants
from cpuservice.repair import repair
from cpuservice.request import Request

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


@pytest.mark.parametrize("name", ["a", "b", "c", "d", "lab"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, granularity=st.sampled_from([100, 1000]))
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
        except (InsufficientCPUs, InvalidArgument):
            pass
        check_invariants(ledger)
        check_index(ledger)
        for a in ledger.allocations.values():
            assert a.held <= topology.online
    topology = full
    ledger, _ = repair(topology, ledger)
    check_invariants(ledger)
    assert not any(a.degraded for a in ledger.allocations.values()) or len(ledger.online) < 4
    for n in sorted(ledger.allocations):
        ledger = placement.release(ledger, n)
    assert ledger.shared == initial.shared and ledger.free_isolated == initial.free_isolated
