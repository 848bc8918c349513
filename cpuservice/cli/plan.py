"""Planner: run a sequence of requests against a topology and print the pools after each step.

    python -m cpuservice.cli.plan --machine b a=2:bind u=1.5 f=1.2:bind,policy=spread-pcpus \\
        a~4  release:u  offline:3  online:3

Steps: ``NAME=CPUS[:OPTIONS]`` allocates (options ``key=value`` separated by commas; a bare key
means true), ``NAME~CPUS`` resizes, ``release:NAME`` releases, ``offline:N`` / ``online:N``
change the online set and repair. No systemd, no D-Bus: the same pure engine the daemon uses.

``--export nrt`` prints, instead of the pools, the machine after the steps as the
NodeResourceTopology object cpuservicectl export nrt prints (JSON; cpuservice.model.nrt).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Sequence
from decimal import Decimal

from cpuservice import placement
from cpuservice.cli import pipe
from cpuservice.host.sysfs import discover
from cpuservice.model import nrt
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import CPUServiceError
from cpuservice.model.fixtures import MACHINES, SHAPES
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.request import Request, parse_amount
from cpuservice.model.topology import Topology
from cpuservice.placement.repair import repair


def _options(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            out[key] = True
        elif value in ("true", "false"):
            out[key] = value == "true"
        else:
            out[key] = value
    return out


def _step(topology: Topology, full: Topology, ledger: Ledger, step: str) -> tuple[
    Topology, Ledger, str
]:
    if step.startswith(("offline:", "online:")):
        action, _, cpu = step.partition(":")
        cpus = CPUSet.parse(cpu)
        online = topology.online - cpus if action == "offline" else topology.online | cpus
        topology = full.with_online(online & full.all)
        ledger, changes = repair(topology, ledger)
        return topology, ledger, "; ".join(f"{c.name}: {c.reason}" for c in changes)
    if step.startswith("release:"):
        return topology, placement.release(ledger, step.partition(":")[2]), "released"
    if "~" in step:
        name, _, amount = step.partition("~")
        ledger, _ = placement.resize(topology, ledger, name, parse_amount(amount))
        return topology, ledger, "resized"
    name, sep, rest = step.partition("=")
    if not sep:
        raise SystemExit(f"cannot read step {step!r}")
    amount, _, opts = rest.partition(":")
    ledger, _ = placement.allocate(topology, ledger, name, Request.parse(amount, _options(opts)))
    return topology, ledger, "allocated"


def render(topology: Topology, ledger: Ledger) -> str:
    """The pools and every allocation, one line each."""
    lines = [
        f"  pools: shared={ledger.shared or '-'} exclusive={ledger.exclusive or '-'} "
        f"fragment={ledger.fragment or '-'} isolated={ledger.isolated or '-'}"
    ]
    for name in sorted(ledger.allocations):
        a = ledger.allocations[name]
        p = placement.describe(topology, ledger, a)
        quota = "none" if p.cpu_quota_usec is None else f"{Decimal(p.cpu_quota_usec) / 10**4}%"
        shares = ",".join(f"{c}:{n}" for c, n in sorted(p.shares.items())) or "-"
        state = " degraded" if a.degraded else ""
        lines.append(
            f"  {name}: cpus={a.request.cpus} {'bound' if a.bound else 'shared'} "
            f"cpuset={p.cpus or '-'} shares={shares} quota={quota} weight={p.cpu_weight} "
            f"mems={p.memory_nodes}{state}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        status = _main(argv)
        pipe.flush()
        return status
    except BrokenPipeError:  # `cpuservice-plan ... | head`: the reader has what it wanted
        pipe.discard()
        return 0


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpuservice-plan", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--sysfs-root", default=None, help="sysfs tree to read (default /sys)")
    where.add_argument("--machine", choices=sorted({**MACHINES, **SHAPES}),
                       help="a built-in fixture machine (or a real-machine shape)")
    parser.add_argument("--reserved", default="", help="reserved CPUs (cpu list)")
    parser.add_argument("--granularity", type=int, choices=(100, 1000), default=100)
    parser.add_argument("--min-shared", type=int, default=1)
    parser.add_argument("--draw", action="store_true",
                        help="end with the machine drawn as cpuservicectl topology draws it")
    parser.add_argument("--export", choices=("nrt",),
                        help="print the result as a NodeResourceTopology object (JSON)")
    parser.add_argument("--node-name", help="the object's name (default: the machine's name, "
                        "or this host's for --sysfs-root)")
    parser.add_argument("steps", nargs="*")
    args = parser.parse_args(argv)
    if args.export:
        return _export(args)
    full = topology = _topology(args)
    ledger = _ledger(topology, args)
    print(f"topology: {len(full.all)} CPUs, {len(full.sockets)} socket(s), {len(full.nodes)} "
          f"NUMA node(s), {len(full.l3_groups)} L3 group(s), {full.threads_per_core} thread(s) "
          f"per core; online {full.online}")
    print(render(topology, ledger))
    status = 0
    for step in args.steps:
        try:
            topology, ledger, what = _step(topology, full, ledger, step)
            print(f"{step}: {what}")
        except CPUServiceError as exc:
            print(f"{step}: {type(exc).__name__}: {exc}")
            status = 1
        check_invariants(ledger)
        print(render(topology, ledger))
    if args.draw:
        from cpuservice.cli import topoview

        print(topoview.draw_ledger(topology, ledger, colour=sys.stdout.isatty(),
                                   style=topoview.Style(unicode=_utf8())))
    return status


def _topology(args: argparse.Namespace) -> Topology:
    if args.machine:
        return {**MACHINES, **SHAPES}[args.machine].topology()  # built in memory
    return discover(args.sysfs_root or "/sys")


def _ledger(topology: Topology, args: argparse.Namespace) -> Ledger:
    return Ledger(topology.online, reserved=CPUSet.parse(args.reserved),
                  isolated=topology.isolated & topology.online,
                  granularity=args.granularity, min_shared_cpus=args.min_shared)


def _export(args: argparse.Namespace) -> int:
    """The steps, quietly (a failed one on standard error), then the object; its generation
    is the number of steps that changed the ledger."""
    full = topology = _topology(args)
    ledger = _ledger(topology, args)
    generation, status = 0, 0
    for step in args.steps:
        try:
            topology, ledger, _ = _step(topology, full, ledger, step)
            generation += 1
        except CPUServiceError as exc:
            print(f"cpuservice-plan: {step}: {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
    name = args.node_name or args.machine or nrt.default_node_name(socket.gethostname())
    try:
        obj = nrt.export(topology, ledger, name, generation)
    except CPUServiceError as exc:
        print(f"cpuservice-plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(obj, indent=2))
    return status


def _utf8() -> bool:
    from cpuservice.cli.ctl_output import unicode_wanted

    return unicode_wanted(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
