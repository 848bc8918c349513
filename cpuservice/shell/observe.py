"""What systemd and the kernel hold now, as unit specs (the engine's sync starts from it):
our slices, found by name and Description, and the other units a state names."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from cpuservice.apply import targets, units
from cpuservice.apply.reconcile import UnitSpec
from cpuservice.host.irqs import is_kernel
from cpuservice.shell.ports import UNIT_IFACE, KernelAPI, SystemdAPI, cgroup_iface

log = logging.getLogger(__name__)
OWN_PATTERNS = ("cpuservice-bound-*.slice", "cpuservice-shared-*.slice",
                "cpuservice-borrow-*.slice", f"{units.PARTITION_PREFIX}*.slice")


async def held_now(systemd: SystemdAPI, kernel: KernelAPI | None,
                   after: Mapping[str, UnitSpec]) -> tuple[dict[str, UnitSpec], list[str]]:
    """The units systemd holds now: our per-allocation slices (and, apart, the dead ones:
    to stop, so that they can be started again) and the other units ``after`` names. A
    slice is ours only when it is one ``after`` names or its Description records the
    allocation its name says: a slice somebody else made with a similar name is left
    alone."""
    before: dict[str, UnitSpec] = {}
    dead: list[str] = []
    for unit, active in await systemd.list_units((*OWN_PATTERNS, units.BORROW)):
        if unit == units.BORROW:  # a transient slice of ours while a borrower exists
            if active in ("active", "activating"):
                have = await systemd.get(unit, cgroup_iface(unit), units.OWN_PROPERTIES)
                have.update(await systemd.get(unit, UNIT_IFACE, ["Description"]))
                before[unit] = UnitSpec(units.observed_props(have), own=True)
            continue
        if units.name_of_slice(unit) is None:
            continue
        have = await systemd.get(unit, cgroup_iface(unit), units.OWN_PROPERTIES)
        have.update(await systemd.get(unit, UNIT_IFACE, ["Description"]))
        if unit not in after and not units.made_by_us(unit, have.get("Description", "")):
            log.warning("leaving %s alone: cpuservice did not make it", unit)
            continue
        if active not in ("active", "activating"):
            dead.append(unit)
            continue
        before[unit] = UnitSpec(units.observed_props(have), own=True)
    kept = kernel.devices() if kernel is not None else []
    for unit in kept:  # a device no allocation keeps any more: it is released
        if unit not in after and (cpus := await kernel.get_cpus(unit)):  # type: ignore[union-attr]
            before[unit] = UnitSpec(units.shared_props(cpus), own=False,
                                    restore=targets.RELEASE_PROPS)
    for unit, spec in after.items():
        if is_kernel(unit):
            cpus = await kernel.get_cpus(unit) if kernel is not None else None
            if cpus:
                before[unit] = UnitSpec(units.shared_props(cpus), own=False,
                                        restore=spec.restore)
            continue
        if spec.own:
            continue
        have = await systemd.get(unit, cgroup_iface(unit), units.CPU_PROPERTIES)
        if have:
            before[unit] = UnitSpec(units.observed_props(have), own=False,
                                    restore=spec.restore, forget=spec.forget)
    return before, dead

