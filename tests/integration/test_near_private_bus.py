"""Option near end to end (issue 38): cpuservicectl and cpuservice-run against the real bus API
on a private dbus-daemon (tests/integration/test_cli_private_bus.py), the daemon reading a
fixture sysfs tree with devices (cpuservice.model.fixture_devices): no root, no container."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixture_devices import write_devices
from tests.integration.test_cli_private_bus import PrivateService

NODE0, NODE1 = CPUSet.parse("0-3,8-11"), CPUSet.parse("4-7,12-15")  # machine b


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[PrivateService]:
    write_devices(tmp_path / "sys", "gpu-box", "b")  # the CPUs' tree is written beside them
    s = PrivateService(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def test_allocate_near_end_to_end(svc: PrivateService) -> None:
    made = svc.ctl("allocate", "gpu", "4", "--near", "eth1", "--near", "mlx5_0", "-o", "json")
    assert made.returncode == 0, made.stderr
    a = json.loads(made.stdout)
    assert CPUSet.parse(a["CPUSet"]) <= NODE1 and a["MemoryNodes"] == "1"
    assert a["NearPolicy"] == "required" and a["Aligned"] is True
    assert [d[:4] for d in a["NearDevices"]] == [["eth1", 1, "net", "0000:3b:00.0"],
                                                 ["mlx5_0", 1, "infiniband", "0000:5e:00.0"]]
    status = svc.ctl("status", "gpu").stdout
    assert "Near: eth1 (net 0000:3b:00.0): NUMA node 1; mlx5_0 (infiniband 0000:5e:00.0): " \
           "NUMA node 1 [required]" in status, status
    assert "Near:      pci, char, block, net, infiniband, drm, nvme" in svc.ctl("status").stdout
    plan = json.loads(svc.ctl("plan", "2", "--near", "0000:17:00.0", "-j").stdout)
    assert CPUSet.parse(plan["cpuset"]) <= NODE0 and plan["memory-nodes"] == "0"
    assert json.loads(svc.ctl("capacity", "2", "--near", "eth1", "-j").stdout)["capacity"] == 2
    topology = svc.ctl("topology", "--no-pager").stdout
    assert "NUMA node 1  devices: eth1 mlx5_0 nvme0" in topology, topology
    assert "Devices without NUMA locality here: eth2 (net 0000:3b:00.1)" in topology


def test_refusals_name_the_device(svc: PrivateService) -> None:
    unknown = svc.ctl("allocate", "x", "1", "--near", "eth9")
    assert unknown.returncode == 2 and "no device 'eth9' here" in unknown.stderr
    hostile = svc.ctl("allocate", "x", "1", "--near", "/dev/../etc/shadow")
    assert hostile.returncode == 2 and "not . or .." in hostile.stderr
    assert svc.ctl("allocate", "big", "8", "--near", "eth1").returncode == 0
    full = svc.ctl("allocate", "x", "1", "--near", "eth1")
    assert full.returncode == 5 and "eth1 (NUMA node 1)" in full.stderr, full.stderr
    assert "Traceback" not in unknown.stderr + hostile.stderr + full.stderr
    # preferred: elsewhere, and says why
    other = json.loads(svc.ctl("allocate", "y", "2", "--near", "eth1", "--near-policy",
                               "preferred", "-j").stdout)
    assert CPUSet.parse(other["CPUSet"]) <= NODE0 and not other["Aligned"]
    assert "device-remote" in other["AlignmentReason"]
    # no locality: constrains nothing, and says so
    none = json.loads(svc.ctl("allocate", "z", "1", "--near", "eth2", "-j").stdout)
    assert "constrains nothing" in none["NearDevices"][0][4]


def test_cpuservice_run_near(svc: PrivateService, tmp_path: Path) -> None:
    """cpuservice-run --near allocates next to the device, then hands the command to
    systemd-run (here a stand-in that records its arguments: the private bus has no systemd)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "systemd-run"
    stand_in.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\n")
    stand_in.chmod(0o755)
    env = svc.env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    out = subprocess.run([sys.executable, "-m", "cpuservice.cli.run", "--bus-address",
                          svc.address, "--name", "served", "--cpus", "2", "--near", "eth1",
                          "--", "true"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--slice=cpuservice-bound-served.slice" in (tmp_path / "args").read_text()
    a = json.loads(svc.ctl("show", "served", "-o", "json").stdout)
    assert CPUSet.parse(a["CPUSet"]) <= NODE1 and a["NearDevices"][0][0] == "eth1"
