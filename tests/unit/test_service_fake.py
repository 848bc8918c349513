"""The service's own code (use cases, reconcile, checkpoint, recovery) against the in-memory
systemd of tests.unit.fake_systemd, as an unprivileged user: every method, a failure injected at
every step, a crash at every step, and random sequences of all of these."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.daemon import assemble
from cpuservice.host.checkpoint import Store
from cpuservice.model import config as config_mod
from cpuservice.model import lending
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import CPUServiceError, SystemdFailure
from cpuservice.model.fixtures import MACHINES, write_sysfs
from cpuservice.model.pools import check_invariants
from cpuservice.shell.service import Service
from tests.props import examples
from tests.unit.fake_systemd import (
    Crash,
    FakeKernel,
    FakeSystemd,
    Unit,
    empty_writes,
    violations,
)

BIND = {"bind": True}


XML = Path(__file__).parents[2] / "dbus/org.cpuservice1.xml"


def emits_changed() -> dict[tuple[str, str], str]:
    """(interface, property) -> its EmitsChangedSignal annotation in the shipped XML."""
    import xml.etree.ElementTree as ET
    out = {}
    for iface in ET.parse(XML).iter("interface"):
        for prop in iface.iter("property"):
            for ann in prop.iter("annotation"):
                if ann.get("name") == "org.freedesktop.DBus.Property.EmitsChangedSignal":
                    out[(iface.get("name", ""), prop.get("name", ""))] = ann.get("value", "")
    return out


class Recorder:
    """An Events sink that keeps what it is told, and checks it against the annotations."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.annotations = emits_changed()

    def _announces(self, iface: str, names: Any, allowed: tuple[str, ...]) -> None:
        for name in names:
            assert self.annotations[(f"org.cpuservice1.{iface}", name)] in allowed, name

    def allocation_added(self, name: str, values: Any) -> None:
        assert set(values) == {p for i, p in self.annotations if i.endswith("Allocation")}
        self.seen.append(("added", name))

    def allocation_removed(self, name: str) -> None:
        self.seen.append(("removed", name))

    def allocation_changed(self, name: str, reason: str, changed: Any) -> None:
        self._announces("Allocation", changed, ("true", "false"))
        self.seen.append(("changed", (name, dict(changed))))

    def allocation_moved(self, name: str, old: str, new: str) -> None:
        self.seen.append(("moved", (name, old, new)))

    def pools_changed(self, shared: str, exclusive: str, fragment: str) -> None:
        self.seen.append(("pools", shared))

    def manager_changed(self, changed: Any, invalidated: Any) -> None:
        self._announces("Manager", changed, ("true",))
        self._announces("Manager", invalidated, ("invalidates",))
        self.seen.append(("manager", (dict(changed), list(invalidated))))


class Host:
    """A machine: a sysfs tree, a state directory and a fake systemd that outlive services."""

    def __init__(self, tmp: Path, machine: str = "b", **settings: Any) -> None:
        self.machine = machine
        self.root = write_sysfs(tmp / "sys", machine)
        self.cfg = config_mod.validate({"sysfs_root": str(self.root),
                                        "state_file": str(tmp / "state" / "state.json"),
                                        **settings})
        self.fake = FakeSystemd()
        self.kernel = FakeKernel(self.fake)
        self.foreign: set[str] = set()
        # the lending controller's view of the kernel: each cgroup's usage_usec (the fake's
        # ControlGroup is "/" + the unit), its threads (tid -> run time in ns, the CPU it ran
        # on last; none: all its usage is unplaced), whether this host can lend, and its
        # clock; tests call svc.lending.sample()
        self.usage: dict[str, int] = {}
        self.threads: dict[str, dict[int, tuple[int, int]]] = {}
        self.can_lend = True
        self.clock = 1000.0

    async def service(self) -> Service:
        svc = assemble(self.cfg, self.fake, Store(self.cfg.state_file), self.kernel)
        svc.events = self.events = Recorder()
        svc.engine.detect_lending = lambda: (self.can_lend, "" if self.can_lend
                                             else "a hybrid cgroup hierarchy here")
        svc.lending.read_usage = self.usage.get
        svc.lending.read_threads = lambda group, known: (
            dict(self.threads.get(group, {})) if group in self.usage else None)
        svc.lending.clock = lambda: self.clock
        svc.lending.sleep = _never
        await svc.start()
        return svc

    def offline(self, cpus: set[int]) -> None:
        write_sysfs(self.root, replace(MACHINES[self.machine], offline=frozenset(cpus)))


async def _never(seconds: float) -> None:
    """The lending loop's sleep in these tests: it never wakes (they sample by hand)."""
    await asyncio.Event().wait()


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def agree(svc: Service, fake: FakeSystemd) -> None:
    """systemd holds exactly what the service's state says, and the state is consistent."""
    check_invariants(svc.ledger)
    want = svc.engine.specs(svc.state, svc.ledger.allocations)
    for unit, spec in want.items():
        assert unit in fake.units, f"{unit} missing"
        have = fake.units[unit].props
        for name, (sig, value) in spec.props.items():
            if sig == "ay":
                assert CPUSet.from_mask(bytes(have.get(name, b""))) == CPUSet.from_mask(
                    bytes(value)), (unit, name)
            else:
                assert have.get(name) == value, (unit, name, have.get(name), value)
    ours = {u for u in fake.units
            if u.startswith(("cpuservice-bound-", "cpuservice-shared-", "cpuservice-borrow-"))}
    assert ours <= want.keys(), f"leftover units {sorted(ours - want.keys())}"
    exclusive = svc.ledger.exclusive
    lent = {c: svc.record(n).unit for c, n in lending.lent_by(svc.topology, svc.state).items()}
    assert not violations([fake.snapshot()], exclusive, lent)


def check_window(fake: FakeSystemd, mark: tuple[int, int], exclusive: CPUSet,
                 foreign: set[str] | None = None,
                 lent: Mapping[int, str | AbstractSet[str]] | None = None) -> None:
    """Since ``mark``: no instant broke the ordering rule, no empty AllowedCPUs was written
    (``lent``: cpu -> the unit, or units, that may share it with the borrow slice)."""
    assert violations(fake.timeline[mark[0]:], exclusive, lent) == []
    assert empty_writes(fake.writes[mark[1]:], foreign or set()) == []


def test_every_method(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        fake = host.fake
        mark = fake.mark()
        await svc.allocate("u1", "1", {}, 1000)
        await svc.allocate("b1", "2", BIND, 1000)
        await svc.allocate("f1", "1.2", BIND, 0)
        agree(svc, fake)
        assert fake.cpus("cpuservice-bound-b1.slice") == svc.ledger.allocations["b1"].held
        assert fake.cpus("cpuservice-shared.slice") == svc.ledger.shared
        assert "cpuservice-shared-u1.slice" in fake.units
        assert svc.plan("1", BIND).cpus <= svc.ledger.shared
        assert svc.capacity("1", BIND) == len(svc.ledger.shared) - 1
        await svc.resize("b1", "4")
        assert len(fake.cpus("cpuservice-bound-b1.slice")) == 4
        await svc.resize("b1", "1")
        agree(svc, fake)
        scope = await svc.attach("b1", [4242])
        assert fake.units[scope].props["Slice"] == "cpuservice-bound-b1.slice"
        await svc.release("b1")
        await svc.release("u1")
        assert "cpuservice-bound-b1.slice" not in fake.units
        await svc.revalidate()
        agree(svc, fake)
        check_window(fake, mark, CPUSet.parse("0-15"))
        with pytest.raises(CPUServiceError):
            await svc.allocate("f1", "1", {}, 0)
    run(body)


def test_unit_option_restores_the_foreign_unit(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        host.fake.units["app.service"] = Unit("app.service", {"CPUWeight": 300})
        svc = await host.service()
        await svc.allocate("app", "2", {"bind": True, "unit": "app.service"}, 0)
        assert len(host.fake.cpus("app.service")) == 2
        await svc.release("app")
        assert host.fake.units["app.service"].props["CPUWeight"] == 300
        assert not host.fake.cpus("app.service")
    run(body)


async def _setup(svc: Service) -> None:
    await svc.allocate("keep", "2", BIND, 0)
    await svc.allocate("frag", "0.5", BIND, 0)
    await svc.allocate("u", "1", {}, 0)


OPERATIONS: dict[str, Callable[[Service, Host], Awaitable[Any]]] = {
    "allocate": lambda svc, host: svc.allocate("new", "3", BIND, 0),
    "allocate-fraction": lambda svc, host: svc.allocate("new", "1.3", BIND, 0),
    "release": lambda svc, host: svc.release("keep"),
    "resize-up": lambda svc, host: svc.resize("keep", "5"),
    "resize-down": lambda svc, host: svc.resize("keep", "1"),
    "repair": lambda svc, host: (host.offline(set(svc.ledger.allocations["keep"].whole)),
                                 svc.revalidate(full=False))[1],
    "revalidate": lambda svc, host: svc.revalidate(),  # after drift(): systemd was changed
}


def drift(host: Host) -> None:
    """Someone else changed our units behind the service's back (Revalidate repairs it)."""
    units = host.fake.units
    units["cpuservice-shared.slice"].props["AllowedCPUs"] = CPUSet.parse("0-15").to_mask()
    del units["cpuservice-bound-keep.slice"]
    host.fake.timeline.append(host.fake.snapshot())


def _dry_run(tmp: Path, op: str) -> tuple[int, CPUSet]:
    """How many systemd calls the operation makes when nothing fails, and the CPUs that are
    exclusive before or after it (the ones the ordering rule protects)."""
    async def body() -> tuple[int, CPUSet]:
        host = Host(tmp)
        svc = await host.service()
        await _setup(svc)
        if op == "revalidate":
            drift(host)
        before, exclusive = host.fake.calls, svc.ledger.exclusive
        await OPERATIONS[op](svc, host)
        return host.fake.calls - before, exclusive | svc.ledger.exclusive
    return asyncio.run(body())


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_a_failure_at_every_step_changes_nothing(tmp_path: Path, op: str) -> None:
    steps, exclusive = _dry_run(tmp_path / "count", op)
    assert steps > 0
    for n in range(1, steps + 1):
        async def body(n: int = n) -> None:
            host = Host(tmp_path / f"fail{n}")
            svc = await host.service()
            await _setup(svc)
            if op == "revalidate":
                drift(host)
            before_state = svc.state
            snapshot = {u: dict(unit.props) for u, unit in host.fake.units.items()}
            mark = host.fake.mark()
            host.fake.fail_at(n)
            if op in ("repair", "revalidate"):  # not requests: the next event or Revalidate repairs
                with pytest.raises(SystemdFailure):
                    await OPERATIONS[op](svc, host)
                agree(svc, host.fake)
                host.fake.fail_at(10**6)
                await svc.revalidate()
                agree(svc, host.fake)
                return
            with pytest.raises(SystemdFailure):
                await OPERATIONS[op](svc, host)
            assert svc.state == before_state
            agree(svc, host.fake)
            assert {u: dict(unit.props) for u, unit in host.fake.units.items()} == snapshot, n
            check_window(host.fake, mark, exclusive)
            again = await Host.service(host)  # the checkpoint says the same
            assert again.ledger.allocations == before_state.ledger.allocations
        run(body)


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_a_crash_at_every_step_recovers(tmp_path: Path, op: str) -> None:
    steps, exclusive = _dry_run(tmp_path / "count", op)
    for n in range(1, steps + 1):
        async def body(n: int = n) -> None:
            host = Host(tmp_path / f"crash{n}")
            svc = await host.service()
            await _setup(svc)
            if op == "revalidate":
                drift(host)
            mark = host.fake.mark()
            host.fake.fail_at(n, Crash())
            with pytest.raises(Crash):
                await OPERATIONS[op](svc, host)
            host.fake.fail_at(10**6)
            restarted = await host.service()
            agree(restarted, host.fake)
            check_window(host.fake, mark, exclusive)
        run(body)


ACTIONS = st.one_of(
    st.tuples(st.just("allocate"), st.sampled_from("abcd"),
              st.sampled_from(["1", "2", "0.5", "1.5", "3"]), st.booleans()),
    st.tuples(st.just("release"), st.sampled_from("abcd")),
    st.tuples(st.just("resize"), st.sampled_from("abcd"), st.sampled_from(["1", "2", "4"])),
    st.tuples(st.just("offline"), st.sets(st.integers(1, 15), max_size=4)),
    st.tuples(st.just("fail"), st.integers(1, 4)),
    st.tuples(st.just("crash"), st.integers(1, 4)),
)


@settings(max_examples=examples(25))
@given(actions=st.lists(ACTIONS, min_size=1, max_size=14))
def test_random_requests_hotplug_failures_and_crashes(tmp_path_factory: Any,
                                                      actions: list[tuple[Any, ...]]) -> None:
    tmp = tmp_path_factory.mktemp("random")

    async def body() -> None:
        host = Host(tmp)
        svc = await host.service()
        for action in actions:
            mark = host.fake.mark()
            exclusive = svc.ledger.exclusive
            kind = action[0]
            if kind in ("fail", "crash"):
                host.fake.fail_at(action[1], Crash() if kind == "crash" else None)
                continue
            try:
                if kind == "allocate":
                    await svc.allocate(action[1], action[2], {"bind": action[3]}, 0)
                elif kind == "release":
                    await svc.release(action[1])
                elif kind == "resize":
                    await svc.resize(action[1], action[2])
                else:
                    host.offline(action[1])
                    await svc.revalidate(full=False)
            except CPUServiceError:
                pass
            except Crash:
                host.fake.fail_at(10**6)
                svc = await host.service()
            host.fake.fail_at(10**6)
            exclusive = exclusive | svc.ledger.exclusive
            check_window(host.fake, mark, exclusive)
            agree(svc, host.fake)
    run(body)


def test_lifetime_unit_ends_with_its_slice_or_its_unit(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        await svc.allocate("job", "1", {"bind": True, "lifetime": "unit"}, 0)
        await svc.attach("job", [4242])
        assert svc.record("job").populated
        host.fake.kill_processes("cpuservice-bound-job.slice")  # its scope goes: UnitRemoved
        await asyncio.sleep(1.0)  # the lifetime check settles for 50 ms, then releases
        assert "job" not in svc.ledger.allocations
        assert "cpuservice-bound-job.slice" not in host.fake.units
        host.fake.units["app.service"] = Unit("app.service")
        await svc.allocate("app", "1", {"bind": True, "unit": "app.service",
                                        "lifetime": "unit"}, 0)
        await host.fake.stop("app.service")  # ActiveState inactive, watched
        await asyncio.sleep(1.0)  # the lifetime check settles for 50 ms, then releases
        assert "app" not in svc.ledger.allocations
        agree(svc, host.fake)
    run(body)


def test_corrupt_checkpoint_is_rebuilt_from_the_units(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        await svc.allocate("b", "2", BIND, 1000)
        await svc.allocate("f", "1.5", BIND, 0)
        await svc.allocate("u", "1", {}, 0)
        before = svc.ledger.allocations
        Path(host.cfg.state_file).write_text("garbage\n")
        mark = host.fake.mark()
        again = await host.service()
        assert again.ledger.allocations == before
        assert again.record("b").owner == 1000
        assert host.fake.writes[mark[1]:] == []  # nothing running was touched
        assert list(Path(host.cfg.state_file).parent.glob("state.json.corrupt-*"))
    run(body)


@pytest.mark.parametrize("breakage", ["double-booked", "overlap", "pieces", "bad-row",
                                      "after-repair"])
def test_a_checkpoint_that_breaks_the_invariants_is_set_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breakage: str) -> None:
    """Issue 37: a checkpoint that reads well (format, checksum) but whose allocations break
    the ledger's invariants (an InvariantError), or a row that cannot be read, stopped the
    start. It is set aside like a corrupt file, and the state is rebuilt from the slices,
    which systemd still has as they were: nothing running is touched. after-repair: the
    file is consistent, what the startup repair makes of it is not (the last check)."""
    import json

    from cpuservice.host import checkpoint
    from cpuservice.shell import recovery

    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        await svc.allocate("a", "2", BIND, 1000)
        await svc.allocate("b", "2.5", BIND, 0)
        await svc.allocate("u", "1", {}, 0)
        before, state = svc.ledger.allocations, svc.state
        a, b = before["a"], before["b"]
        assert b.fragment is not None
        bad = {"double-booked": replace(b, whole=a.whole),  # a CPU exclusive to two
               "overlap": replace(b, whole=b.whole | CPUSet([b.fragment.cpu])),
               "pieces": replace(b, fragment=replace(b.fragment, pieces=250))}.get(breakage, b)
        allocations = {**state.ledger.allocations, "b": bad}
        path = Path(host.cfg.state_file)
        Store(path).save(replace(state, ledger=replace(
            state.ledger, allocations=allocations, bound={})))
        if breakage == "bad-row":  # a row that cannot be read, under a good checksum
            header, payload = path.read_text().splitlines()
            data = json.loads(payload)
            data["allocations"][0]["whole"] = "3-x"
            payload = json.dumps(data)
            path.write_text(json.dumps({**json.loads(header),
                                        "checksum": checkpoint._checksum(payload)})
                            + f"\n{payload}\n")
        if breakage == "after-repair":
            real = recovery.repair

            def broken(topology: Any, ledger: Any) -> Any:
                repaired, changes = real(topology, ledger)
                if "b" in ledger.allocations and ledger.allocations["b"].whole == b.whole:
                    twice = {**repaired.allocations, "b": replace(b, whole=a.whole)}
                    repaired = replace(repaired, allocations=twice, bound={})
                monkeypatch.setattr(recovery, "repair", real)  # only the first time
                return repaired, changes
            monkeypatch.setattr(recovery, "repair", broken)
        mark = host.fake.mark()
        again = await host.service()
        check_invariants(again.ledger)
        assert again.ledger.allocations == before
        assert host.fake.writes[mark[1]:] == []  # nothing running was touched
        assert again.record("a").owner == 1000
        assert list(path.parent.glob("state.json.corrupt-*"))
        agree(again, host.fake)
    run(body)


def test_every_change_is_announced_with_its_values(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        await svc.allocate("b", "2", BIND, 0)
        assert ("added", "b") in host.events.seen
        await svc.resize("b", "3")
        changed = [v for k, v in host.events.seen if k == "changed"]
        assert changed[-1][1]["CPUs"] == "3" and len(changed[-1][1]["CPUSet"].split(",")) >= 1
        host.events.seen.clear()
        host.offline({15})
        await svc.revalidate(full=False)
        manager = [v for k, v in host.events.seen if k == "manager"]
        assert manager and manager[-1][0]["OnlineCPUs"] == "0-14"
        assert manager[-1][1] == ["Topology"]
        await svc.release("b")
        assert host.events.seen[-3:][0] == ("removed", "b")
    run(body)


def test_a_full_disk_is_a_named_error_and_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    from cpuservice.host import checkpoint

    async def body() -> None:
        host = Host(tmp_path)
        svc = await host.service()
        await svc.allocate("a", "2", BIND, 0)
        before, writes = svc.state, len(host.fake.writes)
        real_write = os.write

        def full(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint.os, "write", full)
        with pytest.raises(checkpoint.CheckpointWriteError) as caught:
            await svc.allocate("b", "2", BIND, 0)
        assert caught.value.dbus_name == "org.cpuservice1.Error.CheckpointFailed"
        assert svc.state is before and len(host.fake.writes) == writes
        monkeypatch.setattr(checkpoint.os, "write", real_write)
        await svc.allocate("c", "2", BIND, 0)  # keeps serving; the next start agrees
        again = await host.service()
        assert set(again.ledger.allocations) == {"a", "c"}
        agree(again, host.fake)
    run(body)


def test_foreign_units_are_restored_from_the_checkpoint_without_the_daemon(tmp_path: Path
                                                                          ) -> None:
    """Issue 25, seen by the review: removing the package while the daemon was down left
    unit= allocations' units with cpuservice's values (their saved values are only in the
    checkpoint). cpuservice.cli.restore (debian prerm) gives them back from the checkpoint alone."""
    from cpuservice.cli.restore import restore

    async def body() -> None:
        host = Host(tmp_path)
        host.fake.units["app.service"] = Unit("app.service", {"CPUWeight": 300})
        svc = await host.service()
        await svc.allocate("app", "2", {"bind": True, "unit": "app.service"}, 0)
        await svc.allocate("own", "1", BIND, 0)
        assert len(host.fake.cpus("app.service")) == 2
        # the daemon is gone; its checkpoint stays
        restored = await restore(Store(host.cfg.state_file), host.fake)
        assert restored == ["app.service"]
        assert host.fake.units["app.service"].props["CPUWeight"] == 300
        assert not host.fake.cpus("app.service")
        assert "cpuservice-bound-own.slice" in host.fake.units  # stopped by prerm, not here
    run(body)
