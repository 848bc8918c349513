"""The VM lab itself: enforcement, real hotplug uevents, polkit with a real user, shapes."""

from __future__ import annotations

import json

import pytest

from tests.envs import lab

TOPOLOGY = """python3 - <<'PY'
import json
from cpuservice.topology import discover
t = discover("/sys")
print(json.dumps({"cpus": len(t.cpus), "sockets": len(t.sockets), "nodes": len(t.nodes),
                  "cores": len(t.cores), "tpc": t.threads_per_core, "isolated": str(t.isolated),
                  "sibling0": str(t.cores[t.cpus[0].core])}))
PY
"""
SCENARIOS = {
    "cgroup": "stat -fc %T /sys/fs/cgroup; cat /sys/fs/cgroup/cgroup.controllers",
    "enforce": "systemd-run -p AllowedCPUs=3 --wait -P grep Cpus_allowed_list /proc/self/status",
    "topology": TOPOLOGY,
    "hotplug": """
udevadm monitor --kernel --udev --subsystem-match=cpu > /tmp/udevadm.log &
monitor=$!
python3 - > /tmp/pyudev.log <<'PY' &
import pyudev, select
ctx = pyudev.Context()
mon = pyudev.Monitor.from_netlink(ctx, source="kernel")
mon.filter_by("cpu")
mon.start()
seen = 0
while seen < 2 and select.select([mon.fileno()], [], [], 30)[0]:
    while (dev := mon.poll(timeout=0)) is not None:
        print(dev.action, dev.sys_name, flush=True)
        seen += 1
PY
pyudev=$!
sleep 3
echo 0 > /sys/devices/system/cpu/cpu3/online
echo "online after offline: $(cat /sys/devices/system/cpu/online)"
sleep 1
echo 1 > /sys/devices/system/cpu/cpu3/online
echo "online after online: $(cat /sys/devices/system/cpu/online)"
wait $pyudev
sleep 1
kill $monitor
cat /tmp/udevadm.log /tmp/pyudev.log
""",
    "polkit": """
id alice
runuser -u alice -- systemd-run --no-ask-password true
echo "systemd-run status $?"
runuser -u alice -- busctl call --allow-interactive-authorization=no org.freedesktop.systemd1 \
  /org/freedesktop/systemd1 org.freedesktop.systemd1.Manager StartUnit ss ssh.service fail
echo "busctl status $?"
""",
}


@pytest.fixture(scope="module")
def boot(lab_ready: None) -> lab.Run:
    outcome = lab.run(SCENARIOS)
    print(f"\nVM lab: boot {outcome.boot_seconds:.1f} s, whole run {outcome.total_seconds:.1f} s")
    return outcome


def test_every_scenario_ran(boot: lab.Run) -> None:
    assert sorted(boot.results) == sorted(SCENARIOS)


def test_pure_cgroup_v2_with_cpuset(boot: lab.Run) -> None:
    out = boot.results["cgroup"].output
    assert out.startswith("cgroup2fs") and "cpuset" in out and " cpu " in f" {out} "


def test_allowed_cpus_is_enforced(boot: lab.Run) -> None:
    result = boot.results["enforce"]
    assert result.status == 0 and "Cpus_allowed_list:\t3" in result.output


def test_topology_discovery_on_the_real_kernel(boot: lab.Run) -> None:
    facts = json.loads(boot.results["topology"].output.strip().splitlines()[-1])
    assert facts == {"cpus": 8, "sockets": 2, "nodes": 2, "cores": 4, "tpc": 2,
                     "isolated": "", "sibling0": "0-1"}


def test_offlining_a_cpu_sends_udev_events(boot: lab.Run) -> None:
    out = boot.results["hotplug"].output
    assert "online after offline: 0-2,4-7" in out and "online after online: 0-7" in out
    assert any(line.startswith("KERNEL") and "offline" in line and "cpu3" in line
               for line in out.splitlines())
    assert any(line.startswith("UDEV") and "offline" in line and "cpu3" in line
               for line in out.splitlines())
    assert any(line.startswith("UDEV") and "online" in line and "cpu3" in line
               for line in out.splitlines())
    assert "offline cpu3" in out and "online cpu3" in out  # pyudev, kernel source


def test_unprivileged_user_is_refused_by_polkit(boot: lab.Run) -> None:
    out = boot.results["polkit"].output
    assert "uid=1000(alice)" in out
    assert "Interactive authentication required" in out
    assert "systemd-run status 0" not in out and "busctl status 0" not in out


def test_other_shapes_and_kernel_arguments(lab_ready: None) -> None:
    shape = lab.Shape(sockets=1, cores=2, threads=2, nodes=1, memory_mb=1024,
                      append="isolcpus=3")
    outcome = lab.run({"topology": TOPOLOGY}, shape)
    facts = json.loads(outcome.results["topology"].output.strip().splitlines()[-1])
    assert facts == {"cpus": 4, "sockets": 1, "nodes": 1, "cores": 2, "tpc": 2,
                     "isolated": "3", "sibling0": "0-1"}
