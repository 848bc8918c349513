"""Cores kept next to devices for the allocations naming them (config [[keep_near]], issue 38):
which cores a node keeps, that other allocations take them never (the default) or only when
nothing else fits (when-full), that device users take them first, and that Allocate, Resize,
repair, re-packing and Capacity all go by the one choice code."""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.host.checkpoint import Record, _row, from_payload
from cpuservice.model import config, keep, near
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InsufficientCPUs, InvalidArgument
from cpuservice.model.keep import NEVER, WHEN_FULL, Keep, Rule
from cpuservice.model.near import Device
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology
from cpuservice.placement.repack import fragmented
from cpuservice.placement.repair import repair
from tests.props import examples

from .helpers import alloc, bind, ledger_for
from .test_capacity import assert_counts, build

# machine b: node 0 is CPUs 0-3,8-11 (cores 0-3), node 1 is CPUs 4-7,12-15 (cores 4-7)
GPU0 = Device("/dev/nvidia0", 0, "nvidia", "0000:19:00.0")
GPU1 = Device("/dev/nvidia1", 1, "nvidia", "0000:af:00.0")
ETH0 = Device("eth0", 0, "net", "0000:17:00.0")
ETH2 = Device("eth2", -1, "net", "0000:3b:00.1")
INVENTORY = (ETH0, GPU0, GPU1, ETH2)
GPUS = (Rule("nvidia", "*", 2),)


def kept(topology: Topology, others: str = NEVER, rules: tuple[Rule, ...] = GPUS,
         **kw: Any) -> Ledger:
    plan = keep.plan(topology, kw.pop("reserved", CPUSet()), rules, INVENTORY, others)
    return ledger_for(topology, keep=plan, **kw)


def near_req(cpus: str, *devices: Device, **options: Any) -> Request:
    opts = {k.replace("_", "-"): v for k, v in options.items()}
    return Request.parse(cpus, {"bind": True, "near": near.encode(devices), **opts})


# ---- which cores are kept ----

def test_each_matching_device_keeps_whole_cores_on_its_node(machine) -> None:
    t = machine("b")
    plan = keep.plan(t, CPUSet(), GPUS, INVENTORY)
    assert [(k.node, k.cpus, k.devices) for k in plan.nodes] == [
        (0, CPUSet.parse("2-3,10-11"), (GPU0,)), (1, CPUSet.parse("6-7,14-15"), (GPU1,))]
    assert plan.cpus == CPUSet.parse("2-3,6-7,10-11,14-15")
    assert plan.others == NEVER
    assert keep.describe(plan)[0] == "node 0: 2 core(s), CPUs 2-3,10-11, kept for /dev/nvidia0"


def test_first_rule_wins_counts_add_up_reserved_and_no_locality_are_left_out(machine) -> None:
    t = machine("b")
    rules = (Rule("", "eth*", 1), Rule("net", "*", 3), Rule("", "0000:19:*", 2))
    plan = keep.plan(t, CPUSet.parse("3"), rules, (*INVENTORY, ETH0))  # eth0 twice: once
    (node0,) = plan.nodes  # eth2 has no node; GPU1 matches nothing
    assert node0.wanted == 3 and node0.devices == (ETH0, GPU0)
    assert node0.cpus == CPUSet.parse("0-2,8-10")  # core 3 holds reserved CPU 3


def test_a_node_keeps_no_more_than_it_has_and_says_so(machine) -> None:
    t = machine("b")
    plan = keep.plan(t, CPUSet(), (Rule("nvidia", "*", 9),), INVENTORY)
    assert plan.at(0) is not None and plan.at(0).cpus == t.nodes[0]  # type: ignore[union-attr]
    assert "of 9 asked for" in keep.describe(plan)[0]


def test_offline_cpus_do_not_move_the_kept_cores(machine) -> None:
    t = machine("b")
    half = t.with_online(t.online - CPUSet.parse("3,11"))
    assert keep.plan(half, CPUSet(), GPUS, INVENTORY) == keep.plan(t, CPUSet(), GPUS, INVENTORY)


# ---- never (the default) ----

def test_others_never_take_kept_cores(machine) -> None:
    t = machine("b")
    ledger = kept(t)
    ledger, a = alloc(t, ledger, "a", bind("8"))
    assert not a.held & ledger.keep.cpus
    with pytest.raises(InsufficientCPUs):
        alloc(t, ledger, "b", bind("1"))  # 8 CPUs free, all kept
    assert placement.capacity(t, ledger, bind("1")) == 0
    with pytest.raises(InsufficientCPUs):
        alloc(t, ledger, "f", bind("0.5"))  # nor a fragment of one
    assert not fragmented(ledger, bind("2"))  # so re-packing is not tried either


def test_a_user_of_another_device_on_the_node_is_one_of_the_others(machine) -> None:
    t = machine("b")
    ledger = kept(t)
    ledger, a = alloc(t, ledger, "n", near_req("4", ETH0))
    assert a.held <= t.nodes[0] and not a.held & ledger.keep.cpus
    with pytest.raises(InsufficientCPUs):
        alloc(t, ledger, "m", near_req("1", ETH0))


def test_device_users_take_their_kept_cores_first(machine) -> None:
    t = machine("b")
    ledger = kept(t)
    ledger, a = alloc(t, ledger, "g", near_req("2", GPU0))
    assert a.whole in (CPUSet.parse("2,10"), CPUSet.parse("3,11"))  # one kept core
    ledger, b = alloc(t, ledger, "h", near_req("4", GPU0))
    # the other kept core, then the node
    assert b.whole & ledger.keep.cpus == CPUSet.parse("2-3,10-11") - a.whole
    assert b.whole <= t.nodes[0]
    # named by its PCI address, the same GPU unlocks the same cores
    pci = Device("0000:19:00.0", 0, "pci", "0000:19:00.0")
    ledger2, c = alloc(t, kept(t), "p", near_req("2", pci))
    assert c.whole <= ledger2.keep.cpus
    # GPU1's user gets node 1's kept cores, never node 0's
    _, d = alloc(t, ledger, "x", near_req("2", GPU1))
    assert d.whole <= CPUSet.parse("6-7,14-15")


def test_resize_and_repair_of_others_never_reach_into_kept_cores(machine) -> None:
    t = machine("b")
    ledger = kept(t)
    ledger, _ = alloc(t, ledger, "a", bind("6"))
    with pytest.raises(InsufficientCPUs):
        placement.resize(t, ledger, "a", Decimal(9))
    ledger, a = placement.resize(t, ledger, "a", Decimal(8))
    assert not a.held & ledger.keep.cpus
    gone = next(iter(a.whole))
    repaired, changes = repair(t.with_online(t.online - CPUSet([gone])), ledger)
    assert repaired.allocations["a"].degraded  # no other CPU: kept cores are not taken
    assert not repaired.allocations["a"].held & ledger.keep.cpus
    assert repaired.keep == ledger.keep and changes


def test_repair_of_a_device_user_takes_its_kept_cores(machine) -> None:
    t = machine("b")
    ledger = kept(t)
    ledger, a = alloc(t, ledger, "g", near_req("2", GPU0))
    gone = CPUSet([min(a.whole)])
    repaired, _ = repair(t.with_online(t.online - gone), ledger)
    g = repaired.allocations["g"]
    assert not g.degraded and g.whole <= CPUSet.parse("2-3,10-11") - gone


# ---- when-full ----

def test_when_full_others_take_kept_cores_only_for_what_nothing_else_holds(machine) -> None:
    t = machine("b")
    ledger = kept(t, WHEN_FULL)
    ledger, a = alloc(t, ledger, "a", bind("8"))
    assert not a.held & ledger.keep.cpus
    ledger, b = alloc(t, ledger, "b", bind("3"))
    assert len(b.whole & ledger.keep.cpus) == 3  # nothing else was free
    assert placement.capacity(t, ledger, bind("1")) == 4


def test_when_full_a_split_request_takes_the_rest_from_kept_cores(machine) -> None:
    t = machine("b")
    ledger = kept(t, WHEN_FULL)
    ledger, _ = alloc(t, ledger, "a", bind("6"))
    ledger, b = alloc(t, ledger, "b", bind("4"))
    assert len(b.whole - ledger.keep.cpus) == 2 and len(b.whole & ledger.keep.cpus) == 2


# ---- the ledger carries it ----

def test_the_ledger_keeps_it_through_changes_and_the_checkpoint(machine) -> None:
    t = machine("b")
    ledger = kept(t)
    ledger, _ = alloc(t, ledger, "g", near_req("2", GPU0))
    assert ledger.without("g").keep == ledger.keep
    assert ledger.with_online(t.online).keep == ledger.keep
    rows = [_row(n, a, Record()) for n, a in ledger.allocations.items()]
    state = from_payload({"allocations": rows, "granularity": 100}, kept(t))
    assert state.ledger.keep == ledger.keep
    assert state.ledger.allocations == ledger.allocations


# ---- the configuration ----

@pytest.mark.parametrize(("entries", "says"), [
    ([{"kind": "gpu", "cores": 1}], r"keep_near\[0\]\.kind: 'gpu' is none of"),
    ([{"name": "eth*", "cores": 0}], r"keep_near\[0\]\.cores: 0 is not a number"),
    ([{"name": "eth*", "cores": 257}], r"keep_near\[0\]\.cores"),
    ([{"name": "eth*", "cores": True}], r"keep_near\[0\]\.cores"),
    ([{"cores": 1}], r"keep_near\[0\]: give kind or name"),
    ([{"name": "../x", "cores": 1}], r"keep_near\[0\]\.name"),
    ([{"name": "eth 0", "cores": 1}], r"keep_near\[0\]\.name"),
    ([{"name": "eth[0", "cores": 1}], r"keep_near\[0\]\.name: 'eth\[0': a \["),
    ([{"name": "eth*", "cores": 1, "node": 1}], r"keep_near\[0\]\.node: unknown key"),
    ([{"name": "eth*", "cores": 1}] * 17, r"keep_near: 17 entries, at most 16"),
])
def test_bad_rules_are_named_at_startup(entries: list[Any], says: str) -> None:
    with pytest.raises(config.ConfigError, match=says):
        config.validate({"keep_near": entries}, "cpuservice.toml")


def test_good_rules_and_the_default() -> None:
    cfg = config.validate({"keep_near": [{"kind": "nvidia", "cores": 2},
                                         {"name": "mlx5_*", "cores": 1}]})
    assert cfg.keep_rules == (Rule("nvidia", "*", 2), Rule("", "mlx5_*", 1))
    assert cfg.keep_near_others == NEVER
    with pytest.raises(config.ConfigError, match="keep_near_others"):
        config.validate({"keep_near_others": "sometimes"})


# ---- drawn: the rules hold on any ledger, and Capacity counts what Allocate places ----

RULES = st.lists(st.tuples(st.sampled_from([0, 1, 2, 3]), st.integers(1, 3)), min_size=1,
                 max_size=3)
ASK = st.tuples(st.integers(0, 5), st.sampled_from([0, 0, 50]),
                st.sampled_from(["none", "mine", "other"]),
                st.fixed_dictionaries({}, optional={
                    "policy": st.sampled_from(["packed", "full-pcpus", "spread-pcpus"]),
                    "exclusive": st.sampled_from(["none", "pcpu", "numa"]),
                    "numa-alignment": st.sampled_from(["none", "best-effort", "restricted",
                                                       "single-numa-node"]),
                    "near-policy": st.sampled_from(["required", "preferred"])}))


def _devices(topology: Topology, rules: list[tuple[int, int]]) -> tuple[Keep, list[Device]]:
    nodes = sorted(topology.nodes)
    devices = [Device(f"gpu{i}", nodes[x % len(nodes)], "nvidia", f"0000:{i + 1:02x}:00.0")
               for i, (x, _) in enumerate(rules)]
    return keep.plan(topology, CPUSet(), tuple(Rule("", d.name, k) for d, (_, k) in
                                               zip(devices, rules, strict=True)),
                     devices), devices


def _ask(topology: Topology, devices: list[Device], ask: tuple[Any, ...]) -> Request | None:
    whole, pieces, who, options = ask
    cpus = str(Decimal(max(whole, 0 if pieces else 1)) + Decimal(pieces) / 100)
    options = dict(options)
    if who == "none":
        options.pop("near-policy", None)
        chosen: tuple[Device, ...] = ()
    else:
        other = Device("eth9", devices[0].node, "net", "0000:ee:00.0")
        chosen = (devices[0],) if who == "mine" else (other,)
    try:
        if chosen:
            return near_req(cpus, *chosen, **{k.replace("-", "_"): v
                                              for k, v in options.items()})
        return Request.parse(cpus, {"bind": True, **options})
    except InvalidArgument:
        return None


def _setup(machine: Any, name: str, steps: int, seed: int, rules: list[tuple[int, int]],
           others: str) -> tuple[Topology, Ledger, list[Device]]:
    topology, ledger = build(machine(name), (100, 1, []), steps, seed)
    plan, devices = _devices(topology, rules)
    ledger = replace(ledger, keep=replace(plan, others=others))
    rng = random.Random(seed)  # some device users among the others
    for i in range(rng.randint(0, 3)):
        with contextlib.suppress(InsufficientCPUs, InvalidArgument):
            ledger, _ = placement.allocate(topology, ledger, f"dev{i}", near_req(
                str(rng.randint(1, 3)), rng.choice(devices)))
    return topology, ledger, devices


@pytest.mark.parametrize("name", ["b", "c", "snc"])
@settings(max_examples=examples(50))
@given(steps=st.integers(0, 30), seed=st.integers(0, 2**32 - 1), rules=RULES, ask=ASK,
       others=st.sampled_from([NEVER, WHEN_FULL]))
def test_capacity_with_kept_cores_is_repeated_allocate(machine, name: str, steps: int,
                                                       seed: int, rules: list[tuple[int, int]],
                                                       ask: tuple[Any, ...], others: str
                                                       ) -> None:
    topology, ledger, devices = _setup(machine, name, steps, seed, rules, others)
    request = _ask(topology, devices, ask)
    if request is not None:
        assert_counts(topology, ledger, request)


@pytest.mark.parametrize("name", ["b", "snc"])
@settings(max_examples=examples(80))
@given(steps=st.integers(0, 30), seed=st.integers(0, 2**32 - 1), rules=RULES, ask=ASK,
       others=st.sampled_from([NEVER, WHEN_FULL]))
def test_others_take_kept_cores_never_or_only_when_nothing_else_fits(
        machine, name: str, steps: int, seed: int, rules: list[tuple[int, int]],
        ask: tuple[Any, ...], others: str) -> None:
    topology, ledger, devices = _setup(machine, name, steps, seed, rules, others)
    request = _ask(topology, devices, ask)
    if request is None:
        return
    locked = ledger.keep.locked(request.devices)
    # the same request where the cores kept for others are reserved instead: what "nothing
    # else fits" means (kept cores stay in the shared pool, as reserved ones do)
    walled = replace(ledger, keep=keep.NO_KEEP, reserved=ledger.reserved | locked)
    without = replace(ledger, keep=keep.NO_KEEP)
    try:
        _, a = placement.allocate(topology, ledger, "new", request)
    except InvalidArgument:
        return
    except InsufficientCPUs:
        assert not _fits_off(topology, walled, request, locked)
        if others == WHEN_FULL:  # when-full refuses nothing that fits without kept cores
            with pytest.raises(InsufficientCPUs):
                placement.allocate(topology, without, "new", request)
        return
    check_invariants(placement.allocate(topology, ledger, "new", request)[0])
    if others == NEVER:
        assert not a.held & locked
    elif a.held & locked:
        assert not _fits_off(topology, walled, request, locked)


def _fits_off(topology: Topology, walled: Ledger, request: Request, locked: CPUSet) -> bool:
    """Whether ``request`` fits with the kept cores walled off (``walled``: reserved instead).
    Reserving keeps shared CPUs from allocations, but a fragment may still join a fragment CPU
    already made there, which on a kept core is taking it: that does not count as fitting."""
    try:
        _, a = placement.allocate(topology, walled, "new", request)
    except InsufficientCPUs:
        return False
    return not a.held & locked


def test_a_fragment_on_a_kept_core_is_taking_it(machine) -> None:
    """Found by make test-explore (seed 2881053111): under "never", 3.5 CPUs were refused for
    want of a fragment CPU, while the oracle (kept cores reserved instead) placed the fragment on
    CPU 5, a kept core that already held 12 pieces of another fragment. Joining it takes a kept
    core: the refusal is right, the oracle was not."""
    topology, ledger, devices = _setup(machine, "b", 5, 6, [(0, 2), (1, 1), (1, 2)], NEVER)
    request = _ask(topology, devices, (3, 50, "none", {}))
    assert request is not None
    locked = ledger.keep.locked(request.devices)
    assert 5 in locked and ledger.fragment_pieces.get(5) == 12
    with pytest.raises(InsufficientCPUs):
        placement.allocate(topology, ledger, "new", request)
    walled = replace(ledger, keep=keep.NO_KEEP, reserved=ledger.reserved | locked)
    _, a = placement.allocate(topology, walled, "new", request)
    assert a.fragment is not None and a.fragment.cpu == 5
    assert not _fits_off(topology, walled, request, locked)


@pytest.mark.parametrize("name", ["b", "snc"])
@settings(max_examples=examples(60))
@given(steps=st.integers(0, 30), seed=st.integers(0, 2**32 - 1), rules=RULES,
       n=st.integers(1, 8), full=st.booleans())
def test_device_users_get_their_kept_cores_first(machine, name: str, steps: int, seed: int,
                                                 rules: list[tuple[int, int]], n: int,
                                                 full: bool) -> None:
    topology, ledger, devices = _setup(machine, name, steps, seed, rules, NEVER)
    step = 2 if full else 1
    request = near_req(str(n * step), devices[0], policy="full-pcpus" if full else "packed")
    mine = ledger.keep.mine(request.devices)
    free = mine & ledger.takeable
    if full:
        free = topology.whole_cores(free)
    try:
        _, a = placement.allocate(topology, ledger, "new", request)
    except InsufficientCPUs:
        return
    assert len(a.whole & mine) >= min(len(free), len(a.whole))


# ---- through the daemon's wiring (assemble: the inventory at startup) and the service ----

def test_the_service_keeps_cores_for_its_devices_and_says_so(tmp_path: Any) -> None:
    from cpuservice.model.fixture_devices import write_devices
    from tests.unit.test_service_fake import Host, agree, run

    async def body() -> None:
        h = Host(tmp_path, procfs_root=str(tmp_path / "proc"),
                 keep_near=[{"kind": "nvidia", "cores": 1}])
        write_devices(h.root, "gpu-box", "b", proc=tmp_path / "proc")
        svc = await h.service()
        kept_cpus = CPUSet.parse("3,7,11,15")  # /dev/nvidia0 on node 0, /dev/nvidia1 on 1
        assert svc.ledger.keep.cpus == kept_cpus
        assert svc.capacity("1", {"bind": True}) == 12
        assert svc.plan("2", {"bind": True, "near": "/dev/nvidia1"}).whole == CPUSet.parse("7,15")
        await svc.allocate("a", "12", {"bind": True}, 0)
        state = svc.state
        with pytest.raises(InsufficientCPUs):
            await svc.allocate("b", "1", {"bind": True}, 0)
        assert svc.state is state
        await svc.allocate("g", "2", {"bind": True, "near": "0000:19:00.0"}, 0)
        assert svc.ledger.allocations["g"].whole == CPUSet.parse("3,11")
        agree(svc, h.fake)
        zones = {z["name"]: {a["name"]: a["value"] for a in z["attributes"]}
                 for z in svc.node_resource_topology("gpu-box")["zones"]}
        assert zones["node-1"]["resource.kubernetes.io/pcieRoot"].startswith("pci0000:3b")
        assert zones["node-0"]["cpuservice.io/kept-cpus"] == "3,11"
        again = await Host.service(h)  # a restart keeps the same cores and the allocations
        assert again.ledger.keep == svc.ledger.keep
        assert again.ledger.allocations["g"].whole == CPUSet.parse("3,11")
    run(body)


def test_repacking_moves_nobody_onto_kept_cores(machine) -> None:
    """Four movable exclusive=pcpu allocations hold one thread of each core that is not kept;
    a whole core for another request could only be made by moving one of them onto a kept
    core, which a move (take_whole, the one engine) never does."""
    from cpuservice.placement.repack import repack

    t = machine("b")
    ledger = kept(t)
    for i in range(4):
        ledger, a = alloc(t, ledger, f"m{i}", bind("1", exclusive="pcpu", movable="anywhere"))
        assert not a.held & ledger.keep.cpus
    request = bind("2", policy="full-pcpus")
    assert fragmented(ledger, request)  # 4 free threads, no whole core: re-packing is tried
    assert repack(t, ledger, "new", request) is None
    # without the kept cores it would have fitted at once
    assert placement.allocate(t, replace(ledger, keep=keep.NO_KEEP), "new", request)
    # a GPU's user takes its kept cores, no move needed
    _, g = alloc(t, ledger, "g", near_req("2", GPU0, policy="full-pcpus"))
    assert g.whole <= ledger.keep.cpus


def test_when_full_takes_a_kept_core_before_the_shared_pools_last_cpu(machine) -> None:
    """Found by make test-explore (seed 4255534168): under when-full, 1.5 CPUs are refused with
    "fewer than min_shared_cpus=1 CPUs in the shared pool (2 now, 2 needed from it)", though they
    fit when no core is kept. The whole CPU and the fragment are chosen away from the kept cores
    first and the floor was checked after: the choice that joins a fragment CPU on a kept core,
    taking nothing from the pool, was never tried. Now the floor is part of the choice
    (choose.take): the fragment joins a fragment CPU rather than take the pool's last CPU, and
    a choice that fails is made again without the preference."""
    test_others_take_kept_cores_never_or_only_when_nothing_else_fits.hypothesis.inner_test(
        machine, "b", steps=18, seed=84083457, rules=[(0, 2)], ask=(1, 50, "none", {}),
        others=WHEN_FULL)


def test_preferred_falls_back_without_taking_cores_kept_never(machine) -> None:
    """Found by make test-explore (seed 2700997061) on the first version of choose.take: a
    near-policy preferred request that fell back off its devices took cores kept for others'
    devices under keep_near_others = never. Falling back drops the preference, never the
    rule."""
    test_others_take_kept_cores_never_or_only_when_nothing_else_fits.hypothesis.inner_test(
        machine, "b", steps=13, seed=132102, rules=[(0, 1), (1, 1)],
        ask=(2, 0, "mine", {"policy": "packed", "near-policy": "preferred"}), others=NEVER)
    test_others_take_kept_cores_never_or_only_when_nothing_else_fits.hypothesis.inner_test(
        machine, "snc", steps=24, seed=50339329, rules=[(3, 2)],
        ask=(3, 0, "other", {"near-policy": "preferred"}), others=NEVER)
