"""Kernel cpuset partitions through systemd's ``CPUSetPartition=`` (systemd >= 261).

A bound allocation that asks for ``partition`` = ``root`` or ``isolated`` gets a slice of its own
directly below the root cgroup (``cpuservice_partition_<name>.slice``): the root cgroup is always
a partition root, so a child partition needs nothing from its ancestors (systemd sets no
``cpuset.cpus.exclusive``, which a deeper, "remote" partition would need on every ancestor). The
kernel then takes the slice's CPUs away from every other cgroup; ``isolated`` also takes them out
of scheduler load balancing and unbound workqueues.

What the kernel made of it is read back from ``cpuset.cpus.partition`` (reading a cgroup file is
observation; every change goes through systemd): ``root``, ``isolated``, ``member``, or ``root
invalid (<reason>)``. An invalid partition is a degraded allocation.

The pure part (capabilities, request rules, parsing the kernel's report) is here; the two thin
readers of cgroupfs are at the end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpuservice.model.errors import InvalidArgument, NotSupported
from cpuservice.model.near import NO_NODE, Device
from cpuservice.model.request import Partition

NONE = Partition.NONE
KINDS = (Partition.ROOT, Partition.ISOLATED)
MEMBER = "member"  # no partition: a partition slice that holds no CPU; or for a moment, to
# make the kernel check a partition anew
PROPERTY = "CPUSetPartition"
CGROUP_ROOT = Path("/sys/fs/cgroup")
_STATE = re.compile(r"(member|root|isolated)( invalid(?: \((.*)\))?)?")


@dataclass(frozen=True)
class Capabilities:
    """What this host can do about partitions, and whether it can lend (option lend; see
    cpuservice.host.cgroup.detect_lending), as detected at startup."""

    systemd_version: str = ""
    systemd_property: bool = False  # systemd knows CPUSetPartition= (>= 261)
    kernel: bool = False  # cgroup v2 with the cpuset controller and isolated partitions
    kernel_reason: str = ""
    near: tuple[str, ...] = ()  # what option near can look up here (cpuservice.model.near.KINDS)
    devices: tuple[Device, ...] = ()  # the devices option near can name here, as at startup
    lending: bool = False  # cgroup v2 with the cpu controller, /proc/PID/schedstat
    lending_reason: str = "not detected yet"
    guard: bool = False  # the admission guard is armed (cpuservice.shell.host_pressure)
    guard_reason: str = "not detected yet"

    @property
    def partitions(self) -> bool:
        return self.systemd_property and self.kernel

    def why_not(self) -> str:
        """Why partitions are not available (empty when they are)."""
        missing = []
        if not self.systemd_property:
            missing.append(f"systemd {self.systemd_version or '(unknown version)'} has no "
                           f"{PROPERTY}= (systemd 261 or newer has it)")
        if not self.kernel:
            missing.append(self.kernel_reason or "the kernel has no cpuset partitions")
        return "; ".join(missing)

    def as_dbus(self) -> dict[str, tuple[str, Any]]:
        """The Manager's Capabilities property: name -> (signature, value)."""
        return {
            "Partitions": ("as", [str(p) for p in ((NONE, *KINDS) if self.partitions
                                                      else (NONE,))]),
            "SystemdVersion": ("s", self.systemd_version),
            "SystemdCPUSetPartition": ("b", self.systemd_property),
            "KernelPartitions": ("b", self.kernel),
            "PartitionsUnavailable": ("s", self.why_not()),
            "NearKinds": ("as", list(self.near)),
            "NearDevices": ("a(siss)", [[d.name, NO_NODE if d.node is None else d.node,
                                         d.kind, d.address] for d in self.devices]),
            "Lending": ("b", self.lending),
            "LendingUnavailable": ("s", "" if self.lending else self.lending_reason),
            "PressureGuard": ("b", self.guard),
            "PressureGuardUnavailable": ("s", "" if self.guard else self.guard_reason),
        }


def check(mode: str, explicit: bool, bind: bool, whole: bool, unit: str | None,
          caps: Capabilities) -> str:
    """The partition an allocation gets: ``mode`` when the request can have it. An explicit
    request that cannot is a named error; a configured default that cannot apply (an unbound or
    fractional allocation, a foreign unit, a host without partitions) is ``none``."""
    if mode == NONE:
        return NONE
    problem = ""
    if not caps.partitions:
        problem = f"this host cannot make cpuset partitions: {caps.why_not()}"
        if explicit:
            raise NotSupported(f"option 'partition' {mode!r}: {problem}")
        return NONE
    if not bind:
        problem = "a partition needs 'bind': true"
    elif not whole:
        problem = ("a partition needs a whole number of CPUs (a fraction shares a fragment "
                   "CPU, which no partition can own)")
    elif unit is not None:
        problem = "a partition needs the allocation's own slice, not option 'unit'"
    if problem:
        if explicit:
            raise InvalidArgument(f"option 'partition' {mode!r}: {problem}")
        return NONE
    return mode


def mode(wanted: str, cpus: frozenset[int] | set[int], boot_isolated: frozenset[int] | set[int]
         ) -> str:
    """The partition a slice is made: what was asked, except that ``root`` on CPUs the kernel
    isolated at boot (isolcpus=) is ``isolated``: Linux refuses a load-balanced partition there
    ("partition config conflicts with housekeeping setup"), and those CPUs are not load-balanced
    anyway."""
    if wanted == Partition.ROOT and set(cpus) & set(boot_isolated):
        return str(Partition.ISOLATED)
    return str(wanted)


@dataclass(frozen=True)
class State:
    """What the kernel reports for one partition slice."""

    mode: str  # member, root or isolated
    reason: str = ""  # the kernel's reason when the partition is invalid
    valid: bool = True

    def __str__(self) -> str:
        return self.mode if self.valid else f"{self.mode} invalid ({self.reason})"


def parse_state(text: str) -> State | None:
    """``cpuset.cpus.partition`` as the kernel writes it; None when it is not such a value."""
    m = _STATE.fullmatch(text.strip())
    if not m:
        return None
    if m.group(2) is None:
        return State(m.group(1))
    return State(m.group(1), m.group(3) or "no reason given", False)


# what the engine records when the kernel's report cannot be read (no cgroup, no cpuset on it)
UNREADABLE = State(MEMBER, "cpuset.cpus.partition cannot be read", False)


def degraded(wanted: str, state: State | None) -> str:
    """Why an allocation that wants partition ``wanted`` is degraded by what the kernel reports
    (empty when it is not; ``None``: not looked at)."""
    if wanted == NONE or state is None:
        return ""
    if not state.valid:
        return f"partition invalid: {state.reason}"
    if state.mode != wanted:
        return f"partition is {state.mode}, not {wanted}"
    return ""


def views(wanted: str, state: State | None) -> Mapping[str, Any]:
    """The Allocation properties about its partition."""
    return {"Partition": wanted,
            "PartitionState": "" if wanted == NONE or state is None else str(state)}


# ---- thin readers of cgroupfs (observation only: never written) ----


def detect_kernel(root: Path = CGROUP_ROOT) -> tuple[bool, str]:
    """Whether the kernel can make isolated partitions under ``root``, and why not."""
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError:
        return False, f"no cgroup v2 hierarchy at {root}"
    if "cpuset" not in controllers:
        return False, f"the cpuset controller is not available at {root}"
    if not (root / "cpuset.cpus.isolated").exists():
        return False, "the kernel has no isolated cpuset partitions (Linux 6.7 or newer has)"
    return True, ""


def read_state(control_group: str, root: Path = CGROUP_ROOT) -> State | None:
    """The partition state of a unit's cgroup (its ControlGroup property); None when the file
    cannot be read (no cgroup yet, no cpuset controller on it)."""
    if not control_group.startswith("/") or ".." in control_group.split("/"):
        return None
    try:
        text = (root / control_group.lstrip("/") / "cpuset.cpus.partition").read_text()
    except OSError:
        return None
    return parse_state(text)
