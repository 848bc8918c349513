"""Interrupt and workqueue isolation: the kernel adapter on a fake /proc and /sys, irqbalance's
socket, and the ordering in the reconcile transaction with the fake systemd."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
from pathlib import Path

import pytest

from cpuservice.host.irqbalance import Irqbalance
from cpuservice.host.irqs import (
    IRQS,
    SET_KERNEL,
    WORKQUEUES,
    Kernel,
    hex_mask,
    parse_hex_mask,
    write_irqs,
)
from cpuservice.model import config as config_mod
from cpuservice.model.cpuset import CPUSet
from tests.unit.fake_systemd import Crash, FakeSystemd
from tests.unit.test_service_fake import BIND, OPERATIONS, Host, _setup, agree, check_window, run


def test_hex_masks() -> None:
    assert hex_mask(CPUSet.parse("0-7")) == "000000ff"
    assert hex_mask(CPUSet.parse("0,33")) == "00000002,00000001"
    for text in ("0", "1-3,40-41,63", "0-127"):
        assert parse_hex_mask(hex_mask(CPUSet.parse(text))) == CPUSet.parse(text)


def fake_proc(tmp: Path, irqs: list[int]) -> tuple[Path, Path]:
    proc, sys = tmp / "proc", tmp / "sys"
    for irq in irqs:
        (proc / "irq" / str(irq)).mkdir(parents=True)
        (proc / "irq" / str(irq) / "smp_affinity_list").write_text("0-15\n")
    (proc / "irq" / "default_smp_affinity").write_text("ffff\n")
    (sys / "devices/virtual/workqueue").mkdir(parents=True)
    (sys / "devices/virtual/workqueue/cpumask").write_text("ffff\n")
    return proc, sys


def test_the_oneshot_confines_what_moves_and_reports_the_rest(tmp_path: Path,
                                                              monkeypatch) -> None:
    proc, _ = fake_proc(tmp_path, [0, 1, 4, 24])
    original = Path.write_text

    def kernel_says(self: Path, text: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.parent.name == "0":  # the timer: per-CPU, the kernel refuses
            raise OSError(errno.EIO, "Input/output error")
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", kernel_says)
    shared = CPUSet.parse("0-3,8-11")
    report = write_irqs(proc / "irq", shared)
    assert (proc / "irq/4/smp_affinity_list").read_text() == "0-3,8-11"
    assert (proc / "irq/default_smp_affinity").read_text() == "00000f0f"
    assert report.confined == [1, 4, 24] and report.unmovable == [0]


def test_the_daemon_has_systemd_run_the_oneshot(tmp_path: Path) -> None:
    fake = FakeSystemd()
    kernel = Kernel(fake, tmp_path, Irqbalance(str(tmp_path / "none")))  # type: ignore[arg-type]
    (tmp_path / "irqs-report.json").write_text(
        json.dumps({"cpus": "0-3", "confined": [1, 4], "unmovable": [0]}))
    asyncio.run(kernel.set_cpus(IRQS, CPUSet.parse("0-3")))
    start = next(w for w in fake.writes if w.member == "StartTransientUnit")
    assert start.unit.startswith("cpuservice-kernel-") and start.unit.endswith(".service")
    argv = start.props["ExecStart"][0][1]
    assert argv[2] == SET_KERNEL.replace("$", "$$")  # systemd would expand $NAME itself
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3:] == [
        "sh", "0000000f", "0-3", str(tmp_path / "irqs-report.json"), "-", "-", "-", "-", "-"]
    assert start.props["Type"] == "oneshot"
    assert kernel.report.confined == [1, 4] and kernel.report.unmovable == [0]
    assert asyncio.run(kernel.get_cpus(IRQS)) == CPUSet.parse("0-3")


class Oneshots:
    """A systemd that runs the kernel oneshot's script on a fake /proc and /sys, and holds each
    run at a gate while the test says so (a write in flight)."""

    def __init__(self, proc: Path, sys: Path) -> None:
        self.proc, self.sys = proc, sys
        self.runs: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False
        self.fail_once: BaseException | None = None

    async def start_transient(self, unit: str, props: dict) -> None:  # type: ignore[type-arg]
        from cpuservice.model.errors import SystemdFailure
        argv = props["ExecStart"][1][0][1]
        script = (argv[2].replace("$$", "$").replace("/proc/irq", str(self.proc / "irq"))
                  .replace("/sys/devices", str(self.sys / "devices")))
        await self.gate.wait()
        if self.fail_once is not None:
            error, self.fail_once = self.fail_once, None
            raise error
        if self.fail:
            raise SystemdFailure("the oneshot failed")
        proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", script, *argv[3:])
        assert await proc.wait() == 0
        self.runs.append(argv[4:])

    def irqs(self) -> CPUSet:
        return CPUSet.parse((self.proc / "irq/4/smp_affinity_list").read_text().strip())

    def workqueues(self) -> CPUSet:
        return parse_hex_mask((self.sys / "devices/virtual/workqueue/cpumask").read_text())


def _kernel(tmp_path: Path) -> tuple[Kernel, Oneshots]:
    proc, sys = fake_proc(tmp_path, [1, 4])
    systemd = Oneshots(proc, sys)
    kernel = Kernel(systemd, tmp_path, Irqbalance(str(tmp_path / "none")))  # type: ignore[arg-type]
    kernel.GIVE_BACK_DELAY = 0.05
    return kernel, systemd


def test_both_holders_are_written_by_one_oneshot(tmp_path: Path) -> None:
    async def body() -> None:
        kernel, systemd = _kernel(tmp_path)
        await kernel.set_many({IRQS: CPUSet.parse("0-3"), WORKQUEUES: CPUSet.parse("0-3")})
        assert len(systemd.runs) == 1 and kernel.writes == 1
        assert systemd.irqs() == systemd.workqueues() == CPUSet.parse("0-3")
        assert await kernel.get_cpus(WORKQUEUES) == CPUSet.parse("0-3")
    asyncio.run(body())


def test_taking_cpus_waits_giving_back_is_coalesced(tmp_path: Path) -> None:
    """An Allocate/Release loop: every take is written before it returns; the give-backs
    between them cost nothing of their own; the last one is written soon after."""
    async def body() -> None:
        kernel, systemd = _kernel(tmp_path)
        pool, taken = CPUSet.parse("0-15"), CPUSet.parse("0-11")
        both = {IRQS: pool, WORKQUEUES: pool}
        await kernel.set_many(both)
        for _ in range(10):
            await kernel.set_many({IRQS: taken, WORKQUEUES: taken})
            assert systemd.irqs() == systemd.workqueues() == taken  # before it returned
            await kernel.set_many(both)  # returns at once
        assert kernel.writes <= 1 + 10 + 1, kernel.writes  # not 1 + 20
        await kernel.settle()
        assert systemd.irqs() == systemd.workqueues() == pool
        assert kernel.writes <= 12
    asyncio.run(body())


def test_a_take_waits_for_the_give_back_in_flight(tmp_path: Path) -> None:
    """A give-back being written when a take of the same CPUs comes: the take is not answered
    before a write after it (the one in flight would give the CPUs back)."""
    async def body() -> None:
        kernel, systemd = _kernel(tmp_path)
        small, pool = CPUSet.parse("0-3"), CPUSet.parse("0-15")
        await kernel.set_many({IRQS: small, WORKQUEUES: small})
        systemd.gate.clear()
        await kernel.set_many({IRQS: pool, WORKQUEUES: pool})  # give back, not yet written
        await asyncio.sleep(0.2)  # the writer is in flight now, at the gate
        take = asyncio.create_task(kernel.set_many({IRQS: small, WORKQUEUES: small}))
        await asyncio.sleep(0.05)
        assert not take.done()
        systemd.gate.set()
        await take
        assert systemd.irqs() == systemd.workqueues() == small
        assert [r[1] for r in systemd.runs] == ["0-3", "0-15", "0-3"]
    asyncio.run(body())


def test_a_move_the_kernel_defers_is_reported_pending(tmp_path: Path) -> None:
    """x86 without interrupt remapping moves an IO-APIC interrupt at its next arrival, which
    still lands on the old CPU (the lab saw ata_piix's IRQ 15 do it): the report says which."""
    async def body() -> None:
        kernel, systemd = _kernel(tmp_path)
        (systemd.proc / "irq/1/effective_affinity_list").write_text("2\n")
        (systemd.proc / "irq/4/effective_affinity_list").write_text("0\n")  # not moved yet
        await kernel.set_cpus(IRQS, CPUSet.parse("1-3"))
        assert kernel.report.confined == [1, 4] and kernel.report.pending == [4]
    asyncio.run(body())


def test_a_failed_take_is_raised_and_a_failed_give_back_tried_again(tmp_path: Path) -> None:
    from cpuservice.host.irqs import IsolationFailed

    async def body() -> None:
        kernel, systemd = _kernel(tmp_path)
        kernel.RETRY_SECONDS = 0.05
        await kernel.set_cpus(IRQS, CPUSet.parse("0-15"))
        systemd.fail = True
        with pytest.raises(IsolationFailed):
            await kernel.set_cpus(IRQS, CPUSet.parse("0-3"))
        # after a failure the CPUs the kernel holds are unknown: the next change waits
        systemd.fail = False
        await kernel.set_cpus(IRQS, CPUSet.parse("0-7"))
        assert systemd.irqs() == CPUSet.parse("0-7")
        systemd.fail = True
        await kernel.set_cpus(IRQS, CPUSet.parse("0-15"))  # a give-back: at once
        await asyncio.sleep(0.15)
        systemd.fail = False
        await kernel.settle()
        assert systemd.irqs() == CPUSet.parse("0-15")
    asyncio.run(body())


def test_irqbalance_is_told_its_banned_cpus(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "irqbalance"
    run_dir.mkdir()
    path = run_dir / "irqbalance1234.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            got.append(conn.recv(4096))

    thread = threading.Thread(target=serve)
    thread.start()
    monkeypatch.setattr("cpuservice.host.irqbalance._all_cpus", lambda: CPUSet.parse("0-15"))
    assert Irqbalance(str(run_dir)).ban(CPUSet.parse("0-3"))
    thread.join(5)
    server.close()
    assert got == [b"settings cpus 4-15"]


ISOLATE = {"isolate_irqs": True, "isolate_workqueues": True}


def test_interrupts_leave_before_an_allocation_arrives(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, **ISOLATE)
        svc = await host.service()
        steps = [lambda: _setup(svc), lambda: svc.resize("keep", "5"),
                 lambda: (host.offline({15}), svc.revalidate(full=False))[1],
                 lambda: svc.release("keep")]
        for step in steps:
            mark, before = host.fake.mark(), svc.ledger.exclusive
            batches = len(host.kernel.batches)
            await step()
            check_window(host.fake, mark, before | svc.ledger.exclusive)
            for holder in (IRQS, WORKQUEUES):
                assert host.fake.cpus(holder) == svc.ledger.shared
            # both holders move together: one write to take CPUs, one to give them back
            written = host.kernel.batches[batches:]
            assert written and all(set(b) == {IRQS, WORKQUEUES} for b in written), written
            assert len(written) <= 2, written
        agree(svc, host.fake)
    run(body)


@pytest.mark.parametrize("op", ["allocate", "release", "resize-up", "repair"])
def test_a_failure_or_crash_at_the_kernel_step(tmp_path: Path, op: str) -> None:
    for crash in (False, True):
        async def body(crash: bool = crash) -> None:
            host = Host(tmp_path / f"{op}-{crash}", **ISOLATE)
            svc = await host.service()
            await _setup(svc)
            exclusive = svc.ledger.exclusive
            mark = host.fake.mark()
            real = host.kernel.set_cpus

            async def refuse(holder: str, cpus: CPUSet) -> None:
                if holder == IRQS:
                    if crash:
                        raise Crash()
                    from cpuservice.host.irqs import IsolationFailed
                    raise IsolationFailed("injected")
                await real(holder, cpus)

            host.kernel.set_cpus = refuse  # type: ignore[method-assign]
            try:
                await OPERATIONS[op](svc, host)
            except Exception:
                pass
            except Crash:
                pass
            host.kernel.set_cpus = real  # type: ignore[method-assign]
            svc = await host.service() if crash else svc
            check_window(host.fake, mark, exclusive | svc.ledger.exclusive)
            agree(svc, host.fake)
        run(body)


def test_isolation_off_gives_interrupts_every_cpu(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path, **ISOLATE)
        svc = await host.service()
        await svc.allocate("b", "4", BIND, 0)
        assert host.fake.cpus(IRQS) == svc.ledger.shared != svc.ledger.online
        host.cfg = config_mod.validate({**host.cfg.__dict__, "isolate_irqs": False,
                                        "isolate_workqueues": False})
        svc = await host.service()
        assert host.fake.cpus(IRQS) == host.fake.cpus(WORKQUEUES) == svc.ledger.online
    run(body)


def test_the_oneshot_script_on_a_fake_proc(tmp_path: Path) -> None:
    """The shell the oneshot runs: affinities written, the refused ones reported (a directory
    stands in for a file the kernel refuses)."""
    import subprocess

    proc, sys = fake_proc(tmp_path, [1, 4, 24])
    (proc / "irq/0/smp_affinity_list").mkdir(parents=True)  # writing fails, like EIO
    report, wq_report = tmp_path / "report.json", tmp_path / "wq.json"
    script = (SET_KERNEL.replace("/proc/irq", str(proc / "irq"))
              .replace("/sys/devices", str(sys / "devices")))
    subprocess.run(["/bin/sh", "-c", script, "sh", "00000f0f", "0-3,8-11", str(report),
                    "-", "-", "-"], check=True)
    assert json.loads(report.read_text()) == {"cpus": "0-3,8-11", "confined": [1, 24, 4],
                                              "unmovable": [0],
                                              "effective": {"1": "", "24": "", "4": ""}}
    assert (proc / "irq/4/smp_affinity_list").read_text() == "0-3,8-11\n"
    assert (proc / "irq/default_smp_affinity").read_text() == "00000f0f\n"
    assert (sys / "devices/virtual/workqueue/cpumask").read_text() == "ffff\n"  # left
    subprocess.run(["/bin/sh", "-c", script, "sh", "-", "-", "-", "0000000f", "0-3",
                    str(wq_report)], check=True)
    assert (sys / "devices/virtual/workqueue/cpumask").read_text() == "0000000f\n"
    assert json.loads(wq_report.read_text()) == {"cpus": "0-3"}
    assert (proc / "irq/4/smp_affinity_list").read_text() == "0-3,8-11\n"  # left


def test_a_job_that_times_out_fails_the_take_and_hangs_nobody(tmp_path: Path) -> None:
    """systemd's job wait raises the built-in TimeoutError after 90 s (or dbus-fast its own on a
    lost bus): the take gets IsolationFailed (its transaction undoes) instead of waiting forever
    with the service's lock held; a change asked for meanwhile is written."""
    from cpuservice.model.errors import IsolationFailed

    async def body() -> None:
        kernel, systemd = _kernel(tmp_path)
        await kernel.set_cpus(IRQS, CPUSet.parse("0-15"))
        systemd.fail_once = TimeoutError()
        systemd.gate.clear()
        take = asyncio.create_task(kernel.set_cpus(IRQS, CPUSet.parse("0-3")))
        await asyncio.sleep(0.05)
        later = asyncio.create_task(kernel.set_cpus(WORKQUEUES, CPUSet.parse("0-7")))
        await asyncio.sleep(0.05)
        systemd.gate.set()
        with pytest.raises(IsolationFailed):
            await asyncio.wait_for(take, 5)
        await asyncio.wait_for(later, 5)
        assert systemd.workqueues() == CPUSet.parse("0-7")
    asyncio.run(body())


def test_a_writer_that_stops_fails_its_waiters(tmp_path: Path) -> None:
    from cpuservice.model.errors import IsolationFailed

    async def body() -> None:
        kernel, systemd = _kernel(tmp_path)
        systemd.gate.clear()
        take = asyncio.create_task(kernel.set_cpus(IRQS, CPUSet.parse("0-3")))
        await asyncio.sleep(0.05)
        assert kernel._writer is not None
        kernel._writer.cancel()
        with pytest.raises(IsolationFailed):
            await asyncio.wait_for(take, 5)
    asyncio.run(body())
