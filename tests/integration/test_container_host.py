"""The container host itself: real systemd PID 1, system bus, polkitd; clean teardown."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from tests.envs.container import CHECKOUT, ContainerHost, _cgroup_tree
from tests.integration.conftest import Containers


def test_systemd_is_pid1_and_running(container: ContainerHost) -> None:
    assert container.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    state = container.run(["systemctl", "is-system-running"], check=False).stdout.strip()
    assert state in ("running", "degraded")
    assert container.run(["systemd-detect-virt", "-c"], check=False).stdout.strip() == (
        "systemd-nspawn"
    )


def test_transient_unit_reports_cpu_properties(container: ContainerHost) -> None:
    container.run(["systemd-run", "--unit=it-probe", "-p", "AllowedCPUs=1", "-p",
                   "CPUWeight=50", "-p", "CPUQuota=120%", "sleep", "100"])
    try:
        show = container.run(["systemctl", "show", "it-probe", "-p", "AllowedCPUs", "-p",
                              "CPUWeight", "-p", "CPUQuotaPerSecUSec"]).stdout.split()
        assert show == ["CPUWeight=50", "CPUQuotaPerSecUSec=1.200000s", "AllowedCPUs=1"]
    finally:
        container.run(["systemctl", "stop", "it-probe"], check=False)


def test_host_clients_reach_the_container_bus_and_polkit(container: ContainerHost) -> None:
    async def ask() -> tuple[str, object]:
        bus = await MessageBus(bus_address=container.bus_address, bus_type=BusType.SYSTEM).connect()
        try:
            reply = await bus.call(Message(
                destination="org.freedesktop.PolicyKit1",
                path="/org/freedesktop/PolicyKit1/Authority",
                interface="org.freedesktop.DBus.Properties", member="Get", signature="ss",
                body=["org.freedesktop.PolicyKit1.Authority", "BackendName"]))
            assert reply is not None and reply.message_type == MessageType.METHOD_RETURN, reply
            return bus.unique_name or "", reply.body[0].value
        finally:
            bus.disconnect()

    name, backend = asyncio.run(ask())
    assert name.startswith(":") and backend == "js"


def test_checkout_is_bound_in_and_runs_on_debian_python(container: ContainerHost) -> None:
    out = container.run(
        ["env", f"PYTHONPATH={CHECKOUT}", "/usr/bin/python3", "-m", "cpuservice.cli.plan",
         "--machine", "c", "x=4:bind"]).stdout
    assert "128 CPUs, 2 socket(s), 4 NUMA node(s), 8 L3 group(s)" in out
    assert "x: cpus=4 bound" in out


def _mounts() -> str:
    return Path("/proc/mounts").read_text()


def test_teardown_leaves_nothing_behind(containers: Containers) -> None:
    containers.stop()
    cgroups, mounts = _cgroup_tree(), _mounts()
    host = ContainerHost("cpuservice-teardown").start()
    nspawn_pid, pid1, base = host.nspawn.pid, host.pid1, host.base  # type: ignore[union-attr]
    assert host.run(["true"]).returncode == 0
    host.stop()
    for pid in (nspawn_pid, pid1):
        assert not Path(f"/proc/{pid}").exists() or _is_zombie_free(pid)
    assert _mounts() == mounts and base is not None and not base.exists()
    assert _cgroup_tree() == cgroups


def _is_zombie_free(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return state.stdout.strip() == ""
