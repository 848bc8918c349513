"""The unit an allocation applies to: its own slice, or an existing (foreign) unit, checked and
read before it is taken over."""

from __future__ import annotations

from collections.abc import Mapping

from cpuservice.apply import units
from cpuservice.apply.targets import slice_of
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.props import Props
from cpuservice.model.request import Request
from cpuservice.model.state import Record
from cpuservice.shell.ports import UNIT_IFACE, SystemdAPI, cgroup_iface


async def target_unit(systemd: SystemdAPI, name: str, request: Request,
                      records: Mapping[str, Record]) -> tuple[str, Props, tuple[str, ...]]:
    """The unit allocation ``name`` applies to; for a foreign unit also its current values and
    the properties it has no runtime override for (see Record.fresh). ``records``: the
    allocations there are (no two carry one unit)."""
    unit = request.options.unit
    if unit is None:
        return slice_of(name, request), {}, ()
    for other, rec in records.items():
        if rec.unit == unit:
            raise InvalidArgument(f"unit {unit!r} already carries allocation {other!r}")
    if unit.startswith("cpuservice"):
        raise InvalidArgument(f"unit {unit!r} belongs to cpuservice itself")
    if unit in units.CONFINED:
        raise InvalidArgument(f"unit {unit!r} holds the shared pool (confine_host) and "
                              "cannot carry an allocation")
    current = await systemd.get(unit, cgroup_iface(unit), units.CPU_PROPERTIES)
    if not current:
        raise InvalidArgument(f"unit {unit!r} is not loaded")
    info = await systemd.get(unit, UNIT_IFACE, ["DropInPaths", "LoadState"])
    if info.get("LoadState", "loaded") != "loaded":
        raise InvalidArgument(f"unit {unit!r} is {info['LoadState']}")
    fresh = units.fresh_props(unit, info.get("DropInPaths", []))
    return unit, units.saved_props(current, units.CPU_PROPERTIES), fresh
