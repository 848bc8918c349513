"""The NodeResourceTopology export of a live daemon in the container host (issue 28): the D-Bus
method and cpuservicectl export nrt give the same object, valid against the schema written
from the v1alpha2 Go types, equal to what the planner builds offline for the same machine;
--watch prints a new object after a change; allocations say Health and Aligned."""

from __future__ import annotations

import json
from typing import Any

from cpuservice.cli import plan
from tests.integration.service_env import DEST, ServiceHost
from tests.integration.test_cli import ctl
from tests.schema import nrt_errors

STRICT = {"numa-alignment": "single-numa-node", "memory-nodes": True}


def exported(daemon: ServiceHost, node: str = "worker-1") -> dict[str, Any]:
    (text,) = daemon.call("ExportNodeResourceTopology", "s", node)
    obj: dict[str, Any] = json.loads(text)
    return obj


def attribute(obj: dict[str, Any], name: str) -> str:
    return str(next(a["value"] for a in obj["attributes"] if a["name"] == name))


def without_generation(obj: dict[str, Any]) -> dict[str, Any]:
    return obj | {"attributes": [a for a in obj["attributes"]
                                 if a["name"] != "cpuservice.io/generation"]}


def test_the_daemon_exports_a_valid_object(daemon: ServiceHost, capsys: Any) -> None:
    daemon.configure("b", defaults=STRICT)
    obj = exported(daemon)
    assert nrt_errors(obj) == [], nrt_errors(obj)
    assert obj["metadata"] == {"name": "worker-1"}
    assert attribute(obj, "topologyManagerPolicy") == "single-numa-node"
    assert attribute(obj, "cpuservice.io/cpu-memory-aligned") == "true"
    before = int(attribute(obj, "cpuservice.io/generation"))

    daemon.allocate("db", "2", bind=True)  # the defaults: one node, memory on it
    daemon.allocate("web", "1.5")
    obj = exported(daemon)
    assert nrt_errors(obj) == [] and int(attribute(obj, "cpuservice.io/generation")) > before
    assert attribute(obj, "cpuservice.io/aligned-allocations") == "1"

    # the same machine and steps offline (the planner with the same defaults' effect)
    assert plan.main(["--machine", "b", "--node-name", "worker-1", "--export", "nrt",
                      "db=2:bind,numa-alignment=single-numa-node,memory-nodes", "web=1.5"]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert obj["zones"] == offline["zones"]
    policy = {"topologyManagerPolicy", "cpuservice.io/cpu-memory-aligned"}
    assert [a for a in without_generation(obj)["attributes"] if a["name"] not in policy] == [
        a for a in without_generation(offline)["attributes"] if a["name"] not in policy]

    # cpuservicectl: JSON (one line), the same object; YAML by default
    out = ctl(daemon, "export", "nrt", "--node-name", "worker-1", "-o", "json")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 1 and json.loads(out.stdout) == exported(daemon)
    out = ctl(daemon, "export", "nrt")
    assert out.returncode == 0 and out.stdout.startswith(
        '---\napiVersion: "topology.node.k8s.io/v1alpha2"\n')
    hostname = daemon.c.run(["cat", "/proc/sys/kernel/hostname"]).stdout.strip().lower()
    assert f'  name: "{hostname}"' in out.stdout
    out = ctl(daemon, "export", "nrt", "--node-name", "Worker_1")
    assert out.returncode == 2 and "kubectl get nodes" in out.stderr
    assert out.stderr.count("\n") == 1  # one line, no traceback


def test_watch_prints_a_new_object_after_a_change(daemon: ServiceHost) -> None:
    daemon.configure("b")
    script = ("timeout 5 env LANG=C.UTF-8 cpuservicectl --no-ask-password export nrt --watch "
              "-o json > /tmp/nrt-watch.json & sleep 1.5; "
              f"busctl call {' '.join(DEST)} Allocate ssa{{sv}} w 2 1 bind b true >/dev/null; "
              "wait; cat /tmp/nrt-watch.json")
    lines = daemon.c.run(["sh", "-c", script], check=False).stdout.splitlines()
    objects = [json.loads(line) for line in lines]
    assert len(objects) == 2, lines  # at once, then after the change (not a minute later)
    assert all(nrt_errors(o) == [] for o in objects)
    first, second = (int(attribute(o, "cpuservice.io/generation")) for o in objects)
    assert second > first
    assert attribute(objects[1], "cpuservice.io/bound-allocations") == "1"


def test_allocations_say_health_and_alignment(daemon: ServiceHost) -> None:
    daemon.configure("b")
    aligned = daemon.allocate("db", "2", bind=True, memory_nodes=True)
    loose = daemon.allocate("odd", "1", bind=True)
    iface = "org.cpuservice1.Allocation"
    assert daemon.prop("Aligned", aligned, iface) is True
    assert daemon.prop("AlignmentReason", aligned, iface) == ""
    assert (daemon.prop("Health", aligned, iface), daemon.prop("HealthReason", aligned, iface)
            ) == ("ok", "")
    assert daemon.prop("Aligned", loose, iface) is False
    assert "holds part of a core" in daemon.prop("AlignmentReason", loose, iface)
    show = ctl(daemon, "show", "odd").stdout
    assert "Aligned=no" in show and "Health=ok" in show and "AlignmentReason=" in show
