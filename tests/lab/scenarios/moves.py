"""VM lab scenario: movable allocations moved on a real kernel (issue 27). Prints one JSON object
per check on lines starting with ``RESULT ``.

    python3 moves.py

Three movable allocations (anywhere, memory-nodes) each hold one thread of a core, and a
pinned one a thread of the fourth: no core is free, so a full-pcpus request of 2 CPUs is
placed only after a move. Each allocation runs a process in its slice; after the move (and
after a Defragment) the moved one's process must run on its new CPUs only (Cpus_allowed_list)
with its memory nodes following (Mems_allowed_list), as its slice's cgroup says.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from hotplug import ALLOCATION, DEST, Client, allowed, parse, result, unit_cpus

CPU = Path("/sys/devices/system/cpu")
MOVABLE = {"bind": Variant("b", True), "movable": Variant("s", "anywhere"),
           "memory-nodes": Variant("b", True)}


def mems(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Mems_allowed_list:"):
            return parse(line.split(":", 1)[1].strip())
    raise RuntimeError("no Mems_allowed_list")


def node_of(cpu: int) -> int:
    return next(int(p.name[4:]) for p in (CPU / f"cpu{cpu}").glob("node[0-9]*"))


def siblings(cpu: int) -> set[int]:
    return parse((CPU / f"cpu{cpu}/topology/thread_siblings_list").read_text().strip())


def main_pid(unit: str) -> int:
    return int(subprocess.run(["systemctl", "show", unit, "-p", "MainPID", "--value"],
                              capture_output=True, text=True, check=True).stdout)


def cgroup_cpus(unit: str) -> set[int]:
    group = subprocess.run(["systemctl", "show", unit, "-p", "ControlGroup", "--value"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return parse(Path(f"/sys/fs/cgroup{group}/cpuset.cpus.effective").read_text().strip())


async def check_processes(c: Client, names: list[str], units: dict[str, str]) -> dict:
    """Where each allocation's process runs, against what the daemon says it holds."""
    rows = await c.allocations()
    out = {}
    for name in names:
        pid = main_pid(f"mv-{name}")
        held = parse(rows[name][3])
        out[name] = {"held": sorted(held), "process": sorted(allowed(pid)),
                     "mems": sorted(mems(pid)), "nodes": sorted({node_of(x) for x in held}),
                     "unit": sorted(unit_cpus(units[name])),
                     "cgroup": sorted(cgroup_cpus(units[name]))}
    return out


async def moves(bus: MessageBus, c: Client) -> None:
    moved: list[list[str]] = []

    def on(msg: Message) -> bool:
        if msg.message_type == MessageType.SIGNAL and msg.member == "AllocationMoved":
            moved.append([msg.body[0], msg.body[2], msg.body[3]])
        return False

    bus.add_message_handler(on)
    await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                           interface="org.freedesktop.DBus", member="AddMatch", signature="s",
                           body=[f"type='signal',sender='{DEST}',member='AllocationMoved'"]))
    for name in await c.allocations():  # earlier scenarios of the boot may leave some
        await c.call("Release", "s", [name])
    names = ["a0", "a1", "a2"]
    units = {}
    for name in names:  # a whole core each (all first: none takes loose threads)...
        await c.call("Allocate", "ssa{sv}", [name, "2", MOVABLE])
    for name in names:  # ...then one thread of it
        await c.call("Resize", "ss", [name, "1"])
        path = (await c.allocations())[name][4]
        units[name] = str(await c.prop("Unit", path, ALLOCATION))
        subprocess.run(["systemd-run", f"--slice={units[name]}", f"--unit=mv-{name}",
                        "sleep", "1000"], check=True)
    shared = parse(str(await c.prop("SharedCPUs")))
    free_core = next(siblings(x) for x in sorted(shared) if siblings(x) <= shared)
    pin = min(free_core)
    await c.call("Allocate", "ssa{sv}", ["pin", "1", {"bind": Variant("b", True),
                                                     "cpuset": Variant("s", str(pin))}])
    before = await check_processes(c, names, units)
    await c.call("Allocate", "ssa{sv}", ["big", "2", {"bind": Variant("b", True),
                                                     "policy": Variant("s", "full-pcpus")}])
    big = parse((await c.allocations())["big"][3])
    await asyncio.sleep(0.5)  # the signals
    after = await check_processes(c, names, units)
    result(check="repack", before=before, after=after, moved=moved, big=sorted(big),
           big_is_a_core=len(big) == 2 and siblings(min(big)) == big)
    # Defragment: free the core the pinned thread's sibling is on, then gather again
    await c.call("Release", "s", ["big"])
    await c.call("Release", "s", ["pin"])
    moved.clear()
    (plan,) = await c.call("Defragment", "b", [True])
    (done,) = await c.call("Defragment", "b", [False])
    await asyncio.sleep(0.5)
    result(check="defragment", plan=[list(m) for m in plan], done=[list(m) for m in done],
           moved=moved, after=await check_processes(c, names, units))
    for name in names:
        subprocess.run(["systemctl", "stop", f"mv-{name}"], check=True)
        await c.call("Release", "s", [name])


async def main() -> None:
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    await moves(bus, Client(bus))


if __name__ == "__main__":
    asyncio.run(main())
