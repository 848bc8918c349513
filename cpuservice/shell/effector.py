"""The reconcile transaction's effector (cpuservice.apply.reconcile.Effector) as the engine
runs it: systemd for units, the kernel for the pseudo-units of interrupts and workqueues."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cpuservice.host.irqs import is_kernel
from cpuservice.model import device_irqs
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.props import Props
from cpuservice.shell.ports import KernelAPI, SystemdAPI


class Effector:
    """The reconcile transaction's effector: systemd for units, the kernel for the pseudo-units
    of interrupts and workqueues (they only ever get AllowedCPUs)."""

    def __init__(self, systemd: SystemdAPI, kernel: KernelAPI | None) -> None:
        self.systemd, self.kernel = systemd, kernel

    async def start_transient(self, unit: str, props: Props) -> None:
        await self.systemd.start_transient(unit, props)

    async def set_properties(self, unit: str, props: Props, missing_ok: bool = False) -> None:
        if is_kernel(unit):
            if self.kernel is None:
                return
            if device_irqs.RELEASE in props:  # no allocation keeps the device any more
                await self.kernel.release(unit)
            elif "AllowedCPUs" in props:
                await self.kernel.set_cpus(unit, CPUSet.from_mask(bytes(props["AllowedCPUs"][1])))
            return
        await self.systemd.set_properties(unit, props, missing_ok)

    def batched(self, unit: str) -> bool:
        return is_kernel(unit)

    async def set_many(self, writes: Mapping[str, Props]) -> None:
        """The kernel holders (interrupts, workqueues, devices' interrupts) in one write."""
        wants = {u: CPUSet.from_mask(bytes(p["AllowedCPUs"][1]))
                 for u, p in writes.items() if "AllowedCPUs" in p}
        if self.kernel is not None and wants:
            await self.kernel.set_many(wants)

    async def stop(self, unit: str) -> None:
        await self.systemd.stop(unit)

    async def remove_overrides(self, unit: str, names: Sequence[str]) -> None:
        await self.systemd.remove_overrides(unit, names)
