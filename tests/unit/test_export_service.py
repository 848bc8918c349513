"""The service's NodeResourceTopology export and the allocations' Health and Aligned, against the
in-memory systemd (tests.unit.fake_systemd): the generation counts committed changes, a
repaired allocation says why it is degraded."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpuservice.apply import views
from cpuservice.model.errors import InvalidArgument
from tests.schema import nrt_errors
from tests.unit.test_service_fake import BIND, Host, run


def attribute(obj: dict[str, object], name: str) -> str:
    return next(a["value"] for a in obj["attributes"] if a["name"] == name)  # type: ignore[attr-defined, index]


def test_the_export_follows_every_committed_change(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, "b", defaults={"numa-alignment": "single-numa-node",
                                             "memory-nodes": True})
        svc = await host.service()
        start = svc.generation
        obj = svc.node_resource_topology("worker-1")
        assert nrt_errors(obj) == [] and obj["metadata"] == {"name": "worker-1"}
        # nothing changed: the same object, not built again (an unauthenticated read)
        assert svc.node_resource_topology("worker-1") is obj
        assert svc.node_resource_topology("worker-2") is not obj
        assert attribute(obj, "topologyManagerPolicy") == "single-numa-node"
        assert attribute(obj, "cpuservice.io/cpu-memory-aligned") == "true"
        await svc.allocate("db", "2", BIND, 0)
        await svc.allocate("web", "1", {}, 0)
        obj = svc.node_resource_topology("worker-1")
        assert attribute(obj, "cpuservice.io/generation") == str(start + 2)
        assert attribute(obj, "cpuservice.io/aligned-allocations") == "1"
        assert svc.snapshot().generation == svc.generation == start + 2
        assert svc.node_resource_topology()["metadata"]["name"]  # this host's name
        with pytest.raises(InvalidArgument, match="not a Kubernetes node name"):
            svc.node_resource_topology("Worker_1")
    run(body)


def test_health_and_alignment_of_each_allocation(tmp_path: Path) -> None:
    async def body() -> None:
        # 2 nodes of 4 cores x 2 threads (siblings N and N+8); 6 CPUs stay shared
        host = Host(tmp_path, "b", min_shared_cpus=6)
        svc = await host.service()
        await svc.allocate("db", "2", {**BIND, "memory-nodes": True}, 0)
        await svc.allocate("odd", "1", BIND, 0)
        snap = svc.snapshot()
        db = views.allocation(snap.topology, snap.state, "db")
        assert (db["Aligned"], db["AlignmentReason"], db["Health"], db["HealthReason"]) == (
            True, "", "ok", "")
        odd = views.allocation(snap.topology, snap.state, "odd")
        assert not odd["Aligned"] and "holds part of a core" in odd["AlignmentReason"]
        # with the shared pool at its minimum, one of db's CPUs goes offline: nothing replaces it
        held = svc.ledger.allocations["db"].held
        await svc.allocate("fill", "7", BIND, 0)
        host.offline({c for c in range(16) if c in held and c != held.first()})
        await svc.revalidate()
        snap = svc.snapshot()
        db = views.allocation(snap.topology, snap.state, "db")
        assert (db["State"], db["Health"]) == ("degraded", "degraded")
        assert db["HealthReason"] == "holds 1 of 2 CPUs (no room to place it in full)"
    run(body)
