from __future__ import annotations

import json
from pathlib import Path

from cpuservice.host.sysfs import discover
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixtures import write_sysfs


def test_single_socket_no_smt(machine) -> None:
    t = machine("a")
    assert t.online == CPUSet.parse("0-7") and t.threads_per_core == 1
    assert len(t.cores) == 8 and list(t.nodes) == [0] and len(t.l3_groups) == 1


def test_two_sockets_siblings_n_and_n_plus_8(machine) -> None:
    t = machine("b")
    assert t.threads_per_core == 2
    assert t.cores[t.cpus[3].core] == CPUSet([3, 11])
    assert t.sockets[1] == CPUSet.parse("4-7,12-15")
    assert t.nodes[0] == CPUSet.parse("0-3,8-11")


def test_core_id_is_not_unique_across_packages(machine) -> None:
    t = machine("b")  # core_id 0 exists on both packages
    assert t.cpus[0].core != t.cpus[4].core


def test_epyc_like(machine) -> None:
    t = machine("c")
    assert len(t.cpus) == 128 and len(t.cores) == 64 and len(t.nodes) == 4
    assert len(t.l3_groups) == 8
    assert t.l3_groups[t.cpus[0].l3] == CPUSet.parse("0-7,64-71")
    assert t.cores[t.cpus[5].core] == CPUSet([5, 69])


def test_offline_noncontiguous_isolated(machine) -> None:
    t = machine("d")
    assert t.all == CPUSet.parse("0-5,16-21")
    assert t.online == CPUSet.parse("0-2,4-5,16,18-21")
    assert t.isolated == CPUSet.parse("20-21")
    assert not t.cpus[3].online and 3 in t.inferred and t.inferred == CPUSet([3, 17])
    assert t.cpus[3].socket == 0 and t.cpus[3].node == 0  # its node link, its node's package
    assert t.cpus[17].socket == 1 and t.cpus[17].node == 1
    assert t.cores[t.cpus[2].core] == CPUSet([2])  # its sibling 3 is offline
    assert t.core_size[t.cpus[2].core] == 1  # unknown without a previous topology


def test_offline_cpu_keeps_its_place_given_the_previous_topology(tmp_path: Path, machine) -> None:
    before = machine("b")
    root = write_sysfs(tmp_path, "b")
    base = root / "devices/system/cpu"
    (base / "online").write_text("0-10,12-15\n")
    (base / "cpu11/online").write_text("0\n")
    for sub in ("topology", "cache"):
        for f in sorted((base / f"cpu11/{sub}").rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        (base / f"cpu11/{sub}").rmdir()
    after = discover(root, previous=before)
    assert not after.cpus[11].online
    assert after.cpus[11].core == after.cpus[3].core
    assert after.cpus[11].l3 == after.cpus[3].l3 and after.cpus[11].node == 0
    assert after.core_size[after.cpus[3].core] == 2
    assert after.cores[after.cpus[3].core] == CPUSet([3])


def test_x86_cpu0_has_no_online_file_and_no_global_list(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "a")
    (root / "devices/system/cpu/online").unlink()
    (root / "devices/system/cpu/cpu5/online").write_text("0\n")
    assert not (root / "devices/system/cpu/cpu0/online").exists()
    assert discover(root).online == CPUSet.parse("0-4,6-7")


def test_no_numa_directory_means_node_0(tmp_path: Path) -> None:
    root = write_sysfs(tmp_path, "b")
    for f in sorted((root / "devices/system/node").rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    assert {c.node for c in discover(root).cpus.values()} == {0}


def test_json_and_1024(machine) -> None:
    t = machine("e")
    assert len(t.cpus) == 1024 and len(t.nodes) == 8
    rows = json.loads(t.to_json())
    assert rows[0] == {"cpu": 0, "core": 0, "socket": 0, "die": 0, "node": 0, "l3": 0,
                       "online": True, "inferred": False}


def test_real_sysfs_of_this_machine() -> None:
    t = discover("/sys")
    assert len(t.online) >= 1 and t.online <= t.all


def test_named_queries(machine) -> None:
    t = machine("b")
    assert (t.core_of(3), t.node_of(3), t.l3_of(3), t.socket_of(3)) == (
        t.cpus[3].core, 0, t.cpus[3].l3, 0)
    assert t.siblings(3) == CPUSet([3, 11]) and t.node_of(12) == 1
    assert t.whole_cores(CPUSet.parse("0-3,8-9")) == CPUSet.parse("0-1,8-9")
    assert t.count_whole_cores(CPUSet.parse("0-3,8-9")) == 2


def test_whole_cores_count_offline_threads(machine) -> None:
    t = machine("b").with_online(CPUSet.parse("0-10,12-15"))
    assert t.whole_cores(CPUSet([3])) == CPUSet() and t.core_size[t.core_of(3)] == 2


def test_with_online_keeps_what_is_known_of_memory(machine) -> None:
    t = machine("no-node")
    other = t.with_online(t.online - CPUSet([5]))
    assert other.notes == t.notes and other.pseudo_nodes == t.pseudo_nodes
    assert other.memory_of == t.memory_of and not other.cpus[5].online


def test_document_shape(machine) -> None:
    doc = machine("memoryless").document()
    assert set(doc) == {"cpus", "notes", "memory_nodes", "memory_only_nodes", "pseudo_nodes",
                        "memory_of", "node_memory_kb", "warnings"}
    assert doc["memory_nodes"] == "0" and doc["memory_of"] == {"1": "0"}
    assert json.loads(json.dumps(doc)) == doc
