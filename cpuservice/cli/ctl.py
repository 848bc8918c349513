"""cpuservicectl: control cpuserviced over D-Bus, the way systemctl controls systemd.

Exit codes: 0 ok, 1 failure, 2 usage, 4 no such allocation, 5 not enough CPUs, 13 access denied.
Reads fetch everything in one call each (the Manager's GetAll, the ObjectManager's
GetManagedObjects); output helpers are in ctl_output, the status page in ctl_status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from dbus_fast import Message, MessageType

from cpuservice import __version__
from cpuservice.cli import (
    ctl_export,
    ctl_figures,
    ctl_lending,
    ctl_moves,
    ctl_top,
    pipe,
    topoview,
)
from cpuservice.cli.client import (
    ALLOCATION,
    DEST,
    EXIT_FAILURE,
    MANAGER,
    PATH,
    UNLIMITED,
    Client,
    exit_code,
    explain,
    explain_connect,
    polkit_agent,
    unwrap,
    variants,
)
from cpuservice.cli.ctl_output import (
    OUTPUTS,
    JsonMode,
    colour_wanted,
    dumps,
    json_mode,
    paged,
    percent,
    show_value,
    table,
    unicode_wanted,
    user_name,
)
from cpuservice.cli.ctl_status import allocation_status, pools_status
from cpuservice.cli.options import add_option_args, options_of
from cpuservice.host import dbuscall
from cpuservice.model.cpuset import CPUSet

WRITES = ("allocate", "release", "resize", "revalidate", *ctl_moves.COMMANDS,
          *ctl_lending.COMMANDS)
PAGED = ("status", "list", "show", "plan", "topology")


def _global_options(top: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after the verb (as systemctl's): the top
    parser sets the defaults, each command's only what is given after the verb."""
    g = argparse.ArgumentParser(add_help=False)

    def add(*names: str, **kw: Any) -> None:
        if not top:
            kw["default"] = argparse.SUPPRESS
        g.add_argument(*names, **kw)

    add("--json", metavar="MODE", choices=("short", "pretty", "off", "auto"),
        help="JSON output: short, pretty or off (plain --json: pretty on a terminal)")
    add("-j", dest="json", action="store_const", const="auto",
        help="same as --json (pretty on a terminal, short otherwise)")
    add("-o", "--output", choices=tuple(OUTPUTS),
        help="text, json or json-pretty (export: yaml too, its default)")
    add("--no-ask-password", action="store_true",
        help="do not ask for a password when polkit wants one")
    add("--bus-address", help="D-Bus address instead of the system bus")
    add("--no-color", action="store_true", help="no colours even on a terminal")
    add("--no-pager", action="store_true", help="do not pipe the output into a pager")
    add("--no-legend", action="store_true", help="no column headers and footers")
    add("-q", "--quiet", action="store_true", help="print only what was asked for")
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
    status = sub.add_parser("status", help="pools at a glance, or one allocation in detail")
    status.add_argument("name", nargs="?")
    sub.add_parser("list", help="all allocations")
    show = sub.add_parser("show", help="one allocation's properties")
    show.add_argument("name")
    show.add_argument("-p", "--property", action="append", default=[], metavar="NAME",
                      help="only these properties (repeat, or separate with commas)")
    show.add_argument("--value", action="store_true", help="values only, without NAME=")
    alloc = sub.add_parser("allocate", help="create an allocation")
    alloc.add_argument("name")
    alloc.add_argument("cpus")
    add_option_args(alloc, allocate=True)
    alloc.add_argument("--force", action="store_true", help="past the admission guard while "
                       "the shared pool starves (root or manage; this call only)")
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
    topo = sub.add_parser("topology", help="draw the machine and who uses which CPU")
    topo.add_argument("--compact", action="store_true",
                      help="collapse runs of cores in the same state")
    topo.add_argument("--node", type=int, action="append", metavar="N",
                      help="only NUMA node N (repeatable)")
    sub.add_parser("watch", help="follow the service's changes, one line per event")
    sub.add_parser("revalidate", help="re-read the topology now and repair")
    ctl_moves.add_parsers(sub)
    ctl_lending.add_parsers(sub)
    ctl_export.add_parser(sub)
    ctl_top.add_parser(sub)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line; a bare ``--json`` means ``--json=auto`` (as -j)."""
    p = parser()
    args = p.parse_args(["--json=auto" if a == "--json" else a for a in argv])
    if ctl_export.check_output(args):
        p.error(str(ctl_export.check_output(args)))
    args.json_mode = json_mode(args.json, args.output, sys.stdout.isatty())
    # decided on the real standard output, before a pager takes it
    args.colour = colour_wanted(sys.stdout, args.no_color)
    args.unicode = unicode_wanted(sys.stdout)
    return args


def _print_json(value: Any, args: argparse.Namespace) -> None:
    print(dumps(value, args.json_mode))


def _json(args: argparse.Namespace) -> bool:
    return bool(args.json_mode is not JsonMode.OFF)


async def _status(c: Client, args: argparse.Namespace) -> int:
    if args.name:
        return await allocation_status(c, args)
    return await pools_status(c, args)


async def _list(c: Client, args: argparse.Namespace) -> int:
    allocations = await c.allocations()
    if _json(args):
        _print_json(allocations, args)
        return 0
    rows = [("NAME", "CPUS", "BOUND", "CPUSET", "QUOTA", "WEIGHT", "STATE", "USER", "UNIT")]
    for a in allocations:
        rows.append((a["Name"], a["CPUs"], "yes" if a["Bound"] else "no", a["CPUSet"] or "-",
                     percent(a["CPUQuotaPerSecUSec"]), str(a["CPUWeight"]), a["State"],
                     f"{user_name(a['Owner'])}({a['Owner']})", a["Unit"]))
    text = table(rows, legend=not args.no_legend)
    if text:
        print(text)
    if not args.no_legend and not args.quiet:
        print(f"\n{len(allocations)} allocation(s) listed.")
    return 0


async def _plan(c: Client, args: argparse.Namespace) -> int:
    (plan,) = await c.call("Plan", "sa{sv}", [args.cpus, variants(options_of(args))])
    values = unwrap(plan)
    if _json(args):
        _print_json(values, args)
        return 0
    values["shares"] = show_value("Shares", values["shares"])
    values["cpu-quota-per-sec-usec"] = percent(values["cpu-quota-per-sec-usec"])
    if values.get("fragment-cpu") == -1:
        values["fragment-cpu"] = "-"
    for key in sorted(values):
        print(f"{key}={values[key] if values[key] != '' else '-'}")
    return 0


async def _capacity(c: Client, args: argparse.Namespace) -> int:
    (count,) = await c.call("Capacity", "sa{sv}", [args.cpus, variants(options_of(args))])
    if _json(args):
        _print_json({"capacity": count, "unlimited": count == UNLIMITED}, args)
    else:
        print("unlimited" if count == UNLIMITED else count)
    return 0


async def _topology(c: Client, args: argparse.Namespace) -> int:
    props = await c.properties()
    allocations = await c.allocations()
    topology = json.loads(props["Topology"])
    if _json(args):
        _print_json({"topology": topology, "allocations": allocations}, args)
        return 0
    pools = topoview.Pools(*(CPUSet.parse(props.get(k, "")) for k in topoview.POOL_PROPERTIES))
    print(topoview.render(topology, pools, allocations, props["Granularity"],
                          args.colour, devices=topoview.near_devices(props),
                          style=topoview.Style(unicode=args.unicode, compact=args.compact,
                                               nodes=frozenset(args.node or ()))))
    return 0


def printable(text: str) -> str:
    """Text received from the bus, with control characters shown escaped (a terminal must not
    act on escape sequences somebody put in a name or a reason)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def allocation_name(path: str) -> str | None:
    """The allocation an object path names (the inverse of the service's _xx escaping)."""
    prefix = PATH + "/allocation/"
    if not path.startswith(prefix):
        return None
    out, rest = [], path[len(prefix):]
    i = 0
    while i < len(rest):
        if rest[i] == "_" and len(rest) - i >= 3:
            try:
                out.append(chr(int(rest[i + 1:i + 3], 16)))
                i += 3
                continue
            except ValueError:
                pass
        out.append(rest[i])
        i += 1
    return "".join(out)


def event(msg: Message, now: float) -> dict[str, Any] | None:
    """One signal of the service as a watch event (None for the ObjectManager's copies)."""
    usec = int(now * 1e6)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{usec % 10**6:06d}"
    base = {"timestamp": stamp, "realtime_usec": usec, "signal": msg.member,
            "path": msg.path, "allocation": allocation_name(msg.path or "")}
    if msg.member == "PropertiesChanged" and msg.interface == "org.freedesktop.DBus.Properties":
        iface, changed, invalidated = msg.body
        return base | {"interface": iface, "changed": unwrap(changed),
                       "invalidated": list(invalidated)}
    if msg.interface in (MANAGER, ALLOCATION):
        return base | {"args": unwrap(list(msg.body))}
    return None


def event_line(e: dict[str, Any]) -> str:
    if e["signal"] == "PropertiesChanged":
        who = e["allocation"] or "Manager"
        values = " ".join(f"{k}={show_value(k, v)}" for k, v in sorted(e["changed"].items()))
        gone = f" (changed: {','.join(e['invalidated'])})" if e["invalidated"] else ""
        text = f"PropertiesChanged {who} {values}{gone}".rstrip()
    else:
        text = f"{e['signal']} {' '.join(str(x) for x in e['args'])}"
    return f"{e['timestamp']} {printable(text)}"


async def _watch(c: Client, args: argparse.Namespace) -> int:
    owner = dbuscall.NameOwner(c.bus, DEST)
    await owner.follow()
    await dbuscall.call(c.bus, *dbuscall.BUS, "AddMatch", "s",
                        [f"type='signal',sender='{DEST}',path_namespace='{PATH}'"])

    def on(msg: Message) -> bool:
        # only the service's own signals: anybody may send a signal to this connection
        if msg.message_type == MessageType.SIGNAL and msg.member and owner.sent(msg) \
                and (msg.path or "").startswith(PATH):
            e = event(msg, time.time())
            if e is not None:
                print(dumps(e, args.json_mode) if _json(args) else event_line(e), flush=True)
        return False

    c.bus.add_message_handler(on)
    if not args.quiet and not _json(args):
        print("watching cpuservice; Ctrl-C to stop", flush=True)
    await c.bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
    return 0


async def _allocate(c: Client, args: argparse.Namespace) -> int:
    path = await c.allocate(args.name, args.cpus,
                            options_of(args) | ({"force": True} if args.force else {}))
    return await _report(c, args, path)


async def _report(c: Client, args: argparse.Namespace, path: str) -> int:
    a = await c.properties(path, ALLOCATION)
    if _json(args):
        _print_json(a, args)
    elif not args.quiet:
        print(f"{a['Name']}: {a['CPUs']} CPU(s) {'bound to' if a['Bound'] else 'on'} "
              f"{a['CPUSet'] or '-'} ({a['Unit']})")
    return 0


async def _resize(c: Client, args: argparse.Namespace) -> int:
    await c.call("Resize", "ss", [args.name, args.cpus])
    (path,) = await c.call("GetAllocation", "s", [args.name])
    return await _report(c, args, path)


async def _release(c: Client, args: argparse.Namespace) -> int:
    await c.release(args.name)
    if _json(args):
        _print_json({"Name": args.name, "Released": True}, args)
    return 0


async def _revalidate(c: Client, args: argparse.Namespace) -> int:
    await c.call("Revalidate")
    if _json(args):
        props = await c.properties()
        props.pop("Topology", None)
        _print_json(props, args)
    return 0


HANDLERS = {"status": _status, "list": _list, "show": ctl_figures.show, "plan": _plan,
            "capacity": _capacity, "topology": _topology, "watch": _watch,
            "allocate": _allocate, "resize": _resize, "release": _release,
            "revalidate": _revalidate, "export": ctl_export.export,
            "defrag": lambda c, a: ctl_moves.defrag(c, a, a.json_mode if _json(a) else None),
            "movable": ctl_moves.movable, "lend": ctl_lending.lend, "top": ctl_top.top}


async def _run(args: argparse.Namespace) -> int:
    try:
        c = await Client.connect(args.bus_address, interactive=not args.no_ask_password)
    except (OSError, ConnectionError) as exc:
        raise Unreachable(explain_connect(exc, args.bus_address)) from None
    try:
        with polkit_agent(args.command in WRITES and not args.no_ask_password), \
                paged(args.command in PAGED and not args.no_pager and not _json(args)):
            return await HANDLERS[args.command](c, args)
    finally:
        c.close()


class Unreachable(Exception):
    """The bus cannot be reached; the text says which and what to look at."""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        status = asyncio.run(_run(args))
        pipe.flush()
        return status
    except dbuscall.CallError as exc:
        print(f"cpuservicectl: {explain(exc, not args.no_ask_password)}", file=sys.stderr)
        return exit_code(exc)
    except Unreachable as exc:
        print(f"cpuservicectl: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `cpuservicectl topology | head`: the reader has what it wanted
        pipe.discard()
        return 0
    except (OSError, ConnectionError, EOFError) as exc:
        print(f"cpuservicectl: lost the connection to cpuserviced: {exc}; see: systemctl "
              "status cpuservice", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
