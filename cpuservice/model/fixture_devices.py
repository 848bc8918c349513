"""Imaginary devices for the tests and benchmarks of option ``near``: PCI functions of every
class it resolves (network, InfiniBand, DRM, NVMe, NVIDIA GPUs), on chosen NUMA nodes, written
as the kernel lays them out in sysfs (and NVIDIA's files in procfs) next to a machine of
cpuservice.model.fixtures; plus the numbers of their /dev nodes, since a test cannot make real
ones (Resolver's ``dev_of``).

Layouts: ``DEVICE_SETS["gpu-box"]`` for machine ``b`` (2 nodes), ``DEVICE_SETS["snc"]`` for the
``snc`` shape (4 nodes, 2 per socket), ``many(n, nodes)`` for benchmarks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixtures import MACHINES, SHAPES, Machine

DRM_MAJOR, NVME_MAJOR, NVME_CHAR_MAJOR, NVIDIA_MAJOR = 226, 259, 242, 195


@dataclass(frozen=True)
class FakeDevice:
    """One PCI function. ``kind``: net, infiniband, drm, nvme, nvidia or pci (none of them);
    ``name``: its interface, InfiniBand, DRM card or NVMe controller name; ``minor``: the
    number of its /dev node (cardN / nvmeN / nvidiaN); ``node``: its numa_node (-1: none);
    ``bridge``: behind a root port (the device's path is two levels under the root bus)."""

    address: str
    node: int
    kind: str = "pci"
    name: str = ""
    minor: int = 0
    bridge: bool = True


DEVICE_SETS: dict[str, tuple[FakeDevice, ...]] = {
    "gpu-box": (
        FakeDevice("0000:17:00.0", 0, "net", "eth0"),
        FakeDevice("0000:3b:00.0", 1, "net", "eth1"),
        FakeDevice("0000:3b:00.1", -1, "net", "eth2"),  # firmware says nothing
        FakeDevice("0000:5e:00.0", 1, "infiniband", "mlx5_0"),
        FakeDevice("0000:18:00.0", 0, "drm", "card0", 0),
        FakeDevice("0000:86:00.0", 1, "nvme", "nvme0", 0),
        FakeDevice("0000:19:00.0", 0, "nvidia", minor=0),
        FakeDevice("0000:af:00.0", 1, "nvidia", minor=1, bridge=False),
        FakeDevice("0000:d8:00.0", 7, "pci"),  # a node this machine does not have
    ),
    "snc": (  # 2 NUMA nodes per socket: the device's node is one of them
        FakeDevice("0000:17:00.0", 1, "net", "eth0"),
        FakeDevice("0000:98:00.0", 2, "nvidia", minor=0),
        FakeDevice("0000:99:00.0", 3, "nvme", "nvme0", 0),
    ),
}


def many(n: int, nodes: int) -> tuple[FakeDevice, ...]:
    """``n`` devices of every kind, spread over ``nodes`` nodes (every eighth without one)."""
    kinds = ("net", "infiniband", "drm", "nvme", "nvidia", "pci")
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        name = {"net": f"eth{i}", "infiniband": f"mlx5_{i}", "drm": f"card{i}",
                "nvme": f"nvme{i}"}.get(kind, "")
        out.append(FakeDevice(f"0000:{i + 1:02x}:00.0", -1 if i % 8 == 7 else i % nodes, kind,
                              name, i))
    return tuple(out)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_devices(root: str | Path, devices: tuple[FakeDevice, ...] | str,
                  machine: Machine | str = "b", proc: str | Path | None = None
                  ) -> dict[str, tuple[str, int, int]]:
    """Write ``devices`` (or a name of DEVICE_SETS) into the sysfs tree at ``root`` (a tree of
    ``machine``, for their ``local_cpulist``), NVIDIA's files under ``proc``, and the virtual
    devices every system has (``lo``, ``/dev/null``). Returns the /dev paths with their
    (kind, major, minor), for Resolver's ``dev_of``."""
    root = Path(root)
    spec = machine if isinstance(machine, Machine) else {**MACHINES, **SHAPES}[machine]
    reading = spec.reading()
    node_cpus: Mapping[int, CPUSet] = {n: f.cpus or CPUSet() for n, f in reading.nodes.items()}
    everything = reading.online
    devs: dict[str, tuple[str, int, int]] = {}
    for d in (DEVICE_SETS[devices] if isinstance(devices, str) else devices):
        bus = d.address[:7]
        top = root / f"devices/pci{bus}"
        here = (top / f"{bus}:00.0" / d.address) if d.bridge else top / d.address
        if d.bridge:
            _write(here.parent / "numa_node", str(d.node))
        local = node_cpus.get(d.node, everything) if d.node >= 0 else everything
        _write(here / "numa_node", str(d.node))
        _write(here / "local_cpulist", local.format())
        _write(here / "vendor", "0x10de" if d.kind == "nvidia" else "0x8086")
        _link(root / "bus/pci/devices" / d.address, here)
        if d.kind in ("net", "infiniband"):
            child = here / d.kind / d.name
            _write(child / "uevent", f"INTERFACE={d.name}" if d.kind == "net" else "")
            _link(child / "device", here)
            _link(root / "class" / d.kind / d.name, child)
        elif d.kind == "drm":
            for name, minor in ((d.name, d.minor), (f"renderD{128 + d.minor}", 128 + d.minor)):
                child = here / "drm" / name
                _write(child / "dev", f"{DRM_MAJOR}:{minor}")
                _write(child / "uevent", f"MAJOR={DRM_MAJOR}\nMINOR={minor}\nDEVNAME=dri/{name}")
                _link(child / "device", here)
                _link(root / "class/drm" / name, child)
                _link(root / "dev/char" / f"{DRM_MAJOR}:{minor}", child)
                devs[f"/dev/dri/{name}"] = ("char", DRM_MAJOR, minor)
        elif d.kind == "nvme":
            ctrl = here / "nvme" / d.name
            _write(ctrl / "numa_node", str(d.node))  # the controller has its own, as in Linux
            _write(ctrl / "uevent", f"MAJOR={NVME_CHAR_MAJOR}\nMINOR={d.minor}\nDEVNAME={d.name}")
            _link(ctrl / "device", here)
            _link(root / "class/nvme" / d.name, ctrl)
            _link(root / "dev/char" / f"{NVME_CHAR_MAJOR}:{d.minor}", ctrl)
            ns = ctrl / f"{d.name}n1"
            _write(ns / "dev", f"{NVME_MAJOR}:{d.minor}")
            _write(ns / "uevent", f"MAJOR={NVME_MAJOR}\nMINOR={d.minor}\nDEVNAME={ns.name}\n"
                                  "DEVTYPE=disk")
            _link(root / "class/block" / ns.name, ns)
            _link(root / "dev/block" / f"{NVME_MAJOR}:{d.minor}", ns)
            devs[f"/dev/{d.name}"] = ("char", NVME_CHAR_MAJOR, d.minor)
            devs[f"/dev/{ns.name}"] = ("block", NVME_MAJOR, d.minor)
        elif d.kind == "nvidia" and proc is not None:
            _write(Path(proc) / "driver/nvidia/gpus" / d.address / "information",
                   f"Model: \t\t NVIDIA Imaginary\nIRQ:   \t\t 42\nGPU UUID: \t GPU-{d.minor:08x}"
                   f"\nVideo BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDMA Size: \t 47 bits"
                   f"\nDMA Mask: \t 0x7fffffffffff\nBus Location: \t {d.address}\n"
                   f"Device Minor: \t {d.minor}\nGPU Excluded:\t No")
            devs[f"/dev/nvidia{d.minor}"] = ("char", NVIDIA_MAJOR, d.minor)
    lo = root / "devices/virtual/net/lo"
    _write(lo / "uevent", "INTERFACE=lo")
    _link(root / "class/net/lo", lo)
    null = root / "devices/virtual/mem/null"
    _write(null / "dev", "1:3")
    _link(root / "dev/char/1:3", null)
    devs["/dev/null"] = ("char", 1, 3)
    return devs


def dev_of(numbers: Mapping[str, tuple[str, int, int]]
           ) -> Callable[[Path], tuple[str, int, int]]:
    """A Resolver ``dev_of`` for the /dev nodes write_devices() names (LookupError for
    others, as stat(2) of a missing node)."""
    def lookup(path: Path) -> tuple[str, int, int]:
        try:
            return numbers[str(path)]
        except KeyError:
            raise LookupError(f"{path}: No such file or directory") from None
    return lookup
