"""cpuserviced against real systemd and dbus-daemon in the container host."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
from typing import Any

import pytest

from cpuservice.host import dbuscall
from cpuservice.model.cpuset import CPUSet
from tests.integration import client
from tests.integration.service_env import DEST, ServiceHost, eventually
from tests.unit.test_introspection import members

NO_QUOTA = 2**64 - 1


def bound_slice(name: str) -> str:
    return f"cpuservice-bound-{name}.slice"


def allocations(daemon: ServiceHost) -> dict[str, list]:
    return {row[0]: row for row in daemon.call("ListAllocations")[0]}


def test_seed_example_through_busctl(daemon: ServiceHost) -> None:
    daemon.allocate("u1", "1")
    assert daemon.show("cpuservice-shared-u1.slice", "CPUQuotaPerSecUSec")[
        "CPUQuotaPerSecUSec"] == "1s"
    assert daemon.show("cpuservice-shared.slice", "AllowedCPUs")["AllowedCPUs"] == "0-7"

    daemon.allocate("b1", "1", bind=True)
    b1 = CPUSet.parse(allocations(daemon)["b1"][3])
    assert len(b1) == 1
    shared = CPUSet.parse("0-7") - b1
    assert daemon.show(bound_slice("b1"), "AllowedCPUs")["AllowedCPUs"] == b1.format()
    assert daemon.show("cpuservice-shared.slice", "AllowedCPUs")["AllowedCPUs"] == shared.format()
    assert allocations(daemon)["u1"][3] == shared.format()

    path = daemon.allocate("b12", "1.2", bind=True)
    shares = daemon.shares(path)
    assert sorted(shares.values()) == [20, 100]
    unit = daemon.show(bound_slice("b12"), "AllowedCPUs", "CPUQuotaPerSecUSec", "CPUWeight")
    assert unit == {"AllowedCPUs": CPUSet(shares).format(), "CPUQuotaPerSecUSec": "1.200000s",
                    "CPUWeight": "2000"}
    shared = shared - CPUSet(shares)
    assert len(shared) == 5
    assert daemon.prop("SharedCPUs") == shared.format()
    fragment = CPUSet([k for k, v in shares.items() if v == 20])
    assert daemon.prop("FragmentCPUs") == fragment.format()

    daemon.allocate("u12", "1.2")
    assert allocations(daemon)["u12"][1:4] == ["1.2", False, shared.format()]
    assert daemon.show("cpuservice-shared-u12.slice", "CPUQuotaPerSecUSec")[
        "CPUQuotaPerSecUSec"] == "1.200000s"
    assert daemon.show("cpuservice-shared.slice", "AllowedCPUs")["AllowedCPUs"] == shared.format()


def test_every_method_and_property(daemon: ServiceHost) -> None:
    daemon.configure("b")
    assert daemon.prop("Version") and daemon.prop("Granularity") == 100
    assert daemon.prop("OnlineCPUs") == "0-15" and daemon.prop("IsolatedCPUs") == ""
    topo = json.loads(daemon.prop("Topology"))
    assert len(topo) == 16 and set(topo[0]) == {"cpu", "core", "socket", "die", "node", "l3",
                                                 "online", "inferred"}
    plan = {k: v.value for k, v in _call(
        daemon, "Plan", "sa{sv}", ["2", {"bind": client_variant("b", True)}])[0].items()}
    assert plan["cpuset"] == "0,8" and plan["cpu-weight"] == 100 and plan["shares"] == {0: 100,
                                                                                        8: 100}
    assert plan["cpu-quota-per-sec-usec"] == NO_QUOTA and plan["memory-nodes"] == "0"
    assert daemon.call("Capacity", "sa{sv}", "2", "2", "bind", "b", "true", "policy", "s",
                       "full-pcpus")[0] == 7
    assert allocations(daemon) == {}  # Plan and Capacity change nothing

    path = daemon.allocate("db", "2", bind=True, memory_nodes=True)
    assert daemon.call("GetAllocation", "s", "db")[0] == path == "/org/cpuservice1/allocation/db"
    props = daemon.busctl("get-property", DEST[0], path, "org.cpuservice1.Allocation", "Name",
                          "CPUs", "Bound", "CPUSet", "CPUQuotaPerSecUSec", "CPUWeight",
                          "MemoryNodes", "Unit", "Owner", "State", "Lifetime")
    values = [p["data"] for p in props] if isinstance(props, list) else None
    assert values == ["db", "2", True, "0,8", NO_QUOTA, 100, "0", bound_slice("db"), 0, "active",
                      "persistent"]
    assert daemon.show(bound_slice("db"), "AllowedMemoryNodes")["AllowedMemoryNodes"] == "0"

    daemon.call("Resize", "ss", "db", "4")
    grown = CPUSet.parse(allocations(daemon)["db"][3])
    assert CPUSet.parse("0,8") <= grown and len(grown) == 4
    assert daemon.show(bound_slice("db"), "AllowedCPUs")["AllowedCPUs"] == grown.format()

    daemon.c.run(["systemd-run", "--unit=attach-me", "sleep", "300"])
    pid = daemon.show("attach-me.service", "MainPID")["MainPID"]
    scope = daemon.call("Attach", "sau", "db", "1", pid)[0]
    assert daemon.show(scope, "Slice", "ActiveState") == {"Slice": bound_slice("db"),
                                                          "ActiveState": "active"}
    cpus = daemon.c.run(["grep", "Cpus_allowed_list", f"/proc/{pid}/status"]).stdout
    assert cpus  # the container does not enforce; the VM lab checks the value

    daemon.call("Revalidate")
    daemon.busctl("call", DEST[0], path, "org.cpuservice1.Allocation", "Release")
    assert allocations(daemon) == {}
    assert daemon.show(bound_slice("db"), "LoadState", "ActiveState")["ActiveState"] in (
        "inactive", "")
    assert daemon.prop("SharedCPUs") == "0-15" and daemon.prop("ExclusiveCPUs") == ""
    daemon.c.run(["systemctl", "stop", "attach-me.service", scope], check=False)


def test_signals(daemon: ServiceHost) -> None:
    async def scenario() -> list[tuple[str, str, list]]:
        bus = await client.connect(daemon.c.bus_address)
        signals = await client.Signals(bus).start()
        await client.call(bus, "Allocate", "ssa{sv}", ["s1", "1", {}])
        await client.call(bus, "Allocate", "ssa{sv}",
                          ["b1", "2", {"bind": client_variant("b", True)}])
        await client.call(bus, "Resize", "ss", ["b1", "3"])
        await client.call(bus, "Release", "s", ["b1"])
        seen = await signals.settle()
        bus.disconnect()
        return seen

    seen = asyncio.run(scenario())
    members = [(m, body[0]) for m, path, body in seen if m != "PropertiesChanged"]
    assert ("AllocationAdded", "s1") in members and ("AllocationAdded", "b1") in members
    assert ("AllocationRemoved", "b1") in members
    assert any(m == "AllocationChanged" and b[0] == "b1" and "resized" in b[2]
               for m, _, b in seen)
    # an unbound allocation follows the shared pool: announced once by PoolsChanged
    assert not any(m == "AllocationChanged" and b[0] == "s1" for m, _, b in seen)
    pools = [b for m, _, b in seen if m == "PoolsChanged"]
    assert pools[-1] == ["0-7", "", ""] and len(pools) == 3
    assert any(m == "PropertiesChanged" and p.endswith("/b1") for m, p, _ in seen)
    # the ObjectManager's signals come from /org/cpuservice1, with the allocation's values
    added = [(p, b) for m, p, b in seen if m == "InterfacesAdded"]
    assert [b[0] for _, b in added] == ["/org/cpuservice1/allocation/s1",
                                        "/org/cpuservice1/allocation/b1"]
    assert {p for p, _ in added} == {"/org/cpuservice1"}
    b1 = added[1][1][1]["org.cpuservice1.Allocation"]
    assert b1["CPUs"].value == "2" and b1["Bound"].value is True
    removed = [(p, b) for m, p, b in seen if m == "InterfacesRemoved"]
    assert removed == [("/org/cpuservice1", ["/org/cpuservice1/allocation/b1",
                                             ["org.cpuservice1.Allocation"]])]


def test_get_managed_objects_lists_every_allocation(daemon: ServiceHost) -> None:
    daemon.allocate("m1", "1")
    daemon.allocate("m2", "2", bind=True)

    async def managed() -> dict[str, Any]:
        bus = await client.connect(daemon.c.bus_address)
        try:
            (objects,) = await dbuscall.call(bus, DEST[0], DEST[1],
                                             "org.freedesktop.DBus.ObjectManager",
                                             "GetManagedObjects", "", [])
            return dict(objects)
        finally:
            bus.disconnect()

    objects = asyncio.run(managed())
    assert set(objects) == {"/org/cpuservice1/allocation/m1", "/org/cpuservice1/allocation/m2"}
    m2 = objects["/org/cpuservice1/allocation/m2"]["org.cpuservice1.Allocation"]
    assert m2["CPUs"].value == "2" and m2["Bound"].value is True


def client_variant(sig: str, value: object) -> object:
    from dbus_fast import Variant

    return Variant(sig, value)


def test_fifty_concurrent_clients(daemon: ServiceHost) -> None:
    daemon.configure("c")

    async def worker(i: int) -> None:
        bus = await client.connect(daemon.c.bus_address)
        rng = random.Random(i)
        try:
            for round_ in range(3):
                name = f"w{i}-{round_}"
                cpus = rng.choice(["1", "2", "0.5", "1.25"])
                bind = rng.random() < 0.8
                try:
                    await client.call(bus, "Allocate", "ssa{sv}",
                                      [name, cpus, {"bind": client_variant("b", bind)}])
                except client.CallError as exc:
                    assert exc.name == "org.cpuservice1.Error.InsufficientCPUs", exc
                    continue
                if rng.random() < 0.5:
                    await client.call(bus, "Release", "s", [name])
        finally:
            bus.disconnect()

    async def everyone() -> None:
        await asyncio.gather(*(worker(i) for i in range(50)))

    asyncio.run(everyone())
    _check_consistent(daemon)


def test_a_burst_of_32_allocates_is_placed_applied_and_released(daemon: ServiceHost) -> None:
    """32 bound Allocates sent at once (one group commit): every one answered with its own
    CPUs, none double-booked, systemd holds what the daemon says; then 32 Releases at once."""
    daemon.configure("c")

    async def burst() -> list[Any]:
        bus = await client.connect(daemon.c.bus_address)
        try:
            return await asyncio.gather(*(client.call(
                bus, "Allocate", "ssa{sv}",
                [f"burst{i}", ("1", "2", "1.5", "0.5")[i % 4],
                 {"bind": client_variant("b", True)}]) for i in range(32)))
        finally:
            bus.disconnect()

    answers = asyncio.run(burst())
    assert [a[0] for a in answers] == [f"/org/cpuservice1/allocation/burst{i}" for i in range(32)]
    assert len(allocations(daemon)) == 32
    _check_consistent(daemon)

    async def release_all() -> None:
        bus = await client.connect(daemon.c.bus_address)
        try:
            await asyncio.gather(*(client.call(bus, "Release", "s", [f"burst{i}"])
                                   for i in range(32)))
        finally:
            bus.disconnect()

    asyncio.run(release_all())
    assert allocations(daemon) == {}
    assert daemon.prop("SharedCPUs") == daemon.prop("OnlineCPUs")


def test_32_concurrent_cpuservice_runs(daemon: ServiceHost) -> None:
    """32 cpuservice-run wrappers started together: while they run, each command is in its
    own bound slice, no CPU is in two of them and systemd holds what the daemon says (this
    container cannot enforce AllowedCPUs: the VM lab checks Cpus_allowed_list); every
    allocation is gone after they end."""
    daemon.configure("c")
    go = daemon.c.root / "run/burst-go"
    go.unlink(missing_ok=True)
    script = ("for i in $(seq 0 31); do cpuservice-run --cpus 1 --bind --name run$i -- "
              "sh -c 'cat /proc/self/cgroup; while [ ! -e /run/burst-go ]; do sleep 0.1; done'"
              " > /run/run$i.out 2>&1 & done; wait")
    runs = subprocess.Popen(["nsenter", "-t", str(daemon.c.pid1), "-a", "sh", "-c", script])
    try:
        eventually(lambda: len(allocations(daemon)) == 32, seconds=120)
        _check_consistent(daemon)
        for i in range(32):
            eventually(lambda i=i: f"cpuservice-bound-run{i}.slice/" in (
                daemon.c.root / f"run/run{i}.out").read_text())
    finally:
        go.touch()
        runs.wait(120)
    eventually(lambda: allocations(daemon) == {})
    assert daemon.prop("SharedCPUs") == daemon.prop("OnlineCPUs")


def _check_consistent(daemon: ServiceHost) -> None:
    """No CPU double-booked; systemd, the checkpoint and the properties agree."""
    rows = allocations(daemon)
    exclusive: set[int] = set()
    fragments: dict[int, int] = {}
    for name, row in rows.items():
        if not row[2]:
            continue
        path = row[4]
        for cpu, pieces in daemon.shares(path).items():
            if pieces == 100:
                assert cpu not in exclusive and cpu not in fragments, (name, cpu)
                exclusive.add(cpu)
            else:
                assert cpu not in exclusive
                fragments[cpu] = fragments.get(cpu, 0) + pieces
                assert fragments[cpu] <= 100
        unit = daemon.show(bound_slice(name.replace("-", "\\x2d")), "AllowedCPUs")
        assert unit["AllowedCPUs"] == row[3], name
    online = CPUSet.parse(daemon.prop("OnlineCPUs"))
    shared = online - CPUSet(exclusive) - CPUSet(fragments)
    assert daemon.prop("SharedCPUs") == shared.format()
    assert daemon.show("cpuservice-shared.slice", "AllowedCPUs")["AllowedCPUs"] == shared.format()
    state = daemon.state_file()
    assert sorted(r["name"] for r in state["allocations"]) == sorted(rows)
    units = daemon.c.run(["systemctl", "list-units", "--plain", "--no-legend",
                          "cpuservice-bound-*.slice"]).stdout.split()
    assert len([u for u in units if u.endswith(".slice")]) == sum(r[2] for r in rows.values())


def test_kill9_during_a_stream_loses_nothing_acknowledged(daemon: ServiceHost) -> None:
    daemon.configure("c")
    acknowledged: list[str] = []
    ended: list[str] = []  # how the stream ended

    async def stream() -> None:
        """Allocate one after another; after the 41st, kill -9 the daemon and go on until the
        kill has landed (a fixed count raced it: a quick daemon acknowledged all 200 first), with
        small unbound requests then, so that capacity never ends the stream first."""
        bus = await client.connect(daemon.c.bus_address)
        kill: asyncio.Future[None] | None = None
        try:
            for i in range(5000):
                if kill is not None and kill.done():
                    ended.append("killed")
                    return
                request = [f"k{i}", "1", {"bind": client_variant("b", i % 2 == 0)}] \
                    if kill is None else [f"k{i}", "0.1", {}]
                try:
                    await client.call(bus, "Allocate", "ssa{sv}", request)
                    acknowledged.append(f"k{i}")
                except client.CallError as exc:
                    ended.append(exc.name)  # the daemon went away mid-call
                    return
                if i == 40:
                    kill = asyncio.get_running_loop().run_in_executor(None, daemon.kill9)
        finally:
            bus.disconnect()

    asyncio.run(stream())
    # ended by the kill: seen landed, or a call it cut short (no reply: NoReply, or the bus
    # says the name has no owner for the moment), never a refusal of the daemon's own
    assert len(acknowledged) >= 41 and ended and not ended[0].startswith("org.cpuservice1"), \
        (len(acknowledged), ended)
    daemon.c.run(["systemctl", "start", "cpuservice.service"])
    rows = allocations(daemon)
    assert set(acknowledged) <= set(rows)
    _check_consistent(daemon)
    assert "status=9/KILL" in daemon.journal()


def test_restart_changes_no_running_unit(daemon: ServiceHost) -> None:
    daemon.configure("c")
    for name, cpus in (("x", "3"), ("y", "1.5"), ("z", "2")):
        daemon.allocate(name, cpus, bind=True)
    daemon.allocate("u", "2")
    before = {n: daemon.show(bound_slice(n), "AllowedCPUs", "CPUWeight", "CPUQuotaPerSecUSec")
              for n in "xyz"}
    repairs = re.compile(r"allocation \S+ repaired:")  # one event per repaired allocation
    seen = len(repairs.findall(daemon.journal()))  # earlier tests' too: the journal persists
    daemon.c.run(["systemctl", "restart", "cpuservice.service"])
    after = {n: daemon.show(bound_slice(n), "AllowedCPUs", "CPUWeight", "CPUQuotaPerSecUSec")
             for n in "xyz"}
    assert before == after and sorted(allocations(daemon)) == ["u", "x", "y", "z"]
    assert len(repairs.findall(daemon.journal())) == seen  # no repair: nothing changed


def test_corrupted_checkpoint_is_set_aside_and_rebuilt(daemon: ServiceHost) -> None:
    daemon.configure("b")
    daemon.allocate("p", "2", bind=True, policy="full-pcpus")
    daemon.allocate("q", "1.3", bind=True)
    before = allocations(daemon)
    daemon.stop()
    for path in (daemon.state_path(), daemon.state_path().with_name("state.json.journal")):
        if path.exists():  # checksums no longer match
            path.write_text(path.read_text().replace('"p"', '"P"'))
    daemon.start()
    assert allocations(daemon) == before
    aside = list(daemon.state_path().parent.glob("state.json.corrupt-*"))
    assert len(aside) == 1
    assert "rebuilt the state from systemd" in daemon.journal()
    _check_consistent(daemon)


def test_lifetime_unit_released_when_its_processes_end(daemon: ServiceHost) -> None:
    daemon.allocate("job", "1", bind=True, lifetime="unit")
    daemon.c.run(["systemd-run", "--unit=lt-worker", "sleep", "300"])
    pid = daemon.show("lt-worker.service", "MainPID")["MainPID"]
    daemon.call("Attach", "sau", "job", "1", pid)
    assert "job" in allocations(daemon)
    daemon.c.run(["kill", pid])
    eventually(lambda: "job" not in allocations(daemon))

    daemon.allocate("run", "1", bind=True, lifetime="unit")
    daemon.c.run(["systemd-run", "--scope", f"--slice={bound_slice('run')}", "sleep", "1"])
    eventually(lambda: "run" not in allocations(daemon))
    assert daemon.prop("SharedCPUs") == "0-7"


def test_unit_option_sets_and_restores_an_existing_unit(daemon: ServiceHost) -> None:
    daemon.c.run(["systemd-run", "--unit=redis-like", "-p", "CPUWeight=42", "sleep", "300"])
    try:
        daemon.allocate("redis", "2", bind=True, unit="redis-like.service")
        unit = daemon.show("redis-like.service", "AllowedCPUs", "CPUWeight")
        assert unit == {"AllowedCPUs": allocations(daemon)["redis"][3], "CPUWeight": "100"}
        assert daemon.busctl("get-property", DEST[0], "/org/cpuservice1/allocation/redis",
                             "org.cpuservice1.Allocation", "Unit")["data"] == "redis-like.service"
        daemon.call("Release", "s", "redis")
        assert daemon.show("redis-like.service", "AllowedCPUs", "CPUWeight") == {
            "AllowedCPUs": "", "CPUWeight": "42"}
        assert "not loaded" in daemon.error("Allocate", "ssa{sv}", "n", "1", "1", "unit", "s",
                                            "nope.service")
    finally:
        daemon.c.run(["systemctl", "stop", "redis-like.service"], check=False)


def test_lifetime_unit_with_unit_option(daemon: ServiceHost) -> None:
    daemon.c.run(["systemd-run", "--unit=short-lived", "sleep", "300"])
    daemon.allocate("sl", "1", bind=True, unit="short-lived.service", lifetime="unit")
    daemon.c.run(["systemctl", "stop", "short-lived.service"])
    eventually(lambda: "sl" not in allocations(daemon))


def test_the_borrow_slice_exists_only_while_somebody_borrows(daemon: ServiceHost) -> None:
    """Issue 40: no borrower, no borrow slice (a bound Allocate writes one holder of the shared
    pool less); the first borrower starts it, transient, at idle priority, before its own slice;
    the last one stops it. Real systemd: it takes CPUWeight=idle over D-Bus and starts the
    borrower's slice inside the transient parent."""
    def state(unit: str) -> dict[str, str]:
        return daemon.show(unit, "ActiveState", "LoadState", "Transient", "CPUWeight",
                           "AllowedCPUs", "ControlGroup")

    daemon.configure("b")
    borrow = "cpuservice-borrow.slice"
    daemon.allocate("o", "2", bind=True)
    assert state(borrow)["ActiveState"] == "inactive"
    daemon.allocate("b", "1", borrow=True)
    parent, child = state(borrow), state("cpuservice-borrow-b.slice")
    shared = daemon.prop("SharedCPUs")
    assert parent["ActiveState"] == "active" and parent["Transient"] == "yes", parent
    assert parent["CPUWeight"] == "idle" and parent["AllowedCPUs"] == shared, parent
    assert child["ActiveState"] == "active", child
    assert child["ControlGroup"].startswith(parent["ControlGroup"] + "/"), (parent, child)
    daemon.allocate("b2", "1", borrow=True)
    daemon.call("Release", "s", "b")
    assert state(borrow)["ActiveState"] == "active"
    daemon.call("Release", "s", "b2")
    assert state(borrow)["ActiveState"] == "inactive"
    daemon.allocate("b3", "1", borrow=True)  # and again: nothing of the last one is in the way
    assert state(borrow)["ActiveState"] == "active"
    daemon.stop()
    daemon.start()
    assert state(borrow)["ActiveState"] == "active"
    daemon.call("Release", "s", "b3")
    assert state(borrow)["ActiveState"] == "inactive"


def test_confine_host(daemon: ServiceHost) -> None:
    daemon.configure("a", confine_host=True)
    daemon.allocate("pin", "2", bind=True)
    shared = daemon.prop("SharedCPUs")
    for unit in ("system.slice", "user.slice", "init.scope"):
        assert daemon.show(unit, "AllowedCPUs")["AllowedCPUs"] == shared, unit
    daemon.call("Release", "s", "pin")
    assert daemon.show("system.slice", "AllowedCPUs")["AllowedCPUs"] == "0-7"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("Allocate", "ssa{sv}", "x", "0", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "-1", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "1e9", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "NaN", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "1.234", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "9", "1", "bind", "b", "true"), "InsufficientCPUs"),
        (("Allocate", "ssa{sv}", "../x", "1", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x\n", "1", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "-", "1", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "ünï", "1", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "a" * 65, "1", "0"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "1", "1", "bind", "s", "yes"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "1", "1", "policy", "u", "1"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "1", "1", "colour", "s", "red"), "InvalidArgument"),
        (("Allocate", "ssa{sv}", "x", "1", "2", "bind", "b", "true", "cpuset", "s", "99"),
         "InvalidArgument"),
        (("Allocate", "sss", "x", "1", "y"), "UnknownMethod"),
        (("Release", "s", "nobody"), "NoSuchAllocation"),
        (("Resize", "ss", "nobody", "2"), "NoSuchAllocation"),
        (("GetAllocation", "s", "nobody"), "NoSuchAllocation"),
        (("Plan", "sa{sv}", "abc", "0"), "InvalidArgument"),
        (("Capacity", "sa{sv}", "2", "1", "policy", "s", "x"), "InvalidArgument"),
        (("Attach", "sau", "nobody", "1", "1"), "NoSuchAllocation"),
    ],
)
def test_bad_input_gets_named_errors(daemon_host: ServiceHost, args: tuple[str, ...],
                                     error: str, containers) -> None:
    if daemon_host.c is not containers.get():
        daemon_host.install(containers.get())
    if daemon_host.c.run(["systemctl", "is-active", "cpuservice.service"],
                         check=False).stdout.strip() != "active":
        daemon_host.configure("a")
    text = daemon_host.error(*args)
    assert error in text or _error_name(daemon_host, args).endswith(error), text
    assert "Traceback" not in text and "File \"" not in text
    assert daemon_host.prop("Version")
    assert "NRestarts=0" in daemon_host.c.run(["systemctl", "show", "-p", "NRestarts",
                                               "cpuservice.service"]).stdout


def test_duplicate_name(daemon: ServiceHost) -> None:
    daemon.allocate("dup", "1")
    assert "AllocationExists" in _error_name(daemon, ("Allocate", "ssa{sv}", "dup", "1", "0"))


def _call(daemon: ServiceHost, member: str, sig: str, body: list[object]) -> list[object]:
    async def go() -> list[object]:
        bus = await client.connect(daemon.c.bus_address)
        try:
            return await client.call(bus, member, sig, body)
        finally:
            bus.disconnect()

    return asyncio.run(go())


def _error_name(daemon: ServiceHost, args: tuple[str, ...]) -> str:
    """The D-Bus error name of a failing call (busctl prints only the text)."""
    async def go() -> str:
        bus = await client.connect(daemon.c.bus_address)
        try:
            member, sig, *rest = args
            body = _body(sig, rest)
            await client.call(bus, member, sig, body)
            return ""
        except client.CallError as exc:
            return exc.name
        finally:
            bus.disconnect()

    return asyncio.run(go())


def _body(sig: str, args: list[str]) -> list[object]:
    """busctl-style flat arguments to a dbus-fast body (for the signatures used above)."""
    out: list[object] = []
    i = 0
    for part in ("s", "s", "a{sv}")[: len(sig)] if sig == "ssa{sv}" else list(sig.replace(
            "a{sv}", "A").replace("au", "U")):
        if part in ("a{sv}", "A"):
            n = int(args[i])
            i += 1
            opts = {}
            for _ in range(n):
                key, vsig, value = args[i:i + 3]
                i += 3
                opts[key] = client_variant(vsig, {"b": value == "true", "u": int(value) if
                                                  vsig == "u" else 0}.get(vsig, value))
            out.append(opts)
        elif part == "U":
            n = int(args[i])
            out.append([int(x) for x in args[i + 1:i + 1 + n]])
            i += 1 + n
        else:
            out.append(args[i])
            i += 1
    return out


def test_shipped_introspection_matches_the_service(daemon: ServiceHost) -> None:
    from tests.envs.container import CHECKOUT

    daemon.allocate("x", "1")
    live = {}
    for path in ("/org/cpuservice1", "/org/cpuservice1/allocation/x"):
        xml = daemon.c.run(["busctl", "call", DEST[0], path, "org.freedesktop.DBus.Introspectable",
                            "Introspect", "--json=short"]).stdout
        live.update(members(json.loads(xml)["data"][0]))
    shipped = members((CHECKOUT / "dbus/org.cpuservice1.xml").read_text())
    assert live == shipped
