"""The Manager's IRQIsolation property: what the kernel holder last did with the interrupts (the
shared pool's, and each device's an allocation keeps them off, option near-irqs)."""

from __future__ import annotations

from typing import Any

from dbus_fast import Variant

from cpuservice.apply import views
from cpuservice.shell.engine import Snapshot


def irq_isolation(snap: Snapshot, enabled: bool) -> dict[str, Any]:
    report = snap.irqs
    on = bool(report and enabled)
    return {
        "enabled": Variant("b", enabled),
        "cpus": Variant("s", report.cpus.format() if report and on else ""),
        "confined": Variant("au", list(report.confined) if report and on else []),
        "unmovable": Variant("au", list(report.unmovable) if report and on else []),
        "pending": Variant("au", list(report.pending) if report and on else []),
        "irqbalance": Variant("b", bool(report and on and report.irqbalance)),
        "devices": Variant("aa{sv}", [
            {k: Variant(sig, v) for k, (sig, v) in device.items()}
            for device in views.device_irqs(snap.topology, snap.state,
                                            report.devices if report else None)]),
    }
