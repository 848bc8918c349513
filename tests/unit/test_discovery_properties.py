"""Property tests: discovery on any reading, or any damaged tree, yields a consistent topology
(every core in one package, node and L3 group; every node a kernel node or a declared pseudo
node; memory nodes that exist and have memory; no negative id) or TopologyError, never an
exception from deep inside."""

from __future__ import annotations

import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.host.sysfs import discover
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.discovery import resolve
from cpuservice.model.fixtures import Machine, Style, write_reading
from cpuservice.model.reading import CPUFacts, NodeFacts, Reading
from cpuservice.model.topology import TopologyError
from tests.props import examples
from tests.unit.test_discovery import consistent

MAX_CPUS = 12
cpu_sets = st.frozensets(st.integers(0, MAX_CPUS + 2), max_size=MAX_CPUS).map(CPUSet)
maybe_sets = st.none() | cpu_sets
maybe_ids = st.none() | st.integers(-1, 5)


@st.composite
def readings(draw: st.DrawFn) -> Reading:
    """Anything a kernel, a buggy kernel or a CPU half-way through hotplug could show."""
    ids = draw(st.frozensets(st.integers(0, MAX_CPUS), min_size=1, max_size=MAX_CPUS))
    node_ids = draw(st.frozensets(st.integers(0, 4), max_size=4))
    pools = [draw(st.lists(cpu_sets, min_size=1, max_size=3)) for _ in range(4)]

    def mask(c: int, kind: int) -> CPUSet | None:
        """Mostly a mask several CPUs share (so that groups form), often naming ``c``."""
        how = draw(st.sampled_from(["none", "shared", "shared+self", "any"]))
        if how == "none":
            return None
        if how == "any":
            return draw(cpu_sets)
        chosen = draw(st.sampled_from(pools[kind]))
        return chosen | CPUSet([c]) if how == "shared+self" else chosen

    cpus = {
        c: CPUFacts(draw(st.booleans()), draw(maybe_ids), draw(maybe_ids), draw(maybe_ids),
                    mask(c, 0), mask(c, 1), mask(c, 2), mask(c, 3),
                    draw(st.booleans()), draw(st.none() | st.integers(0, 5)))
        for c in sorted(ids)
    }
    nodes = {n: NodeFacts(draw(maybe_sets), draw(st.none() | st.integers(0, 2)),
                          draw(st.none() | st.lists(st.integers(10, 40), min_size=len(node_ids),
                                                    max_size=len(node_ids)).map(tuple)))
             for n in sorted(node_ids)}
    return Reading(cpus, draw(cpu_sets), nodes, draw(cpu_sets),
                   draw(st.none() | st.frozensets(st.integers(0, 6)).map(CPUSet)))


@settings(max_examples=examples(300))
@given(reading=readings(), again=st.booleans(), other=readings())
def test_resolve_any_reading(reading: Reading, again: bool, other: Reading) -> None:
    t = resolve(reading)
    consistent(t, set(reading.nodes))
    if again:  # with a previous topology, even another machine's
        consistent(resolve(reading, t), set(reading.nodes))
        consistent(resolve(other, t), set(other.nodes))


machines = st.builds(
    Machine, st.integers(1, 2), st.integers(1, 4), st.integers(1, 2), nodes=st.integers(1, 2),
    l3_cores=st.none() | st.integers(1, 4), adjacent_siblings=st.booleans(),
    small_cores=st.integers(0, 1), core_ids=st.sampled_from(["per-package", "per-node",
                                                             "compute-units"]),
    package_id_unknown=st.booleans(), memory_only_nodes=st.integers(0, 1),
)
styles = st.builds(Style, lists=st.booleans(), maps=st.booleans(), old_names=st.booleans(),
                   end=st.sampled_from(["\n", "\n\0", "", "  \n\0\0"]), meminfo=st.booleans())
damage = st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(
    ["delete", "garbage", "empty", "minus", "huge", "rmdir"])), max_size=6)


@settings(max_examples=examples(40))
@given(machine=machines, style=styles, damage=damage,
       offline=st.frozensets(st.integers(1, 15), max_size=3))
def test_discover_any_damaged_tree(tmp_path_factory, machine: Machine, style: Style,
                                   damage: list[tuple[int, str]], offline: frozenset[int]
                                   ) -> None:
    if machine.nodes > machine.sockets * machine.cores_per_socket:
        machine = Machine(machine.sockets, machine.cores_per_socket, machine.threads)
    ids = {row[0] for row in machine.layout()}
    spec = Machine(**{**machine.__dict__, "offline": frozenset(offline & ids)})
    root = write_reading(tmp_path_factory.mktemp("sys"), spec.reading(), style)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    dirs = sorted(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())
    for index, how in damage:
        if how == "rmdir":
            shutil.rmtree(dirs[index % len(dirs)], ignore_errors=True)
            continue
        path = files[index % len(files)]
        if not path.exists():
            continue
        if how == "delete":
            path.unlink()
        else:
            path.write_text({"garbage": "x,\0-3\n", "empty": "", "minus": "-1\n",
                             "huge": "99999999999999999999\n"}[how])
    try:
        t = discover(root)
    except TopologyError:
        return
    nodes = {int(p.name[4:]) for p in Path(root, "devices/system/node").glob("node*")
             if p.name[4:].isdigit()}
    consistent(t, nodes)
