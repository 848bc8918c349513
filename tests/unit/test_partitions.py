"""Kernel cpuset partitions (issue: CPUSetPartition= on systemd >= 261): the rules of a request,
the kernel's report, and the service against the in-memory systemd (its fake kernel report is
what the unit's CPUSetPartition says, or invalid when a test says so). The real kernel and
systemd 262 are in the sid VM lab (tests/lab/test_lab_partitions.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cpuservice.apply import partitions, units
from cpuservice.apply.partitions import Capabilities, State, parse_state
from cpuservice.daemon import assemble
from cpuservice.host.checkpoint import Store
from cpuservice.model.config import validate
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InvalidArgument, NotSupported
from cpuservice.model.fixtures import write_sysfs
from cpuservice.shell.service import Service
from tests.unit.fake_systemd import FakeSystemd, violations

CAN = Capabilities("262.1-1", True, True)
ISOLATED = {"bind": True, "partition": "isolated"}


def test_the_kernels_report_is_parsed() -> None:
    assert parse_state("isolated\n") == State("isolated")
    assert parse_state("root") == State("root")
    assert parse_state("member\n") == State("member")
    assert parse_state("root invalid (Invalid cpu list in cpuset.cpus.exclusive)\n") == State(
        "root", "Invalid cpu list in cpuset.cpus.exclusive", False)
    # seen on Linux 7.2 with every CPU of the partition offline: no reason in parentheses
    assert parse_state("isolated invalid\n") == State("isolated", "no reason given", False)
    assert str(State("isolated", "why", False)) == "isolated invalid (why)"
    assert parse_state("") is None and parse_state("bogus") is None


def test_degraded_says_why() -> None:
    assert partitions.degraded("none", None) == ""
    assert partitions.degraded("isolated", State("isolated")) == ""
    assert "invalid: x" in partitions.degraded("isolated", State("isolated", "x", False))
    assert "member" in partitions.degraded("root", State("member"))
    assert partitions.degraded("root", None) == ""  # not looked at
    assert "cannot be read" in partitions.degraded("root", partitions.UNREADABLE)


def test_an_explicit_partition_is_refused_with_a_named_error() -> None:
    old = Capabilities("252.39-1", False, False, "no isolated partitions")
    with pytest.raises(NotSupported, match=r"systemd 252\.39-1 has no CPUSetPartition"):
        partitions.check("isolated", True, True, True, None, old)
    with pytest.raises(InvalidArgument, match="needs 'bind'"):
        partitions.check("root", True, False, True, None, CAN)
    with pytest.raises(InvalidArgument, match="whole number of CPUs"):
        partitions.check("root", True, True, False, None, CAN)
    with pytest.raises(InvalidArgument, match="own slice"):
        partitions.check("root", True, True, True, "db.service", CAN)
    assert partitions.check("isolated", True, True, True, None, CAN) == "isolated"


def test_a_configured_default_applies_only_where_it_can() -> None:
    old = Capabilities("252", False, False, "no")
    assert partitions.check("isolated", False, True, True, None, old) == "none"
    assert partitions.check("isolated", False, False, True, None, CAN) == "none"
    assert partitions.check("isolated", False, True, False, None, CAN) == "none"
    assert partitions.check("isolated", False, True, True, "db.service", CAN) == "none"
    assert partitions.check("isolated", False, True, True, None, CAN) == "isolated"


def test_capabilities_on_the_bus() -> None:
    assert CAN.as_dbus()["Partitions"] == ("as", ["none", "root", "isolated"])
    old = Capabilities("252", False, True).as_dbus()
    assert old["Partitions"] == ("as", ["none"]) and "systemd 252" in old[
        "PartitionsUnavailable"][1]


def test_partition_slices_are_top_level_and_round_trip() -> None:
    for name in ("web", "db-1", "a.b_c", "x" * 64):
        unit = units.slice_name(name, True, "isolated")
        assert "-" not in unit.replace("\\x2d", "")  # a child of -.slice, not of cpuservice
        assert units.name_of_slice(unit) == (name, True)
        assert units.is_own(unit)
    assert units.name_of_slice("cpuservice_partition_.slice") is None
    assert units.name_of_slice("cpuservice_partition_a-b.slice") is None  # not what we make


def test_the_kernel_readers(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    assert partitions.detect_kernel(root)[0] is False
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert "cpuset controller" in partitions.detect_kernel(root)[1]
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert "Linux 6.7" in partitions.detect_kernel(root)[1]
    (root / "cpuset.cpus.isolated").write_text("\n")
    assert partitions.detect_kernel(root) == (True, "")
    (root / "p.slice").mkdir()
    (root / "p.slice/cpuset.cpus.partition").write_text("isolated invalid (why)\n")
    assert partitions.read_state("/p.slice", root) == State("isolated", "why", False)
    assert partitions.read_state("/missing.slice", root) is None
    assert partitions.read_state("/../etc", root) is None
    assert partitions.read_state("relative", root) is None


# ---- the service against the in-memory systemd ----


def service(tmp: Path, fake: FakeSystemd, kernel: bool = True, **settings: Any) -> Service:
    cfg = validate({"sysfs_root": str(write_sysfs(tmp / "sys", "b")),
                    "state_file": str(tmp / "state/state.json"), **settings})
    svc = assemble(cfg, fake, Store(cfg.state_file))
    svc.engine.read_partition = fake.read_partition
    svc.engine.detect_kernel = lambda: (kernel, "" if kernel else "no partitions here")
    return svc


def run(body: Any) -> None:
    asyncio.run(body())


def systemd_262() -> FakeSystemd:
    fake = FakeSystemd()
    fake.partitions = True
    return fake


async def started(tmp: Path, fake: FakeSystemd, **settings: Any) -> Service:
    svc = service(tmp, fake, **settings)
    await svc.start()
    return svc


def test_a_partitioned_allocation_gets_a_top_level_slice_with_its_partition(
        tmp_path: Path) -> None:
    async def body() -> None:
        fake = systemd_262()
        svc = await started(tmp_path, fake)
        assert svc.engine.capabilities.partitions
        a = await svc.allocate("web", "2", ISOLATED, 0)
        unit = "cpuservice_partition_web.slice"
        assert svc.record("web").unit == unit
        props = fake.units[unit].props
        assert props["CPUSetPartition"] == "isolated"
        assert CPUSet.from_mask(bytes(props["AllowedCPUs"])) == a.whole
        assert not CPUSet.from_mask(bytes(fake.units["cpuservice-shared.slice"].props[
            "AllowedCPUs"])) & a.whole
        view = svc.engine.partition_report("web")
        assert view == State("isolated")
        await svc.resize("web", "3")
        assert fake.units[unit].props["CPUSetPartition"] == "isolated"
        assert len(CPUSet.from_mask(bytes(fake.units[unit].props["AllowedCPUs"]))) == 3
        assert not violations(fake.timeline, svc.ledger.exclusive | a.whole)
        await svc.release("web")
        assert unit not in fake.units and "web" not in svc.engine.partition_states
    run(body)


def test_an_invalid_partition_is_degraded_and_set_again(tmp_path: Path) -> None:
    async def body() -> None:
        fake = systemd_262()
        svc = service(tmp_path, fake)
        seen: list[tuple[str, str, dict[str, Any]]] = []

        class Events:
            def __getattr__(self, name: str) -> Any:
                return lambda *a: seen.append((name, a[0] if a else "", a[-1] if a else {}))

        svc.events = Events()  # type: ignore[assignment]
        await svc.start()
        await svc.allocate("web", "1", ISOLATED, 0)
        unit = "cpuservice_partition_web.slice"
        fake.invalid[unit] = "Cpu list in cpuset.cpus not exclusive"
        mark = len(fake.writes)
        await svc.heal_partitions()
        # announced degraded with the kernel's reason; set to member and back to isolated
        changes = [v for kind, name, v in seen if kind == "allocation_changed" and name == "web"]
        assert any(c.get("State") == "degraded" and "not exclusive" in c.get(
            "PartitionState", "") for c in changes)
        assert [w.props.get("CPUSetPartition") for w in fake.writes[mark:]] == [
            "member", "isolated"]
        assert svc.engine.partition_report("web") == State(
            "isolated", "Cpu list in cpuset.cpus not exclusive", False)
        del fake.invalid[unit]  # the conflict went away
        await svc.heal_partitions()
        assert svc.engine.partition_report("web") == State("isolated")
        assert any(v.get("State") == "active" for kind, name, v in seen[-3:]
                   if kind == "allocation_changed")
    run(body)


def test_without_systemd_support_an_explicit_partition_changes_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        fake = FakeSystemd()  # systemd 252: no CPUSetPartition
        svc = await started(tmp_path, fake)
        before = dict(fake.units)
        with pytest.raises(NotSupported, match="systemd 252"):
            await svc.allocate("web", "2", ISOLATED, 0)
        assert fake.units == before and not svc.ledger.allocations
        with pytest.raises(NotSupported):
            svc.plan("2", ISOLATED)
    run(body)


def test_a_default_partition_from_the_config(tmp_path: Path) -> None:
    async def body() -> None:
        fake = systemd_262()
        svc = await started(tmp_path, fake, defaults={"partition": "root"})
        await svc.allocate("whole", "2", {"bind": True}, 0)
        await svc.allocate("frac", "1.5", {"bind": True}, 0)
        await svc.allocate("shared", "1", {}, 0)
        assert svc.record("whole").unit == "cpuservice_partition_whole.slice"
        assert svc.record("frac").unit == "cpuservice-bound-frac.slice"
        assert svc.record("shared").unit == "cpuservice-shared-shared.slice"
        assert fake.units["cpuservice_partition_whole.slice"].props["CPUSetPartition"] == "root"
        assert "CPUSetPartition" not in fake.units["cpuservice-bound-frac.slice"].props
    run(body)


def test_a_partition_is_rebuilt_from_its_unit_when_the_checkpoint_is_lost(
        tmp_path: Path) -> None:
    async def body() -> None:
        fake = systemd_262()
        svc = await started(tmp_path, fake)
        await svc.allocate("web", "2", ISOLATED, 1000)
        before = svc.ledger.allocations
        Path(svc.config.state_file).write_text("garbage\n")
        mark = len(fake.writes)
        again = service(tmp_path, fake)
        await again.start()
        assert again.ledger.allocations == before
        assert again.record("web").unit == "cpuservice_partition_web.slice"
        assert fake.writes[mark:] == []
        assert again.engine.partition_report("web") == State("isolated")
    run(body)


def test_a_partition_cannot_be_resized_to_a_fraction(tmp_path: Path) -> None:
    async def body() -> None:
        fake = systemd_262()
        svc = await started(tmp_path, fake)
        await svc.allocate("web", "2", ISOLATED, 0)
        before = svc.ledger
        with pytest.raises(InvalidArgument, match=r"whole number of CPUs, not 1\.5"):
            await svc.resize("web", "1.5")
        assert svc.ledger is before
    run(body)


def test_a_partition_ends_before_any_cpu_moves_and_starts_after_its_cpus() -> None:
    from cpuservice.apply.reconcile import Kind, UnitSpec, plan

    cpus = ("ay", CPUSet([2, 3]).to_mask())
    pool = ("ay", CPUSet([0, 1, 4, 5]).to_mask())
    part = "cpuservice_partition_web.slice"
    before = {part: UnitSpec({"AllowedCPUs": cpus, "CPUSetPartition": ("s", "isolated")}),
              "cpuservice-shared.slice": UnitSpec({"AllowedCPUs": pool}, own=False)}
    after = {part: UnitSpec({"AllowedCPUs": pool, "CPUSetPartition": ("s", "member")}),
             "cpuservice-shared.slice": UnitSpec({"AllowedCPUs": pool}, own=False)}
    ops = plan(before, after, CPUSet([2, 3])).ops
    assert ops[0].unit == part and dict(ops[0].props) == {"CPUSetPartition": ("s", "member")}
    assert all("CPUSetPartition" not in op.props for op in ops[1:])
    # and back: the CPUs first, the partition after
    again = plan(after, before, CPUSet([2, 3])).ops
    mine = [op for op in again if op.unit == part]
    assert [op.kind for op in mine] == [Kind.SET, Kind.SET]
    assert "AllowedCPUs" in mine[0].props and "CPUSetPartition" not in mine[0].props
    assert dict(mine[1].props) == {"CPUSetPartition": ("s", "isolated")}


def test_root_on_boot_isolated_cpus_is_made_isolated() -> None:
    assert partitions.mode("root", {3}, {3, 4}) == "isolated"
    assert partitions.mode("root", {1}, {3, 4}) == "root"
    assert partitions.mode("isolated", {1}, set()) == "isolated"
    assert partitions.mode("none", {3}, {3}) == "none"


def test_after_a_systemd_downgrade_a_partition_is_a_plain_slice(tmp_path: Path) -> None:
    async def body() -> None:
        fake = systemd_262()
        svc = await started(tmp_path, fake)
        await svc.allocate("web", "2", ISOLATED, 0)
        held = svc.allocation("web").whole
        fake.partitions = False  # systemd 252 again: it refuses the property
        del fake.units["cpuservice_partition_web.slice"].props["CPUSetPartition"]
        again = service(tmp_path, fake, kernel=False)
        await again.start()  # no restart loop
        assert again.allocation("web").whole == held
        assert CPUSet.from_mask(bytes(fake.units["cpuservice_partition_web.slice"].props[
            "AllowedCPUs"])) == held
        await again.resize("web", "3")
        await again.release("web")
        assert "cpuservice_partition_web.slice" not in fake.units
    run(body)


def test_a_description_short_of_its_cpus_is_degraded() -> None:
    fields = {"name": "web", "cpus": "2", "bind": "true", "memory-nodes": "false",
              "owner": "0", "whole": "3", "partition": "isolated"}
    a, _ = units.from_description(fields, "cpuservice_partition_web.slice")
    assert a.degraded and str(a.request.options.partition) == "isolated"
    whole, _ = units.from_description({**fields, "whole": "3-4"}, "x")
    assert not whole.degraded
    unbound, _ = units.from_description({**fields, "bind": "false", "whole": "-",
                                         "partition": "none"}, "x")
    assert not unbound.degraded


def test_a_description_records_movable_only_when_set() -> None:
    """A Description names movable only when it is not "no", as partition and cpuset: the
    Descriptions of allocations made before the option existed stay the same, and read back
    as movable=no."""
    from cpuservice.host.checkpoint import Record
    from cpuservice.model.pools import Allocation
    from cpuservice.model.request import Request

    for movable in ("no", "node", "anywhere"):
        a = Allocation("web", Request.parse("2", {"bind": True, "movable": movable}),
                       CPUSet.parse("3-4"))
        fields = units.description_fields(a, Record(0, "cpuservice-bound-web.slice"))
        assert ("movable" in fields) == (movable != "no")
        text = units.describe("web", fields)
        back, _ = units.from_description(units.parse_description(text) or {}, "x")
        assert back == a
