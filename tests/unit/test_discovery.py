"""Discovery on the shapes real kernels write (cpuservice.model.fixtures.SHAPES, learned from the
real
/sys dumps hwloc keeps as test data): masks are the truth, ids are labels, contradictions are
resolved by the documented rules with a warning naming the file, nothing unknown becomes an id."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cpuservice.host.sysfs import discover, parse_map, read
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixtures import MACHINES, SHAPES, Machine, Style, write_sysfs
from cpuservice.model.topology import Topology

STYLES = {
    "lists": Style(),
    "maps-only": Style(lists=False, maps=True),  # POWER9 on 4.14, old kernels: no *_list files
    "old-names": Style(old_names=True),  # thread_siblings/core_siblings only
    "nul": Style(end="\n\0"),  # 5.15-rc1
    "no-meminfo": Style(meminfo=False),  # has_memory alone says which nodes have memory
}


def consistent(t: Topology, kernel_nodes: set[int]) -> None:
    """What every topology must satisfy (also used by the property tests)."""
    nodes = kernel_nodes or {0}
    for info in t.cpus.values():
        assert min(info.cpu, info.core, info.socket, info.die, info.node, info.l3) >= 0
        assert info.node in nodes or info.node in t.pseudo_nodes
    assert not t.pseudo_nodes & CPUSet(nodes)
    for cpus in [*t.cores.values()]:
        assert len({(t.socket_of(c), t.node_of(c), t.l3_of(c)) for c in cpus}) == 1
    memory = t.node_set(t.all)
    assert memory and memory.ids <= nodes
    if t.memory_nodes is not None:
        assert memory <= t.memory_nodes
    assert all(n.ids <= nodes for n in t.memory_of.values())
    json.loads(t.to_json())
    json.dumps(t.document())


@pytest.mark.parametrize("name", sorted(set(MACHINES) - {"e"} | set(SHAPES)))
@pytest.mark.parametrize("style", sorted(STYLES))
def test_discovery_of_the_written_tree_is_the_machine_built_in_memory(
        tmp_path: Path, name: str, style: str) -> None:
    machine = {**MACHINES, **SHAPES}[name]
    found = discover(write_sysfs(tmp_path, machine, STYLES[style]))
    assert found == machine.topology() and not found.warnings
    consistent(found, set(range(machine.nodes + machine.memory_only_nodes)))


def test_planner_machines_are_built_without_files() -> None:
    t = MACHINES["e"].topology()
    assert len(t.cpus) == 1024 and len(t.cores) == 512 and len(t.nodes) == 8


def test_repeated_core_id_is_not_smt(machine) -> None:
    """AMD Opteron 6134: core_id 0-3 in each node of a package; the masks say no SMT."""
    t = machine("opteron")
    assert t.threads_per_core == 1 and len(t.cores) == 16
    assert t.siblings(0) == CPUSet([0]) and t.count_whole_cores(CPUSet.parse("0-2")) == 3


def test_compute_unit_siblings_with_their_own_core_ids_are_cores(machine) -> None:
    """AMD Bulldozer (Opteron 6276): a compute unit's two cores are listed as thread siblings
    but carry their own core_id: two cores, as hwloc counts them."""
    t = machine("bulldozer")
    assert len(t.cores) == 32 and t.threads_per_core == 1


def test_package_id_minus_one(machine) -> None:
    """s390: physical_package_id is -1 everywhere; the package masks tell the packages."""
    t = machine("s390")
    assert sorted(t.sockets) == [0, 1, 2] and t.sockets[1] == CPUSet.parse("4-7")
    assert len(t.cores) == 12 and len(t.l3_groups) == 3


def test_hybrid_cores_have_their_own_sizes(machine) -> None:
    t = machine("hybrid")  # 6 P-cores of 2 threads (0-11), 4 E-cores of 1 (12-15)
    sizes = sorted(t.core_size.values())
    assert sizes == [1] * 4 + [2] * 6 and t.threads_per_core == 2
    assert t.core_size[t.core_of(12)] == 1 and t.core_size[t.core_of(0)] == 2
    assert t.whole_cores(CPUSet.parse("1-2,12-13")) == CPUSet.parse("12-13")
    assert t.count_whole_cores(CPUSet.parse("0-1,12")) == 2


def test_sub_numa_clustering_l3_spans_nodes(machine) -> None:
    t = machine("snc")
    assert len(t.nodes) == 4 and len(t.l3_groups) == 2
    assert t.l3_groups[t.l3_of(0)] == t.nodes[0] | t.nodes[1]


def test_memory_only_nodes_are_seen_and_never_used_for_cpus(machine) -> None:
    t = machine("memory-only")
    assert t.memory_only_nodes == CPUSet([2, 3]) and set(t.nodes) == {0, 1}
    assert t.memory_nodes == CPUSet.parse("0-3") and t.node_set(t.all) == CPUSet([0, 1])
    assert t.document()["memory_only_nodes"] == "2-3"


def test_a_node_without_memory_uses_its_nearest_memory_node(machine) -> None:
    t = machine("memoryless")
    assert t.memory_nodes == CPUSet([0]) and t.node_set(t.nodes[1]) == CPUSet([0])
    assert t.memory_of == {1: CPUSet([0])}


def test_cpus_in_no_node_get_a_pseudo_node_and_notes(machine) -> None:
    """RHEL 7.6: online CPUs in no node's cpulist, no link: their package has no known node
    either, so they form a NUMA group of their own, which takes memory from every node."""
    t = machine("no-node")
    assert t.pseudo_nodes == CPUSet([2]) and t.nodes[2] == CPUSet.parse("4-7,12-15")
    assert t.node_set(CPUSet([4])) == CPUSet([0, 1])
    assert "pseudo node 2" in t.notes[4] and set(t.notes) == set(t.nodes[2])
    rows = json.loads(t.to_json())
    assert "note" in rows[4] and "note" not in rows[0]
    assert t.document()["notes"]["4"] == t.notes[4]


def test_a_cpu_in_no_node_goes_with_its_siblings() -> None:
    t = dataclasses.replace(MACHINES["b"], unlisted=frozenset({5})).topology()
    assert t.node_of(5) == 1 and "core siblings on node1" in t.notes[5]
    t = dataclasses.replace(MACHINES["a"], nodes=1, unlisted=frozenset({3})).topology()
    assert t.node_of(3) == 0 and "package on node0" in t.notes[3]


def test_offline_cpus(machine) -> None:
    t = machine("offline")
    assert t.inferred == CPUSet([5, 6, 13]) and not t.notes
    assert t.core_size[t.core_of(5)] == 1  # never seen: a core of its own until read
    assert t.node_of(5) == 1 and t.node_of(6) == 1


def test_hex_maps(tmp_path: Path) -> None:
    assert parse_map("00000000,0000ff00\n\0") == CPUSet.parse("8-15")
    assert parse_map("1,00000001") == CPUSet([0, 32])
    root = write_sysfs(tmp_path, "c", Style(lists=False, maps=True))
    assert not (root / "devices/system/node/node0/cpulist").exists()
    t = discover(root)
    assert len(t.nodes) == 4 and len(t.l3_groups) == 8 and len(t.cores) == 64


def test_a_malformed_file_is_a_warning_naming_it(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "b")
    topo = root / "devices/system/cpu/cpu3/topology"
    (topo / "core_cpus_list").write_text("3-\x00garbage\n")
    (root / "devices/system/cpu/cpu4/topology/core_id").write_text("four\n")
    t = discover(root)
    assert any("cpu3/topology/core_cpus_list" in w and "not a CPU list" in w for w in t.warnings)
    assert any("cpu4/topology/core_id" in w for w in t.warnings)
    assert t.siblings(3) == CPUSet([3, 11])  # from thread_siblings_list
    consistent(t, {0, 1})


def test_a_mask_that_does_not_name_its_cpu_is_passed_over(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "b", Style(maps=True))
    (root / "devices/system/cpu/cpu8/cache/index3/shared_cpu_list").write_text("0-3\n")
    t = discover(root)
    assert any("cpu8/cache/index3/shared_cpu_list" in w and "does not name cpu8" in w
               for w in t.warnings)
    assert t.l3_of(8) == t.l3_of(0)  # from shared_cpu_map


def test_a_cpu_in_two_nodes_lists(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "b")
    (root / "devices/system/node/node1/cpulist").write_text("3-7,12-15\n")
    t = discover(root)
    assert t.node_of(3) == 0 and "its cpu link" in t.notes[3]  # its cpu3/node0 link
    assert any("node0/cpulist and devices/system/node/node1/cpulist" in w for w in t.warnings)
    (root / "devices/system/cpu/cpu3/node0").unlink()
    (root / "devices/system/node/node0/cpulist").write_text("0-2,8-11\n")
    (root / "devices/system/node/node1/cpulist").write_text("3-7,12-15\n")
    (root / "devices/system/node/node0/cpulist").write_text("0-3,8-11\n")
    assert discover(root).node_of(3) == 0  # no link: the lowest


def test_disagreeing_sibling_masks(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "b")
    for name in ("core_cpus_list", "thread_siblings_list"):
        (root / f"devices/system/cpu/cpu8/topology/{name}").write_text("8\n")
    t = discover(root)
    assert t.siblings(0) == CPUSet([0]) and t.siblings(8) == CPUSet([8])
    assert any("cpu0/topology/core_cpus_list says 0,8" in w for w in t.warnings)


def test_a_core_reported_in_two_nodes_follows_its_lowest_cpu(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "b")
    (root / "devices/system/node/node0/cpulist").write_text("0-3,8-10\n")
    (root / "devices/system/node/node1/cpulist").write_text("4-7,11-15\n")
    (root / "devices/system/cpu/cpu11/node0").unlink()
    t = discover(root)
    assert t.node_of(11) == 0 and any("cpu11" in w and "node differs" in w for w in t.warnings)


def test_no_numa_directory_means_node_0_with_memory(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "b")
    for f in sorted((root / "devices/system/node").rglob("*"), reverse=True):
        f.unlink() if f.is_file() or f.is_symlink() else f.rmdir()
    t = discover(root)
    assert set(t.nodes) == {0} and t.node_set(t.all) == CPUSet([0])


def test_a_tree_without_topology_files(tmp_path: Path) -> None:
    """Some kernels (old POWER) show an empty topology directory: each CPU is its own core and
    the machine one package."""
    root = write_sysfs(tmp_path, "a")
    for f in (root / "devices/system/cpu").glob("cpu*/topology/*"):
        f.unlink()
    t = discover(root)
    assert len(t.cores) == 8 and list(t.sockets) == [0] and not t.inferred


def test_reading_is_what_was_written(tmp_path: Path) -> None:
    machine = SHAPES["memory-only"]
    reading = read(write_sysfs(tmp_path, machine))
    assert reading.nodes[2].memory_kb == 16 << 20 and reading.has_memory == CPUSet.parse("0-3")
    assert reading.cpus[0].core_cpus == machine.reading().cpus[0].core_cpus


def test_shapes_are_distinct_machines() -> None:
    assert isinstance(SHAPES["s390"], Machine) and SHAPES["s390"].package_id_unknown


def test_package_numbers_stay_put_when_a_whole_package_goes_offline(tmp_path: Path) -> None:
    """s390 (package id -1): packages are numbered; through hotplug the numbers do not move, so
    a package that is offline keeps its own number (not that of another package)."""
    machine = SHAPES["s390"]
    before = discover(write_sysfs(tmp_path, machine))
    down = discover(write_sysfs(tmp_path, dataclasses.replace(
        machine, offline=frozenset({4, 5, 6, 7}))), previous=before)
    assert down.socket_of(8) == before.socket_of(8) == 2 and down.socket_of(4) == 1
    assert discover(write_sysfs(tmp_path, machine), previous=down) == before


def test_impossible_ids_are_ignored_with_a_warning(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "a")
    (root / "devices/system/cpu/cpu99999/topology").mkdir(parents=True)
    (root / "devices/system/node/node99999").mkdir(parents=True)
    t = discover(root)
    assert t.all == CPUSet.parse("0-7") and any("cpu99999" in w for w in t.warnings)


def test_node_distances_are_read_from_sysfs(tmp_path: Path) -> None:
    """nodeN/distance rows become Topology.distance; the fixture's table is 10 local, 20 to a
    node of the same kind, 30 to a memory-only one."""
    t = discover(write_sysfs(tmp_path, "memory-only"))
    assert t.distance(0, 0) == 10 and t.distance(0, 1) == 20 and t.distance(1, 3) == 30
    assert t.node_distances[2] == {0: 30, 1: 30, 2: 10, 3: 20}


def test_node_distances_default_to_the_kernels_when_unread(tmp_path: Path) -> None:
    """A missing or short row: no table at all (never half of one), the defaults 10/20."""
    root = write_sysfs(tmp_path, "b")
    (root / "devices/system/node/node1/distance").write_text("10\n")
    t = discover(root)
    assert t.node_distances == {}
    assert (t.distance(1, 1), t.distance(0, 1)) == (10, 20)
    assert MACHINES["a"].topology().distance(0, 0) == 10
