"""Option near, resolution (issue 38): every kind of device name found in a fixture sysfs tree
(cpuservice.model.fixture_devices) with its NUMA node, -1 and virtual devices without locality,
SNC machines, NVIDIA's /dev/nvidiaN through procfs, unknown devices named in the error, and
hostile names refused before anything is read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.host.devices import Resolver
from cpuservice.model import near
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.fixture_devices import dev_of, many, write_devices
from cpuservice.model.fixtures import MACHINES, SHAPES, write_sysfs
from cpuservice.model.near import Device
from tests.props import examples


def box(tmp: Path, devices: str = "gpu-box", machine: str = "b") -> Resolver:
    sys_root = write_sysfs(tmp / "sys", machine)
    numbers = write_devices(sys_root, devices, machine, proc=tmp / "proc")
    return Resolver(sys_root, tmp / "proc", "/dev", dev_of(numbers))


@pytest.fixture(scope="module")
def gpu_box(tmp_path_factory: pytest.TempPathFactory) -> Resolver:
    """The gpu-box tree, written once: the tests that only read it share it."""
    return box(tmp_path_factory.mktemp("gpu-box"))


@pytest.mark.parametrize(("name", "node", "kind", "address"), [
    ("0000:3b:00.0", 1, "pci", "0000:3b:00.0"),
    ("3b:00.0", 1, "pci", "0000:3b:00.0"),  # the short form, domain 0000
    ("0000:3B:00.0", 1, "pci", "0000:3b:00.0"),
    ("eth0", 0, "net", "0000:17:00.0"),
    ("eth1", 1, "net", "0000:3b:00.0"),
    ("mlx5_0", 1, "infiniband", "0000:5e:00.0"),
    ("card0", 0, "drm", "0000:18:00.0"),
    ("renderD128", 0, "drm", "0000:18:00.0"),
    ("nvme0", 1, "nvme", "0000:86:00.0"),
    ("nvme0n1", 1, "block", "0000:86:00.0"),
    ("/dev/nvme0n1", 1, "block", "0000:86:00.0"),
    ("/dev/nvme0", 1, "char", "0000:86:00.0"),
    ("/dev/dri/renderD128", 0, "char", "0000:18:00.0"),
    ("/dev/dri/card0", 0, "char", "0000:18:00.0"),
    ("/dev/nvidia0", 0, "nvidia", "0000:19:00.0"),
    ("/dev/nvidia1", 1, "nvidia", "0000:af:00.0"),
    ("eth2", -1, "net", "0000:3b:00.1"),
    ("lo", -1, "net", ""),
    ("/dev/null", -1, "char", ""),
    ("0000:d8:00.0", 7, "pci", "0000:d8:00.0"),
])
def test_every_kind_of_name_resolves_to_its_node(gpu_box: Resolver, name: str, node: int,
                                                 kind: str, address: str) -> None:
    assert gpu_box.resolve(name) == Device(name, node, kind, address)


def test_what_is_next_to_each_device(gpu_box: Resolver) -> None:
    r = gpu_box
    t = MACHINES["b"].topology()
    eth1, eth2, gone = (r.resolve(n) for n in ("eth1", "eth2", "0000:d8:00.0"))
    assert near.near_cpus(t, (eth1,)) == t.nodes[1]
    assert near.near_memory(t, (eth1,)) == CPUSet([1])
    assert near.near_cpus(t, (eth2,)) is None  # -1: constrains nothing
    assert near.near_cpus(t, (gone,)) is None  # node 7: not on this machine
    assert "constrains nothing" in near.where(t, eth2)
    assert "does not have" in near.where(t, gone)
    assert near.where(t, eth1) == "eth1 (net 0000:3b:00.0): NUMA node 1"
    both = (eth1, r.resolve("eth0"))
    assert near.near_cpus(t, both) == t.online
    assert near.located(t, (eth2, eth1)) == (1,)


def test_snc_device_is_on_one_of_its_sockets_nodes(tmp_path: Path) -> None:
    r = box(tmp_path, "snc", "snc")
    t = SHAPES["snc"].topology()
    gpu = r.resolve("/dev/nvidia0")
    assert (gpu.node, gpu.address) == (2, "0000:98:00.0")
    assert near.near_cpus(t, (gpu,)) == t.nodes[2]
    socket = {t.socket_of(c) for c in t.nodes[2]}
    assert len(socket) == 1 and t.nodes[2] <= t.sockets[socket.pop()] != t.nodes[2]


def test_a_node_without_online_cpus_takes_the_nearest(tmp_path: Path) -> None:
    t = SHAPES["memory-only"].topology()  # nodes 2 and 3 have memory and no CPU
    d = Device("cxl0", 2, "pci", "0000:01:00.0")
    assert near.cpu_nodes(t, 2) == (0, 1)  # equidistant (30) from both
    assert near.near_memory(t, (d,)) == CPUSet([2])  # its own memory
    assert "no online CPU there" in near.where(t, d)
    offline = t.with_online(t.online - t.nodes[1])
    assert near.cpu_nodes(offline, 1) == (0,)


def test_nvidia_minor_without_a_gpu_is_named(gpu_box: Resolver) -> None:
    with pytest.raises(InvalidArgument, match=r"'/dev/nvidia5'.*Device Minor 5"):
        gpu_box.resolve("/dev/nvidia5")


@pytest.mark.parametrize(("name", "says"), [
    ("eth9", r"no device 'eth9' here \(no .*/class/\{net,infiniband,drm,nvme,block\}/eth9\)"),
    ("0000:3c:00.0", r"no device '0000:3c:00.0' here \(no .*/bus/pci/devices/0000:3c:00.0\)"),
    ("/dev/sdz", r"'/dev/sdz' here \(/dev/sdz: No such file"),
])
def test_unknown_devices_name_what_was_looked_up(gpu_box: Resolver, name: str, says: str
                                                 ) -> None:
    with pytest.raises(InvalidArgument, match=says):
        gpu_box.resolve(name)


def test_a_vanished_device_is_no_longer_present(tmp_path: Path) -> None:
    r = box(tmp_path)
    eth1 = r.resolve("eth1")
    assert r.present(eth1)
    os.unlink(tmp_path / "sys/class/net/eth1")
    assert not r.present(eth1)


@pytest.mark.parametrize("name", [
    "/dev/../etc/shadow", "/dev/./null", "/etc/passwd", "/sys/class/net/eth0", "/dev/",
    "/dev//null", "../eth0", "eth0/../../x", "", "x" * 200, "eth 0", "eth0\n", "a,b", "-eth0",
    "/proc/self/root/etc/shadow", "/dev/nul\x00l", "eth0@1@net@", ".hidden", "é0",
])
def test_hostile_names_are_refused_before_anything_is_read(name: str) -> None:
    def never(path: Path) -> tuple[str, int, int]:
        raise AssertionError(f"looked at {path}")
    r = Resolver("/nonexistent/sys", "/nonexistent/proc", "/dev", never)
    with pytest.raises(InvalidArgument, match="option 'near'"):
        r.resolve(name)  # a recorded item (NAME@...) or a list is no name either
    if "@" not in name and "," not in name:
        with pytest.raises(InvalidArgument, match="option 'near'"):
            near.parse(name)


def test_links_out_of_dev_and_sys_devices_are_refused(tmp_path: Path) -> None:
    sys_root = write_sysfs(tmp_path / "sys", "b")
    (tmp_path / "sys/class/net").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret/numa_node").write_text("1\n")
    os.symlink(tmp_path / "secret", tmp_path / "sys/class/net/evil")
    devroot = tmp_path / "dev"
    devroot.mkdir()
    os.symlink("/etc/passwd", devroot / "passwd")
    r = Resolver(sys_root, tmp_path / "proc", devroot)
    with pytest.raises(InvalidArgument, match="outside"):
        r.resolve("evil")
    with pytest.raises(InvalidArgument, match="outside"):
        r.resolve("/dev/passwd")


def test_real_dev_nodes_are_read_with_stat(tmp_path: Path) -> None:
    """stat(2) of real nodes: /dev/null is char 1:3, a virtual device (the fixture's tree)."""
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    sys_root = write_sysfs(tmp_path / "sys", "b")
    write_devices(sys_root, "gpu-box")
    assert Resolver(sys_root).resolve("/dev/null") == Device("/dev/null", -1, "char", "")


def test_capabilities_list_what_can_be_resolved(gpu_box: Resolver, tmp_path: Path) -> None:
    assert gpu_box.kinds() == near.KINDS
    bare = Resolver(write_sysfs(tmp_path / "bare", "b"), tmp_path / "noproc")
    assert bare.kinds() == ()


def test_limits_on_what_a_caller_names() -> None:
    many_names = ",".join(f"eth{i}" for i in range(near.MAX_DEVICES + 1))
    with pytest.raises(InvalidArgument, match="at most 16"):
        near.parse(many_names)
    with pytest.raises(InvalidArgument, match="named twice"):
        near.parse("eth0,eth0")
    with pytest.raises(InvalidArgument, match="too long"):
        near.parse("a" * 10_000)
    assert len(near.parse(",".join(f"eth{i}" for i in range(16)))) == 16


def test_recorded_items_round_trip() -> None:
    devices = (Device("eth1", 1, "net", "0000:3b:00.0"), Device("/dev/null", -1, "char", ""),
               Device("0000:d8:00.0", 7, "pci", "0000:d8:00.0"))
    assert near.parse(near.encode(devices)) == devices
    for bad in ("eth1@1", "eth1@x@net@", "eth1@1@tape@", "eth1@1@net@zz", "eth1@99999@net@",
                "eth1@1@net@@"):
        with pytest.raises(InvalidArgument):
            near.parse(bad)


def test_many_devices_resolve(tmp_path: Path) -> None:
    sys_root = write_sysfs(tmp_path / "sys", "c")
    numbers = write_devices(sys_root, many(64, 4), "c", proc=tmp_path / "proc")
    r = Resolver(sys_root, tmp_path / "proc", "/dev", dev_of(numbers))
    found = [r.resolve(f"0000:{i + 1:02x}:00.0") for i in range(64)]
    assert [d.node for d in found] == [-1 if i % 8 == 7 else i % 4 for i in range(64)]
    assert r.resolve("/dev/nvidia4").address == "0000:05:00.0"


NAME_CHARS = st.characters(min_codepoint=1, max_codepoint=0x7F)


@settings(max_examples=examples(300))
@given(st.text(NAME_CHARS, max_size=80))
def test_any_text_is_a_valid_name_or_a_named_error(text: str) -> None:
    """Whatever a caller sends: parse() gives devices whose names each have a known form (a
    /dev path without . or .. parts, under /dev), or InvalidArgument; never anything else."""
    try:
        devices = near.parse(text)
    except InvalidArgument:
        return
    for d in devices:
        kind = near.form(d.name)
        if kind == "dev":
            parts = d.name.split("/")
            assert parts[1] == "dev" and ".." not in parts and "." not in parts
        assert "," not in d.name and len(d.name) <= near.MAX_NAME


@pytest.mark.parametrize(("name", "kind", "node"), [
    ("/dev/nvme0n1", "block", 1), ("/dev/nvme0", "char", 1), ("/dev/dri/renderD128", "char", 0)])
def test_a_private_dev_finds_kernel_names_through_sysfs(gpu_box: Resolver, name: str,
                                                        kind: str, node: int) -> None:
    """The unit's PrivateDevices=yes leaves the daemon a /dev of pseudo devices: a node the
    kernel names is found by its uevent's DEVNAME under /sys/class."""
    def private(path: Path) -> tuple[str, int, int]:
        raise LookupError(f"{path}: No such file or directory")
    r = Resolver(gpu_box.sys, gpu_box.proc, "/nonexistent-dev", private)
    found = r.resolve(name)
    assert (found.kind, found.node) == (kind, node)
    with pytest.raises(InvalidArgument, match="No such file"):
        r.resolve("/dev/disk/by-id/nvme-x")  # udev's links are not found this way
