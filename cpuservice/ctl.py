"""cpuservicectl: control cpuserviced over D-Bus, the way systemctl controls systemd.

Exit codes: 0 ok, 1 failure, 2 usage, 4 no such allocation, 5 not enough CPUs, 13 access denied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from dbus_fast import Message, MessageType

from . import __version__, dbuscall, topoview
from .client import (
    ALLOCATION,
    DEST,
    EXIT_FAILURE,
    NO_QUOTA,
    PATH,
    UNLIMITED,
    Client,
    exit_code,
    unwrap,
    variants,
)
from .cpuset import CPUSet

READS = ("status", "list", "show", "plan", "capacity", "topology")


def add_option_args(p: argparse.ArgumentParser, bind_flag: bool = True) -> None:
    if bind_flag:
        p.add_argument("--bind", action="store_true", help="bound (exclusive) CPUs")
    p.add_argument("--policy", choices=("packed", "full-pcpus", "spread-pcpus"))
    p.add_argument("--exclusive", choices=("none", "pcpu", "numa"))
    p.add_argument("--numa-strategy",
                   choices=("most-allocated", "least-allocated", "distribute-evenly"))
    p.add_argument("--numa-alignment",
                   choices=("none", "best-effort", "restricted", "single-numa-node"))
    p.add_argument("--cpuset", help="explicit CPUs (cpu list); implies --bind")
    p.add_argument("--memory-nodes", action="store_true",
                   help="also restrict memory to the CPUs' NUMA nodes")


def options_of(args: argparse.Namespace) -> dict[str, Any]:
    """The Allocate/Plan/Capacity option map from parsed arguments (only what was given)."""
    opts: dict[str, Any] = {}
    if getattr(args, "bind", False) or getattr(args, "cpuset", None):
        opts["bind"] = True
    for key in ("policy", "exclusive", "numa_strategy", "numa_alignment", "cpuset", "unit",
                "lifetime"):
        value = getattr(args, key, None)
        if value is not None:
            opts[key.replace("_", "-")] = value
    if getattr(args, "memory_nodes", False):
        opts["memory-nodes"] = True
    return opts


def _global_options(top: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after the verb (as systemctl's): the top
    parser sets the defaults, each command's only what is given after the verb."""
    g = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    g.add_argument("-j", "--json", action="store_true", help="machine-readable output", **kw)
    g.add_argument("--no-ask-password", action="store_true",
                   help="do not ask for a password when polkit wants one", **kw)
    g.add_argument("--bus-address", help="D-Bus address instead of the system bus", **kw)
    g.add_argument("--no-color", action="store_true", help="no colours even on a terminal",
                   **kw)
    g.add_argument("--no-pager", action="store_true", help="accepted; output is not paged",
                   **kw)
    return g


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpuservicectl", description="Control cpuserviced.",
                                parents=[_global_options(True)])
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub_parser = sub.add_parser

    def command_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub_parser(name, parents=[_global_options(False)], **kw)

    sub.add_parser = command_parser  # type: ignore[method-assign]
    sub.add_parser("status", help="pools, counts, degraded allocations")
    sub.add_parser("list", help="all allocations")
    show = sub.add_parser("show", help="one allocation's properties")
    show.add_argument("name")
    alloc = sub.add_parser("allocate", help="create an allocation")
    alloc.add_argument("name")
    alloc.add_argument("cpus")
    add_option_args(alloc)
    alloc.add_argument("--unit", help="apply to this existing unit instead of a new slice")
    alloc.add_argument("--lifetime", choices=("persistent", "unit"))
    rel = sub.add_parser("release", help="release an allocation")
    rel.add_argument("name")
    res = sub.add_parser("resize", help="change an allocation's size")
    res.add_argument("name")
    res.add_argument("cpus")
    for verb in ("plan", "capacity"):
        sp = sub.add_parser(verb, help="dry run" if verb == "plan" else
                            "how many more of this shape fit")
        sp.add_argument("cpus")
        add_option_args(sp)
    sub.add_parser("topology", help="draw the machine and who uses which CPU")
    sub.add_parser("watch", help="follow the service's signals, one line per event")
    sub.add_parser("revalidate", help="re-read the topology now and repair")
    return p


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _fmt_quota(usec: int) -> str:
    return "none" if usec == NO_QUOTA else f"{usec / 10_000:g}%"


async def _status(c: Client, args: argparse.Namespace) -> int:
    props = await c.properties()
    allocations = await c.allocations()
    degraded = [a["Name"] for a in allocations if a["State"] != "active"]
    if args.json:
        props.pop("Topology", None)
        _print_json(props | {"Allocations": len(allocations), "Degraded": degraded})
        return 0
    bound = sum(a["Bound"] for a in allocations)
    print(f"cpuservice {props['Version']}: {len(CPUSet.parse(props['OnlineCPUs']))} CPUs online")
    for key in ("OnlineCPUs", "ReservedCPUs", "IsolatedCPUs", "SharedCPUs", "ExclusiveCPUs",
                "FragmentCPUs"):
        print(f"  {key[:-4] + ':':<11}{props[key] or '-'}")
    print(f"  Allocations: {len(allocations)} ({bound} bound, {len(allocations) - bound} "
          f"unbound); degraded: {', '.join(degraded) or 'none'}")
    irq = props.get("IRQIsolation") or {}
    if irq.get("enabled"):
        unmovable = ", ".join(map(str, irq["unmovable"])) or "none"
        print(f"  IRQs:      {len(irq['confined'])} on {irq['cpus'] or '-'}; unmovable: "
              f"{unmovable}{'; irqbalance told' if irq['irqbalance'] else ''}")
    return 0


async def _list(c: Client, args: argparse.Namespace) -> int:
    allocations = await c.allocations()
    if args.json:
        _print_json(allocations)
        return 0
    rows = [("NAME", "CPUS", "BOUND", "CPUSET", "QUOTA", "WEIGHT", "STATE", "OWNER", "UNIT")]
    for a in allocations:
        rows.append((a["Name"], a["CPUs"], "yes" if a["Bound"] else "no", a["CPUSet"] or "-",
                     _fmt_quota(a["CPUQuotaPerSecUSec"]), str(a["CPUWeight"]), a["State"],
                     str(a["Owner"]), a["Unit"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    print(f"\n{len(allocations)} allocation(s).")
    return 0


async def _show(c: Client, args: argparse.Namespace) -> int:
    (path,) = await c.call("GetAllocation", "s", [args.name])
    props = await c.properties(path, ALLOCATION)
    if args.json:
        _print_json(props)
        return 0
    for key in sorted(props):
        value = props[key]
        if key == "Shares":
            value = ",".join(f"{cpu}:{n}" for cpu, n in sorted(value.items())) or "-"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        print(f"{key}={value}")
    return 0


async def _plan(c: Client, args: argparse.Namespace) -> int:
    (plan,) = await c.call("Plan", "sa{sv}", [args.cpus, variants(options_of(args))])
    values = unwrap(plan)
    if args.json:
        _print_json(values)
        return 0
    values["shares"] = ",".join(f"{k}:{v}" for k, v in sorted(values["shares"].items())) or "-"
    values["cpu-quota-per-sec-usec"] = _fmt_quota(values["cpu-quota-per-sec-usec"])
    for key in sorted(values):
        print(f"{key}={values[key]}")
    return 0


async def _capacity(c: Client, args: argparse.Namespace) -> int:
    (count,) = await c.call("Capacity", "sa{sv}", [args.cpus, variants(options_of(args))])
    if args.json:
        _print_json({"capacity": count, "unlimited": count == UNLIMITED})
    else:
        print("unlimited" if count == UNLIMITED else count)
    return 0


async def _topology(c: Client, args: argparse.Namespace) -> int:
    props = await c.properties()
    allocations = await c.allocations()
    topology = json.loads(props["Topology"])
    if args.json:
        _print_json({"topology": topology, "allocations": allocations})
        return 0
    pools = topoview.Pools(*(CPUSet.parse(props[k]) for k in
                             ("OnlineCPUs", "ReservedCPUs", "IsolatedCPUs", "SharedCPUs")))
    colour = sys.stdout.isatty() and not args.no_color and "NO_COLOR" not in os.environ
    print(topoview.render(topology, pools, allocations, props["Granularity"], colour))
    return 0


def printable(text: str) -> str:
    """Text received from the bus, with control characters shown escaped (a terminal must not
    act on escape sequences somebody put in a name or a reason)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


async def _watch(c: Client, args: argparse.Namespace) -> int:
    owner = dbuscall.NameOwner(c.bus, DEST)
    await owner.follow()
    await dbuscall.call(c.bus, *dbuscall.BUS, "AddMatch", "s",
                        [f"type='signal',sender='{DEST}',path='{PATH}'"])

    def on(msg: Message) -> bool:
        # only the service's own signals: anybody may send a signal to this connection
        if msg.message_type == MessageType.SIGNAL and msg.path == PATH and msg.member \
                and owner.sent(msg) and msg.member != "PropertiesChanged":
            body = [str(x) for x in msg.body]
            print(printable(f"{msg.member} {' '.join(body)}"), flush=True)
        return False

    c.bus.add_message_handler(on)
    print("watching cpuservice; Ctrl-C to stop", flush=True)
    await c.bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
    return 0


async def _run(args: argparse.Namespace) -> int:
    c = await Client.connect(args.bus_address, interactive=not args.no_ask_password)
    try:
        if args.command == "allocate":
            await c.allocate(args.name, args.cpus, options_of(args))
            a = await c.properties((await c.call("GetAllocation", "s", [args.name]))[0],
                                   ALLOCATION)
            print(f"{args.name}: {a['CPUs']} CPU(s) {'bound to' if a['Bound'] else 'on'} "
                  f"{a['CPUSet'] or '-'} ({a['Unit']})")
            return 0
        if args.command == "release":
            await c.release(args.name)
            return 0
        if args.command == "resize":
            await c.call("Resize", "ss", [args.name, args.cpus])
            return 0
        if args.command == "revalidate":
            await c.call("Revalidate")
            return 0
        handlers = {"status": _status, "list": _list, "show": _show, "plan": _plan,
                    "capacity": _capacity, "topology": _topology, "watch": _watch}
        return await handlers[args.command](c, args)
    finally:
        c.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except dbuscall.CallError as exc:
        print(f"cpuservicectl: {exc.text}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `cpuservicectl topology | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, ConnectionError) as exc:
        print(f"cpuservicectl: cannot reach cpuserviced: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
