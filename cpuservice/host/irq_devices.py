"""The kernel's side of option near-irqs (cpuservice.model.device_irqs): which devices a write
of the kernel oneshot sets, the oneshot's arguments for them, and what it did, kept beside the
other reports (devices-report.json: the devices whose interrupts are kept, with their CPUs,
read again after a restart). The writing itself is the oneshot's shell
(cpuservice.host.irqs_shell), run by cpuservice.host.irqs.Kernel."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpuservice.model import device_irqs
from cpuservice.model.cpuset import CPUSet

log = logging.getLogger(__name__)
Wants = dict[str, CPUSet | None]  # PCI address -> CPUs (None: released, it follows the pool)


@dataclass
class DeviceReport:
    """What the last write did to one PCI function's interrupts (its ``msi_irqs`` and legacy
    ``irq``): the same lists as cpuservice.host.irqs.Report's."""

    cpus: CPUSet = field(default_factory=CPUSet)
    confined: list[int] = field(default_factory=list)
    unmovable: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)


def wants(want: Mapping[str, CPUSet], todo: Mapping[str, CPUSet], released: set[str],
          pool_holder: str) -> Wants | None:
    """The devices a write sets, or None when it sets none. Writing the pool's interrupts
    (``pool_holder`` in ``todo``) writes every IRQ, the devices' too: then every kept device
    is written again after it, in the same write. A device's CPUs stay within the pool's wanted
    CPUs (what a rollback writes back cannot lead them out of it)."""
    devices = {h: c for h, c in want.items() if device_irqs.address_of(h)}
    if not (pool_holder in todo or released or devices.keys() & todo.keys()):
        return None
    pool = want.get(pool_holder)
    out: Wants = {}
    for holder, cpus in sorted(devices.items()):
        if pool is not None and cpus & pool:
            cpus &= pool
        out[str(device_irqs.address_of(holder))] = cpus
    for holder in sorted(released - devices.keys()):
        out[str(device_irqs.address_of(holder))] = None
    return out or None


def args(report: Path, pool: CPUSet | None, devices: Wants | None) -> list[str]:
    """The oneshot's arguments for the devices: its report, the CPUs a released device's
    interrupts go back to ("-": every online CPU), then address and CPUs (or "release")."""
    if devices is None:
        return ["-", "-"]
    out = [f"{report}.run", pool.format() if pool else "-"]
    for address, cpus in devices.items():
        out += [address, "release" if cpus is None else cpus.format()]
    return out


def held(report: Path) -> dict[str, str]:
    """The devices whose interrupts the last writes keep: address -> CPU list."""
    try:
        found = json.loads(report.read_text())
        return {str(a): str(c) for a, c in found.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def written(report: Path, devices: Wants, reports: Mapping[str, DeviceReport],
            pending: Any) -> dict[str, DeviceReport]:
    """The devices' reports after the oneshot wrote ``devices`` (``pending``:
    cpuservice.host.irqs.pending_moves); the devices still kept are recorded in ``report``."""
    try:
        done = json.loads(Path(f"{report}.run").read_text())
    except (OSError, ValueError):
        done = {}
    out = dict(reports)
    for address, cpus in devices.items():
        if cpus is None:
            out.pop(address, None)
            continue
        entry: Any = done.get(address) if isinstance(done, dict) else None
        try:
            out[address] = DeviceReport(cpus, sorted(entry["confined"]),
                                        sorted(entry["unmovable"]),
                                        pending(entry.get("effective", {}), cpus))
        except (KeyError, TypeError, AttributeError):
            out[address] = DeviceReport(cpus)
        log.info("IRQs of %s on %s: confined %s, unmovable %s, moved at their next arrival %s",
                 address, cpus.format(), out[address].confined or "none",
                 out[address].unmovable or "none", out[address].pending or "none")
    tmp = report.with_name(report.name + ".tmp")
    try:
        tmp.write_text(json.dumps({a: r.cpus.format() for a, r in sorted(out.items())}))
        os.replace(tmp, report)
    except OSError as exc:
        log.warning("cannot record the devices whose interrupts are kept: %s", exc)
    return out
