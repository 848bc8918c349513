"""Small helpers for the placement and topology tests."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from cpuservice import placement
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.fixtures import MACHINES, write_sysfs
from cpuservice.model.pools import Allocation, Ledger, check_index, check_invariants
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology


def ledger_for(topology: Topology, **kw: Any) -> Ledger:
    return Ledger(topology.online, isolated=topology.isolated & topology.online, **kw)


def bind(cpus: str, **options: Any) -> Request:
    opts = {k.replace("_", "-"): v for k, v in options.items()}
    return Request.parse(cpus, {"bind": True, **opts})


def alloc(
    topology: Topology, ledger: Ledger, name: str, request: Request
) -> tuple[Ledger, Allocation]:
    new, a = placement.allocate(topology, ledger, name, request)
    check_invariants(new)
    check_index(new)
    return new, a


def nodes_of(topology: Topology, cpus: CPUSet) -> set[int]:
    return {topology.cpus[c].node for c in cpus}


HOTPLUG_STATES: dict[str, tuple[bool, bool, bool, bool]] = {
    # (in the online mask, topology files, L3 cache files, in its node's cpulist)
    "online": (True, True, True, True),
    "offline": (False, False, False, False),
    # half-way, as the VM lab's kernel (6.1) shows them (tests/lab/test_lab_env.py)
    "going-off": (False, True, False, False),
    "coming-on": (False, True, True, True),
}


def write_hotplug_state(root: Path, machine: str,
                        states: Mapping[int, str | tuple[bool, bool, bool, bool]],
                        links: bool = True) -> Path:
    """A sysfs tree of fixture ``machine`` with CPUs in the states the kernel shows during
    hotplug: a name from HOTPLUG_STATES or any (online mask, topology, cache, node cpulist)
    combination. Seen on the VM lab's kernel (tests/lab/test_lab_env.py): an offline CPU has no
    topology or cache directory and is in no node's cpulist but keeps its ``cpuN/nodeM`` link;
    going off, it leaves the online mask, its cache and its node's cpulist before its topology
    files; coming on, it has all of them before it joins the online mask. CPUs not named are
    online.
    ``links=False`` removes every ``cpuN/nodeM`` link (a tree without them)."""
    flags = {c: HOTPLUG_STATES[s] if isinstance(s, str) else s for c, s in states.items()}
    spec = replace(MACHINES[machine], offline=frozenset(c for c, f in flags.items() if not f[1]))
    write_sysfs(root, spec)
    base = root / "devices/system/cpu"
    for c, f in flags.items():
        if f[1] and not f[2]:
            shutil.rmtree(base / f"cpu{c}/cache", ignore_errors=True)
    possible = CPUSet.parse((base / "possible").read_text())
    (base / "online").write_text(
        (possible - CPUSet(c for c, f in flags.items() if not f[0])).format() + "\n")
    spec_rows = {row[0]: row[3] for row in spec.layout()}
    for node_dir in (root / "devices/system/node").glob("node*"):
        node = int(node_dir.name[4:])
        listed = CPUSet(c for c, n in spec_rows.items() if n == node and flags.get(c, (1,) * 4)[3])
        (node_dir / "cpulist").write_text(listed.format() + "\n")
    if not links:
        for link in base.glob("cpu*/node*"):
            link.unlink()
    return root


# the placement options a request may carry, as hypothesis draws them (the bind flag apart)
PLACEMENT_OPTIONS = {
    "policy": st.sampled_from(["packed", "full-pcpus", "spread-pcpus"]),
    "exclusive": st.sampled_from(["none", "pcpu", "numa"]),
    "numa-strategy": st.sampled_from(["most-allocated", "least-allocated", "distribute-evenly"]),
    "numa-alignment": st.sampled_from(["none", "best-effort", "restricted", "single-numa-node"]),
}
