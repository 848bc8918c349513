"""The NodeResourceTopology export (issue 28): valid against the schema written from the v1alpha2
Go types on every fixture machine, golden for three, and what each number means."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.cli import plan
from cpuservice.model import nrt
from cpuservice.model.alignment import misalignment
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import CPUServiceError, InvalidArgument
from cpuservice.model.fixtures import MACHINES, SHAPES
from cpuservice.model.pools import Ledger
from cpuservice.model.request import Request, parse_options
from cpuservice.model.topology import Topology
from tests.props import examples
from tests.schema import errors, load, nrt_errors

GOLDEN = Path(__file__).parent / "golden"
# the three golden objects: the command that prints each (cpuservice-plan)
GOLDEN_RUNS = {
    "b": ["--machine", "b", "web=2:bind,memory-nodes", "batch=1.5", "f=0.3:bind"],
    "c": ["--machine", "c", "--reserved", "0,64", "db=8:bind,numa-alignment=single-numa-node",
          "x=2.5:bind"],
    "d": ["--machine", "d", "iso=2:bind", "web=1:bind"],
}


def ledger(t: Topology, **kw: Any) -> Ledger:
    return Ledger(t.online, isolated=t.isolated & t.online, **kw)


def zone(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(z for z in obj["zones"] if z["name"] == name)


def resource(z: dict[str, Any], name: str) -> dict[str, str]:
    return next(r for r in z["resources"] if r["name"] == name)


def attribute(items: list[dict[str, str]], name: str) -> str:
    return next(a["value"] for a in items if a["name"] == name)


def allocate(t: Topology, led: Ledger, name: str, cpus: str, **opts: Any) -> Ledger:
    return placement.allocate(t, led, name, Request.parse(cpus, opts))[0]


@pytest.mark.parametrize("name", sorted({**MACHINES, **SHAPES}))
def test_every_fixture_machine_exports_a_valid_object(name: str) -> None:
    t = {**MACHINES, **SHAPES}[name].topology()
    led = ledger(t, min_shared_cpus=2)
    assert nrt_errors(nrt.export(t, led, name, 0)) == []
    led = allocate(t, led, "a", "1.25", bind=True)  # a fragment too
    led = allocate(t, led, "u", "0.5")
    obj = nrt.export(t, led, name, 2)
    assert nrt_errors(obj) == []
    nodes = [z for z in obj["zones"] if z["type"] == "Node"]
    assert sum(int(resource(z, "cpu")["capacity"]) for z in nodes) == len(t.online)
    json.dumps(obj)  # plain JSON values only


def test_the_validator_sees_what_is_wrong() -> None:
    """A broken object fails, naming where: so a passing export means something."""
    t = MACHINES["b"].topology()
    good = nrt.export(t, ledger(t), "b", 0)
    breakages = {
        "$: 'zones' is required": lambda o: o.pop("zones"),
        "$.zones[0].costs[0].value": lambda o: o["zones"][0]["costs"][0].update(value="10"),
        "$.zones[0].resources[0].available": lambda o: o["zones"][0]["resources"][0].update(
            available=8),
        "'cost' is not a field": lambda o: o["zones"][0].update(cost=[]),
        "$.kind": lambda o: o.update(kind="NodeResourceTopologyList"),
        "$.metadata.name": lambda o: o["metadata"].update(name="Node_1"),
        "$.zones[0].resources[0].capacity": lambda o: o["zones"][0]["resources"][0].update(
            capacity="8 cpus"),
        "parent": lambda o: o["zones"][2].update(parent="node-9"),
    }
    for expected, breaking in breakages.items():
        bad = copy.deepcopy(good)
        breaking(bad)
        found = nrt_errors(bad)
        assert any(expected in e for e in found), (expected, found)
    assert errors(1, {"type": "integer", "format": "int64"}) != []  # an unchecked keyword


def test_the_schema_names_every_field_of_the_go_types() -> None:
    """Every field of types.go (v1alpha2), with its JSON name, is in the schema."""
    defs = load()["$defs"]
    assert set(load()["properties"]) == {"apiVersion", "kind", "metadata", "topologyPolicies",
                                         "zones", "attributes"}
    assert set(defs["Zone"]["properties"]) == {"name", "type", "parent", "costs", "attributes",
                                               "resources"}
    assert set(defs["ResourceInfo"]["properties"]) == {"name", "capacity", "allocatable",
                                                       "available"}
    assert set(defs["CostInfo"]["properties"]) == {"name", "value"}
    assert set(defs["AttributeInfo"]["properties"]) == {"name", "value"}


@pytest.mark.parametrize("name", sorted(GOLDEN_RUNS))
def test_golden(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main([*GOLDEN_RUNS[name], "--export", "nrt"]) == 0
    out = capsys.readouterr().out
    assert nrt_errors(json.loads(out)) == []
    path = GOLDEN / f"nrt-{name}.json"
    if os.environ.get("CPUSERVICE_WRITE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text()


def test_cpu_counts_reserved_isolated_and_the_shared_minimum() -> None:
    """available: the whole CPUs bound allocations could still take in the zone, as capacity()
    counts them (free isolated CPUs always count; the shared pool's minimum caps the shared
    ones, its budget split among the zones)."""
    t = MACHINES["d"].topology()  # CPUs 0-2,4-5 | 16,18-21 online; 20-21 isolated (node 1)
    led = ledger(t, reserved=CPUSet([0]))
    obj = nrt.export(t, led, "d", 0)
    n0, n1 = resource(zone(obj, "node-0"), "cpu"), resource(zone(obj, "node-1"), "cpu")
    assert (n0["capacity"], n0["allocatable"], n0["available"]) == ("5", "4", "4")
    assert (n1["capacity"], n1["allocatable"], n1["available"]) == ("5", "5", "5")
    whole = placement.capacity(t, led, Request.parse("1", {"bind": True}))
    assert int(n0["available"]) + int(n1["available"]) == whole == 9
    # 8 shared: one may still go (to node 0, which has 5 of them), and the 2 isolated
    tight = ledger(t, min_shared_cpus=7)
    obj = nrt.export(t, tight, "d", 0)
    assert [resource(zone(obj, f"node-{n}"), "cpu")["available"] for n in (0, 1)] == ["1", "2"]
    assert placement.capacity(t, tight, Request.parse("1", {"bind": True})) == 3
    assert attribute(zone(obj, "node-1")["attributes"], "cpuservice.io/isolated-cpus") == "20-21"


def test_fragment_pieces_and_cpusets_follow_the_ledger() -> None:
    t = MACHINES["b"].topology()
    led = allocate(t, ledger(t), "w", "2.3", bind=True)
    led = allocate(t, led, "v", "0.5", bind=True)
    obj = nrt.export(t, led, "b", 7)
    z = zone(obj, "node-0")
    frag = resource(z, f"{nrt.PREFIX}fragment-pieces")
    pieces = led.fragment_pieces
    assert int(frag["capacity"]) == 100 * len(pieces)
    assert int(frag["available"]) == sum(100 - p for p in pieces.values())
    attrs = z["attributes"]
    assert attribute(attrs, "cpuservice.io/exclusive-cpus") == led.exclusive.format()
    assert attribute(attrs, "cpuservice.io/fragment-cpus") == led.fragment.format()
    assert attribute(obj["attributes"], "cpuservice.io/generation") == "7"
    assert resource(z, "cpu")["available"] == str(8 - len(led.held))


def test_costs_are_the_kernels_node_distances() -> None:
    t = SHAPES["memory-only"].topology()  # nodes 2 and 3 have memory and no CPU
    obj = nrt.export(t, ledger(t), "m", 0)
    costs = {c["name"]: c["value"] for c in zone(obj, "node-0")["costs"]}
    assert costs == {"node-0": 10, "node-1": 20, "node-2": 30, "node-3": 30}
    assert resource(zone(obj, "node-2"), "cpu")["capacity"] == "0"
    assert resource(zone(obj, "node-2"), "memory")["available"] == f"{16 << 20}Ki"
    t = SHAPES["memoryless"].topology()
    assert resource(zone(nrt.export(t, ledger(t), "m", 0), "node-1"), "memory")["capacity"] \
        == "0"


def test_l3_zones_hang_below_their_node_and_split_with_it() -> None:
    t = MACHINES["c"].topology()  # 8 L3 groups of 8 cores, 2 per node
    obj = nrt.export(t, ledger(t), "c", 0)
    l3 = [z for z in obj["zones"] if z["type"] == nrt.L3_ZONE]
    assert len(l3) == 8 and zone(obj, "l3-3")["parent"] == "node-1"
    assert attribute(zone(obj, "l3-0")["attributes"], "cpuservice.io/cpus") == "0-7,64-71"
    t = SHAPES["snc"].topology()  # an L3 per socket, two nodes a socket
    names = [z["name"] for z in nrt.export(t, ledger(t), "s", 0)["zones"]
             if z["type"] == nrt.L3_ZONE]
    assert names == ["l3-0-node-0", "l3-0-node-1", "l3-1-node-2", "l3-1-node-3"]


def test_policy_attributes_say_what_a_request_gets() -> None:
    t = MACHINES["b"].topology()
    obj = nrt.export(t, ledger(t), "b", 0)
    attrs = obj["attributes"]
    assert attribute(attrs, "topologyManagerPolicy") == "best-effort"
    assert attribute(attrs, "topologyManagerScope") == "container"
    assert attribute(attrs, "topologyManagerMaxNUMANodes") == "2"
    assert attribute(attrs, "cpuservice.io/cpu-memory-aligned") == "false"
    strict = parse_options({"numa-alignment": "single-numa-node", "memory-nodes": True})
    obj = nrt.export(t, ledger(t), "b", 0, strict)
    assert attribute(obj["attributes"], "topologyManagerPolicy") == "single-numa-node"
    assert attribute(obj["attributes"], "cpuservice.io/cpu-memory-aligned") == "true"
    assert obj["topologyPolicies"] == ["SingleNUMANodeContainerLevel"]


@pytest.mark.parametrize("bad", ["", "Node1", "node_1", "-a", "a-", "a" * 254, "a..b"])
def test_a_bad_node_name_is_a_named_error(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="kubectl get nodes"):
        nrt.node_name(bad)
    assert nrt.node_name("worker-1.example.org") == "worker-1.example.org"
    assert nrt.default_node_name("Worker-1\n") == "worker-1"


def test_alignment_names_every_reason() -> None:
    t = MACHINES["c"].topology()  # siblings N and N+64, L3 per 8 cores, 16 cores a node
    led = ledger(t)

    def why(name: str, cpus: str, **opts: Any) -> list[str]:
        nonlocal led
        led = allocate(t, led, name, cpus, **opts)
        return misalignment(t, led.allocations[name])

    assert why("ok", "4", bind=True, **{"memory-nodes": True}) == []
    assert why("nomem", "4", bind=True) == [
        "memory not restricted to its node (no memory-nodes)"]
    assert "holds part of a core" in why("odd", "3", bind=True, **{"memory-nodes": True})
    frag = why("frag", "0.5", bind=True, **{"memory-nodes": True})
    cpu = led.allocations["frag"].held.first()
    assert frag == [f"shares fragment CPU {cpu}", "holds part of a core"]
    wide = why("wide", "40", bind=True, **{"memory-nodes": True})
    assert "spans L3 groups" in wide and any(w.startswith("spans NUMA nodes") for w in wide)
    assert why("u", "2") == ["unbound (runs on the shared pool)"]
    t2 = SHAPES["memoryless"].topology()
    led2 = allocate(t2, ledger(t2), "m", "2", bind=True, cpuset="4,12",
                    **{"memory-nodes": True})
    assert misalignment(t2, led2.allocations["m"]) == ["its node 1 has no memory of its own"]


def test_export_size_and_time_on_the_largest_fixture() -> None:
    """machine e: 1,024 CPUs, 8 nodes, 64 L3 groups (docs/guides/kubernetes-nrt.md quotes them)."""
    import time
    t = MACHINES["e"].topology()
    led = ledger(t)
    for i in range(100):
        led = allocate(t, led, f"a{i}", "3.5", bind=True)
    began = time.perf_counter()
    obj = nrt.export(t, led, "e", 100)
    took = time.perf_counter() - began
    assert nrt_errors(obj) == [] and len(obj["zones"]) == 8 + 64
    assert len(json.dumps(obj)) < 64 * 1024 and took < 1.0


AMOUNTS = st.decimals(min_value=Decimal("0.25"), max_value=Decimal(6), places=2)
REQUESTS = st.lists(st.tuples(AMOUNTS, st.booleans()), max_size=12)


def zone_cpus(t: Topology, led: Ledger, z: dict[str, Any]) -> CPUSet:
    """``available`` CPUs of zone ``z``, as a cpuset: its free isolated ones, then its shared,
    unreserved ones, lowest first."""
    cpus = CPUSet.parse(attribute(z["attributes"], "cpuservice.io/cpus")) & t.online
    shared = ((led.shared - led.reserved) & cpus).sorted()
    free_isolated = led.free_isolated & cpus
    count = int(resource(z, "cpu")["available"])
    return free_isolated | CPUSet(shared[:count - len(free_isolated)])


def bind_zones(t: Topology, led: Ledger, zones: list[dict[str, Any]]) -> Ledger:
    """Each zone's available CPUs bound as one allocation (an explicit cpuset), one zone after
    the other on one ledger: InsufficientCPUs when they cannot all be bound together."""
    for i, z in enumerate(zones):
        cpus = zone_cpus(t, led, z)
        assert len(cpus) == int(resource(z, "cpu")["available"]), z["name"]
        if cpus:
            led = allocate(t, led, f"zone{i}", str(len(cpus)), bind=True, cpuset=cpus.format())
    return led


def test_node_zones_add_up_to_what_can_be_bound() -> None:
    """Issue 37 item 5: on machine b (16 shared CPUs, min_shared_cpus 1: 15 may be bound) each
    node zone said 8 available, 16 together; a scheduler that counts zones as additive had its
    second pod of 8 refused. The budget is split: 8 + 7, and both bind."""
    t = MACHINES["b"].topology()
    led = ledger(t)
    obj = nrt.export(t, led, "b", 0)
    nodes = [zone(obj, "node-0"), zone(obj, "node-1")]
    assert [resource(z, "cpu")["available"] for z in nodes] == ["8", "7"]
    assert placement.capacity(t, led, Request.parse("1", {"bind": True})) == 15
    assert len(bind_zones(t, led, nodes).bound) == 2
    for z in nodes:  # and each alone, the whole of it
        assert len(bind_zones(t, led, [z]).bound) == 1


def test_the_budget_is_split_in_proportion() -> None:
    """Shares in proportion to the zones' shared CPUs, the rounding's CPUs to the largest
    remainders (ties: the first); each at most its count; nothing of the budget is lost."""
    split = nrt._budget_shares
    assert split(15, {0: 8, 1: 8}) == {0: 8, 1: 7}
    assert split(5, {0: 2, 1: 4}) == {0: 2, 1: 3}
    assert split(1, {0: 5, 1: 3}) == {0: 1, 1: 0}
    assert split(1, {0: 3, 1: 5}) == {0: 0, 1: 1}
    assert split(100, {0: 3, 1: 5, 2: 0}) == {0: 3, 1: 5, 2: 0}
    assert split(0, {0: 3, 1: 5}) == {0: 0, 1: 0}
    assert split(7, {}) == {}
    assert split(4, {0: 0, 1: 0}) == {0: 0, 1: 0}


AMOUNTS = st.decimals(min_value=Decimal("0.25"), max_value=Decimal(6), places=2)
REQUESTS = st.lists(st.tuples(AMOUNTS, st.booleans()), max_size=12)


@pytest.mark.parametrize("name", ["b", "c", "d", "snc", "hybrid", "memoryless"])
@settings(max_examples=examples(40))
@given(requests=REQUESTS, min_shared=st.integers(1, 12), reserved=st.integers(0, 3))
def test_what_is_available_is_what_can_be_bound(name: str, requests: list[tuple[Decimal, bool]],
                                                min_shared: int, reserved: int) -> None:
    """On any ledger: valid; 0 <= available <= allocatable <= capacity per zone; the L3 zones
    of a node add up to it, available CPUs too; the node zones' available CPUs add up to what
    capacity() counts for single bound CPUs (zones are additive to a scheduler: issue 37 item
    5), and each zone's available CPUs can be bound, alone and all zones together."""
    t = {**MACHINES, **SHAPES}[name].topology()
    led = ledger(t, reserved=CPUSet(t.online.sorted()[:reserved]), min_shared_cpus=min_shared)
    for i, (amount, bound) in enumerate(requests):
        with contextlib.suppress(CPUServiceError):  # what does not fit is left out
            led = placement.allocate(t, led, f"r{i}", Request.parse(str(amount),
                                                                    {"bind": bound}))[0]
    obj = nrt.export(t, led, name, len(requests))
    assert nrt_errors(obj) == []
    nodes = {z["name"]: z for z in obj["zones"] if z["type"] == nrt.NODE_ZONE}
    for z in obj["zones"]:
        cpu = resource(z, "cpu")
        assert 0 <= int(cpu["available"]) <= int(cpu["allocatable"]) <= int(cpu["capacity"])
    for node_name, z in nodes.items():
        parts = [resource(l3, "cpu") for l3 in obj["zones"] if l3.get("parent") == node_name]
        assert sum(int(p["capacity"]) for p in parts) == int(resource(z, "cpu")["capacity"])
        assert sum(int(p["available"]) for p in parts) == int(resource(z, "cpu")["available"])
    available = sum(int(resource(z, "cpu")["available"]) for z in nodes.values())
    singles = placement.capacity(t, led, Request.parse("1", {"bind": True}))
    assert available == singles
    assert len(bind_zones(t, led, list(nodes.values())).bound) \
        == len(led.bound) + sum(1 for z in nodes.values() if zone_cpus(t, led, z))
    l3 = [z for z in obj["zones"] if z["type"] == nrt.L3_ZONE]
    bind_zones(t, led, l3)
    for z in [*nodes.values(), *l3]:
        bind_zones(t, led, [z])
