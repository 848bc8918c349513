"""Find the devices of option ``near`` in sysfs: the thin I/O shell around cpuservice.model.near.

As the kernel and its peers lay them out (nri-plugins reads a ``/dev`` node the same way):

- a PCI address: ``/sys/bus/pci/devices/<address>``;
- a ``/dev`` path: its char or block device number, ``/sys/dev/{char,block}/<major>:<minor>``,
  then up the device's real path until a ``numa_node`` appears; where the daemon's /dev holds
  only pseudo devices (its unit's PrivateDevices=yes), the device whose uevent names that node
  (DEVNAME), at /sys/class/<class>/<name>; NVIDIA's ``/dev/nvidiaN`` has no sysfs device:
  ``/proc/driver/nvidia/gpus/<address>/information`` names its "Device Minor";
- a name: ``/sys/class/{net,infiniband,drm,nvme,block}/<name>``, then up its real path as well.

The node is the first ``numa_node`` up the device's path (-1: the firmware says nothing); a
device with none up to ``/sys/devices`` (a virtual device: ``lo``, ``/dev/null``) has no
locality. Only these places are read: a caller's name never leads the daemon elsewhere (the
names are checked by cpuservice.model.near: no ``..``, ``/dev`` paths only; every link is
followed and must stay under ``/dev`` or ``/sys/devices``), each file read is a few bytes, each
walk and directory scan bounded.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from cpuservice.model import near
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.near import Device

MAX_DEPTH = 32  # directories up a device's path
MAX_GPUS = 256  # entries of /proc/driver/nvidia/gpus looked at
MAX_CLASSES = 256  # entries of /sys/class looked at
_NVIDIA = re.compile(r"/dev/nvidia([0-9]{1,3})")
_ROOT = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}")
_MINOR = re.compile(r"^Device Minor:\s*([0-9]+)\s*$", re.M)

# a /dev node's (kind, major, minor); LookupError saying why when it has none
DevOf = Callable[[Path], tuple[str, int, int]]


def _small(path: Path, limit: int = 64) -> str | None:
    """The first ``limit`` bytes of a file as text, None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace").strip("\0 \n\t")
    except OSError:
        return None


class Resolver:
    """Resolves device names against one sysfs (and procfs, devfs) tree; ``dev_of`` reads a
    /dev node's number (stat(2) by default; tests give fixtures' numbers)."""

    def __init__(self, sysfs_root: str | Path = "/sys", procfs_root: str | Path = "/proc",
                 devfs_root: str | Path = "/dev", dev_of: DevOf | None = None) -> None:
        self.sys = Path(sysfs_root)
        self.proc = Path(procfs_root)
        self.dev = Path(devfs_root)
        self.dev_of = dev_of or self._stat
        self._top: Path | None = None  # /sys/devices, its links resolved

    @property
    def top(self) -> Path:
        if self._top is None:
            self._top = Path(os.path.realpath(self.sys / "devices"))
        return self._top

    # ---- what can be resolved here (the Manager's Capabilities) ----

    def kinds(self) -> tuple[str, ...]:
        where = {"pci": self.sys / "bus/pci/devices", "char": self.sys / "dev/char",
                 "block": self.sys / "dev/block", "nvidia": self.proc / "driver/nvidia/gpus",
                 **{cls: self.sys / "class" / cls for cls in near.CLASSES if cls != "block"}}
        return tuple(k for k in near.KINDS if where[k].is_dir())

    def inventory(self) -> tuple[Device, ...]:
        """The devices here that option near can name, each once, with its node: network
        interfaces, InfiniBand devices, DRM cards and NVMe controllers of PCI devices (not
        virtual ones), and NVIDIA's GPUs (as /dev/nvidiaN). At most MAX_CLASSES of a class."""
        out: list[Device] = []
        for cls in ("net", "infiniband", "drm", "nvme"):
            try:
                names = sorted(os.listdir(self.sys / "class" / cls))[:MAX_CLASSES]
            except OSError:
                continue
            for name in names:
                if cls == "drm" and not re.fullmatch(r"card[0-9]+", name):
                    continue  # connectors and render nodes: the card stands for them
                try:
                    near.form(name)
                    found = self._walk(name, cls, self.sys / "class" / cls / name)
                except InvalidArgument:
                    continue
                if found.address:
                    out.append(found)
        for minor, address in self._nvidia_gpus():
            found = self._walk(f"/dev/nvidia{minor}", "nvidia",
                               self.sys / "bus/pci/devices" / address)
            out.append(found)
        return tuple(out)

    def roots(self, devices: tuple[Device, ...]) -> dict[str, str]:
        """PCI address -> its PCIe root complex (``pci0000:3a``: the directory under
        /sys/devices its path starts with, as DRA's ``pcieRoot`` names it), for ``devices``
        whose path has one."""
        out: dict[str, str] = {}
        for d in devices:
            if not d.address or d.address in out:
                continue
            real = Path(os.path.realpath(self.sys / "bus/pci/devices" / d.address))
            if real.is_relative_to(self.top) and real != self.top:
                root = real.relative_to(self.top).parts[0]
                if _ROOT.fullmatch(root):
                    out[d.address] = root
        return out

    # ---- resolving ----

    def resolve_all(self, devices: tuple[Device, ...]) -> tuple[Device, ...]:
        """Each device resolved (those resolved already kept as they are)."""
        return tuple(d if d.resolved else self.resolve(d.name) for d in devices)

    def resolve_option(self, value: object) -> object:
        """A caller's option ``near`` (caller_names) with every device resolved, as the
        allocation records it (NAME@NODE@KIND@ADDRESS, cpuservice.model.near)."""
        value = caller_names(value)
        if not isinstance(value, str):
            return value
        return near.encode(self.resolve_all(near.parse(value)))

    def resolve(self, name: str) -> Device:
        """The device ``name`` names, with its node; InvalidArgument naming the device and
        what was looked up when there is none."""
        form = near.form(name)
        if form == "pci":
            address = near.pci_address(name)
            assert address is not None
            path = self.sys / "bus/pci/devices" / address
            if not os.path.lexists(path):
                raise self._unknown(name, f"no {path}")
            return self._walk(name, "pci", path)
        if form == "dev":
            return self._dev(name)
        for cls in near.CLASSES:
            path = self.sys / "class" / cls / name
            if os.path.lexists(path):
                return self._walk(name, cls, path)
        classes = ",".join(near.CLASSES)
        raise self._unknown(name, f"no {self.sys}/class/{{{classes}}}/{name}")

    def present(self, device: Device) -> bool:
        """Whether ``device`` is still there (at the address it was found)."""
        try:
            found = self.resolve(device.name)
        except InvalidArgument:
            return False
        return not device.address or found.address == device.address

    def _dev(self, name: str) -> Device:
        path = self.dev.joinpath(*name.split("/")[2:])
        gpu = _NVIDIA.fullmatch(name)
        if gpu is not None:
            address = self._nvidia_address(int(gpu[1]))
            if address is not None:
                return self._walk(name, "nvidia", self.sys / "bus/pci/devices" / address)
        try:
            kind, major, minor = self.dev_of(path)
        except LookupError as exc:
            if not os.path.lexists(path):  # a private /dev (the unit's PrivateDevices=yes)
                found = self._by_devname(name)
                if found is not None:
                    return found
            why = f"; no GPU in {self.proc}/driver/nvidia/gpus has Device Minor {gpu[1]}" \
                if gpu is not None else ""
            raise self._unknown(name, f"{exc}{why}") from None
        link = self.sys / "dev" / kind / f"{major}:{minor}"
        if not os.path.lexists(link):
            raise self._unknown(name, f"{kind} device {major}:{minor}, no {link}")
        return self._walk(name, kind, link)

    def _by_devname(self, name: str) -> Device | None:
        """The device whose node the kernel names ``name`` (DEVNAME in its uevent), found as
        /sys/class/<class>/<last part of the name>: for a daemon whose /dev holds only the
        pseudo devices (the unit's PrivateDevices=yes). udev's links (/dev/disk/by-id/...)
        are not found this way."""
        devname = name[len("/dev/"):]
        base = devname.rsplit("/", 1)[-1]
        try:
            classes = sorted(os.listdir(self.sys / "class"))[:MAX_CLASSES]
        except OSError:
            return None
        for cls in classes:
            path = self.sys / "class" / cls / base
            if not os.path.lexists(path):
                continue
            uevent = _small(path / "uevent", 4096) or ""
            if f"DEVNAME={devname}" in uevent.splitlines():
                return self._walk(name, "block" if cls == "block" else "char", path)
        return None

    def _stat(self, path: Path) -> tuple[str, int, int]:
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(os.path.realpath(self.dev)):
            raise LookupError(f"{path} leads outside {self.dev}")
        try:
            st = os.stat(real)
        except OSError as exc:
            raise LookupError(f"{path}: {exc.strerror}") from None
        if stat.S_ISCHR(st.st_mode):
            return "char", os.major(st.st_rdev), os.minor(st.st_rdev)
        if stat.S_ISBLK(st.st_mode):
            return "block", os.major(st.st_rdev), os.minor(st.st_rdev)
        raise LookupError(f"{path} is no char or block device")

    def _nvidia_address(self, minor: int) -> str | None:
        """The PCI address of the NVIDIA GPU of ``/dev/nvidia<minor>`` (its "Device Minor" in
        /proc/driver/nvidia/gpus/<address>/information), None when no GPU has it."""
        return next((a for m, a in self._nvidia_gpus() if m == minor), None)

    def _nvidia_gpus(self) -> Iterator[tuple[int, str]]:
        """(Device Minor, PCI address) of each NVIDIA GPU in procfs."""
        gpus = self.proc / "driver/nvidia/gpus"
        try:
            entries = sorted(os.listdir(gpus))[:MAX_GPUS]
        except OSError:
            return
        for entry in entries:
            address = near.pci_address(entry)
            text = _small(gpus / entry / "information", 4096) if address else None
            m = _MINOR.search(text or "")
            if m and address:
                yield int(m[1]), address

    def _walk(self, name: str, kind: str, path: Path) -> Device:
        """Up the real path of ``path`` to the first ``numa_node`` (a device with none up to
        /sys/devices has no locality); its PCI address is the nearest one on the way."""
        top = self.top
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(top) or real == top:
            raise self._unknown(name, f"{path} leads to {real}, outside {self.sys}/devices")
        node, here = near.NO_NODE, real
        for _ in range(MAX_DEPTH):
            if here == top:
                break
            text = _small(here / "numa_node")
            if text is not None:
                node = int(text) if re.fullmatch(r"-1|[0-9]{1,4}", text) else near.NO_NODE
                node = node if node <= near.MAX_NODE else near.NO_NODE
                break
            here = here.parent
        address = next((a for p in (real, *real.parents) if p != top and p.is_relative_to(top)
                        and (a := near.pci_address(p.name))), "")
        return Device(name, node, kind, address)

    def _unknown(self, name: str, looked: str) -> InvalidArgument:
        return InvalidArgument(f"option 'near': no device {name!r} here ({looked})")


def caller_names(value: object) -> str | object:
    """A caller's option ``near`` as one comma-separated text: a string as it is, a list of
    strings (D-Bus ``as``) joined; anything else unchanged (the option's validation names the
    wrong type). InvalidArgument for a name with a comma in a list, or an item the service
    records (NAME@NODE...), which no caller may give."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        if not value or any("," in v for v in value):
            raise InvalidArgument("option 'near': a list of device names, none empty or with ','")
        value = ",".join(value)
    if isinstance(value, str) and "@" in value:
        raise InvalidArgument(f"option 'near': {value[:60]!r}: device names have no '@'")
    return value
