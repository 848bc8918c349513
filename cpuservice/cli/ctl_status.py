"""``cpuservicectl status [NAME]``: the pools at a glance, or one allocation with its CPUs,
NUMA nodes, owner and the state of its unit as systemd reports it (org.freedesktop.systemd1's
own properties: ActiveState, TasksCurrent, CPUUsageNSec, ...), plus how it fares as the kernel
counts it in its cgroup (the Manager's GetStatistics: pressure, throttling, remote memory)."""

from __future__ import annotations

import argparse
from typing import Any

from cpuservice.cli import ctl_figures
from cpuservice.cli.client import NO_QUOTA, Client
from cpuservice.cli.ctl_output import JsonMode, cpu_time, dumps, percent, shares, user_name
from cpuservice.host import dbuscall
from cpuservice.model.cpuset import CPUSet

SYSTEMD = ("org.freedesktop.systemd1", "/org/freedesktop/systemd1",
           "org.freedesktop.systemd1.Manager")
UNIT_TYPES = {"slice": "Slice", "scope": "Scope", "service": "Service", "socket": "Socket",
              "mount": "Mount", "swap": "Swap"}
UNIT_PROPS = ("LoadState", "ActiveState", "SubState", "ActiveEnterTimestamp")
CGROUP_PROPS = ("ControlGroup", "TasksCurrent", "CPUUsageNSec", "MemoryCurrent")


async def pools_status(c: Client, args: argparse.Namespace) -> int:
    props = await c.properties()
    allocations = await c.allocations()
    degraded = [a["Name"] for a in allocations if a["State"] != "active"]
    host = await ctl_figures.host_pressure(c)  # None: a daemon from before issue 39's host side
    if args.json_mode is not JsonMode.OFF:
        props.pop("Topology", None)
        print(dumps(props | {"Allocations": len(allocations), "Degraded": degraded}
                    | ({"HostPressure": host} if host is not None else {}), args.json_mode))
        return 0
    bound = sum(a["Bound"] for a in allocations)
    online = CPUSet.parse(props["OnlineCPUs"])
    print(f"cpuservice {props['Version']}: {len(online)} CPUs online")
    for key in ("OnlineCPUs", "ReservedCPUs", "IsolatedCPUs", "SharedCPUs", "ExclusiveCPUs",
                "FragmentCPUs", "LentCPUs"):
        if key not in props:  # LentCPUs: a daemon from before issue 26
            continue
        count = len(CPUSet.parse(props[key]))
        cpus = props[key] or "-"
        print(f"  {key[:-4] + ':':<11}{cpus}{f' ({count})' if count else ''}")
    print(f"  Allocations: {len(allocations)} ({bound} bound, {len(allocations) - bound} "
          f"unbound); degraded: {', '.join(degraded) or 'none'}")
    irq = props.get("IRQIsolation") or {}
    if irq.get("enabled"):
        unmovable = ", ".join(map(str, irq["unmovable"])) or "none"
        pending = irq.get("pending") or []
        print(f"  IRQs:      {len(irq['confined'])} on {irq['cpus'] or '-'}; unmovable: "
              f"{unmovable}{'; moved at next arrival: ' if pending else ''}"
              f"{', '.join(map(str, pending))}{'; irqbalance told' if irq['irqbalance'] else ''}")
    caps = props.get("Capabilities") or {}
    if caps:
        kinds = [k for k in caps.get("Partitions", []) if k != "none"]
        print(f"  Partitions: {', '.join(kinds) or 'no'}"
              f"{'' if kinds else ' (' + str(caps.get('PartitionsUnavailable', '')) + ')'}")
        if "NearKinds" in caps:
            print(f"  Near:      {', '.join(caps['NearKinds']) or 'no device can be looked up'}")
        if caps.get("Lending") is False:  # a daemon from before issue 37 does not say
            print(f"  Lending:   no ({caps.get('LendingUnavailable', '')})")
    for label, value in ctl_figures.host_lines(host) if host is not None else ():
        print(f"  {label + ':':<11}{value}")
    return 0


async def unit_state(c: Client, unit: str) -> dict[str, Any]:
    """What systemd reports of ``unit`` (empty when systemd does not know it or cannot be
    asked)."""
    try:
        (path,) = await c.call("GetUnit", "s", [unit], path=SYSTEMD[1], interface=SYSTEMD[2],
                               destination=SYSTEMD[0])
        values = await c.properties(path, "org.freedesktop.systemd1.Unit", SYSTEMD[0])
        kind = UNIT_TYPES.get(unit.rsplit(".", 1)[-1])
        cgroup = await c.properties(path, f"org.freedesktop.systemd1.{kind}", SYSTEMD[0]) \
            if kind else {}
    except dbuscall.CallError as exc:
        return {"LoadState": "not-loaded" if exc.name.endswith("NoSuchUnit") else "unknown"}
    out = {k: values[k] for k in UNIT_PROPS if k in values}
    out |= {k: cgroup[k] for k in CGROUP_PROPS if k in cgroup}
    return out


async def allocation_status(c: Client, args: argparse.Namespace) -> int:
    a = await c.allocation(args.name)
    unit = await unit_state(c, a["Unit"])
    figures = (await ctl_figures.statistics(c, [args.name])).get(args.name)
    if args.json_mode is not JsonMode.OFF:
        print(dumps(a | {"UnitState": unit, "Statistics": figures}, args.json_mode))
        return 0
    active = unit.get("ActiveState", "unknown")
    state = f"{active} ({unit['SubState']})" if unit.get("SubState") else \
        unit.get("LoadState", "unknown")
    lines = [
        f"{a['Name']} - {a['CPUs']} CPU(s), {'bound' if a['Bound'] else 'unbound'}, "
        f"{a['State']}",
        ("Owner", f"{user_name(a['Owner'])} ({a['Owner']})"),
        ("CPUs", f"{a['CPUSet'] or '-'}" + (f" (shares {shares(a['Shares'])})"
                                           if a["Shares"] else "")),
        ("NUMA nodes", a["MemoryNodes"] or "-"),
        ("Health", a.get("Health", "ok") + (f": {a['HealthReason']}" if a.get("HealthReason")
                                            else "")),
        ("Aligned", "yes" if a.get("Aligned") else f"no ({a.get('AlignmentReason', '')})"),
        ("Quota", f"{percent(a['CPUQuotaPerSecUSec'])}, weight {a['CPUWeight']}"),
        ("Lifetime", a["Lifetime"]),
        ("Unit", f"{a['Unit']}: {state}"),
    ]
    if a.get("NearDevices"):  # option near (issue 38): the devices as resolved, and where
        near = "; ".join(f"{d[0]}{' (' + ' '.join(filter(None, d[2:4])) + ')' if d[2] else ''}"
                         f": {d[4]}" for d in a["NearDevices"])
        lines.insert(4, ("Near", f"{near} [{a.get('NearPolicy', '')}]"))
    if a.get("Lending"):
        lines.insert(4, ("Lending", f"lends {a['LentCPUs']} to borrowers now"
                         if a.get("LentCPUs") else "on, nothing lent now (busy, or not idle long "
                         "enough)"))
    elif str(a["Unit"]).startswith("cpuservice-borrow-"):
        lines.insert(4, ("Borrows", "runs on the shared pool and the cores lent now, at idle "
                         "priority"))
    tasks = unit.get("TasksCurrent")
    if tasks is not None and tasks != NO_QUOTA:
        lines.append(("Tasks", str(tasks)))
    usage = unit.get("CPUUsageNSec")
    if usage is not None and usage != NO_QUOTA and "cpu-usage-usec" not in (figures or {}):
        lines.append(("CPU", cpu_time(int(usage) // 1000)))
    if figures is not None:
        lines += ctl_figures.status_lines(figures, a["MemoryNodes"])
    memory = unit.get("MemoryCurrent")
    if memory is not None and memory != NO_QUOTA:
        lines.append(("Memory", f"{int(memory) / 2**20:.1f}M"))
    print(lines[0])
    for label, value in lines[1:]:
        print(f"{label:>13}: {value}")
    return 0
