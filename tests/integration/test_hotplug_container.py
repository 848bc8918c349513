"""Hotplug repair through the daemon's real uevent path, in the container host.

The daemon reads a fixture topology; a test changes the fixture, then writes to a real CPU's
``uevent`` file on the host (a synthetic uevent: nothing goes offline), which reaches the daemon's
kernel-source monitor. The VM lab repeats this with CPUs really going offline.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixtures import MACHINES, write_sysfs
from tests.integration import client
from tests.integration.service_env import ServiceHost, eventually
from tests.integration.test_service import allocations, bound_slice

UEVENT = Path("/sys/devices/system/cpu/cpu0/uevent")


def _set_offline(daemon: ServiceHost, offline: set[int], kick: int = 1) -> None:
    root = daemon.c.root / daemon.fixture("b").lstrip("/")
    write_sysfs(root, dataclasses.replace(MACHINES["b"], offline=frozenset(offline)))
    for _ in range(kick):
        UEVENT.write_text("offline" if offline else "online")



def test_offline_cpu_is_replaced_and_announced(daemon: ServiceHost) -> None:
    daemon.configure("b")
    daemon.allocate("h", "2", bind=True)
    held = CPUSet.parse(allocations(daemon)["h"][3])
    lost = held.first()

    async def watch() -> list:
        bus = await client.connect(daemon.c.bus_address)
        signals = await client.Signals(bus).start()
        await asyncio.get_running_loop().run_in_executor(None, _set_offline, daemon, {lost}, 10)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if any(m == "PoolsChanged" for m, _, _ in signals.seen):
                break
        seen = await signals.settle(0.5)
        bus.disconnect()
        return seen

    try:
        seen = asyncio.run(watch())
        now = CPUSet.parse(allocations(daemon)["h"][3])
        assert lost not in now and len(now) == 2
        assert daemon.show(bound_slice("h"), "AllowedCPUs")["AllowedCPUs"] == now.format()
        shared = CPUSet.parse(daemon.show("cpuservice-shared.slice", "AllowedCPUs")["AllowedCPUs"])
        assert lost not in shared and shared.isdisjoint(now)
        changed = [b for m, _, b in seen if m == "AllocationChanged"]
        assert changed and changed[0][0] == "h" and f"lost {lost}" in changed[0][2]
        assert len([m for m, _, _ in seen if m == "PoolsChanged"]) == 1  # one per settled burst
    finally:
        _set_offline(daemon, set())
    eventually(lambda: lost in CPUSet.parse(daemon.prop("SharedCPUs")))
    assert CPUSet.parse(allocations(daemon)["h"][3]) == now  # no churn when it comes back


def test_degraded_then_healed_first(daemon: ServiceHost) -> None:
    daemon.configure("b", min_shared_cpus=1)
    daemon.allocate("big", "15", bind=True, numa_alignment="none")
    held = CPUSet.parse(allocations(daemon)["big"][3])
    try:
        _set_offline(daemon, {held.first()})
        eventually(lambda: daemon.busctl("get-property", "org.cpuservice1",
                                    "/org/cpuservice1/allocation/big",
                                    "org.cpuservice1.Allocation", "State")["data"] == "degraded")
        assert len(CPUSet.parse(allocations(daemon)["big"][3])) == 14
        assert daemon.prop("SharedCPUs") != ""
    finally:
        _set_offline(daemon, set())
    eventually(lambda: daemon.busctl("get-property", "org.cpuservice1",
                                "/org/cpuservice1/allocation/big",
                                "org.cpuservice1.Allocation", "State")["data"] == "active")
    assert len(CPUSet.parse(allocations(daemon)["big"][3])) == 15
