"""Interrupts and unbound kernel work as holders of the shared pool (config ``isolate_irqs``,
``isolate_workqueues``): while a bound allocation holds CPUs, no movable interrupt and no unbound
workqueue runs there.

The reconcile transaction treats them like the shared slice: the pseudo-units ``kernel:irqs``
and ``kernel:workqueues`` (KERNEL_HOLDERS) lose CPUs before an allocation gets them and get them
back after it is released. The daemon's own sandbox keeps the kernel's tunables read-only, so
systemd runs this module as a short oneshot service to write them (``Kernel``):

- every IRQ in /proc/irq whose affinity can be set gets ``smp_affinity_list`` = the pool, and
  ``/proc/irq/default_smp_affinity`` too (for IRQs requested later); an IRQ the kernel refuses
  (EIO: managed or per-CPU interrupts) is reported, not fought;
- when irqbalance runs, its banned CPUs are set at runtime through its socket (it would move
  the interrupts back otherwise), see ``Irqbalance``;
- ``/sys/devices/virtual/workqueue/cpumask`` = the pool.
Pure helpers first (mask text, the list of IRQs), then the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cpuservice.host import irq_devices
from cpuservice.host.irq_devices import DeviceReport
from cpuservice.host.irqbalance import Irqbalance
from cpuservice.host.irqs_shell import SET_KERNEL
from cpuservice.model import device_irqs
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import CPUServiceError, IsolationFailed

log = logging.getLogger(__name__)
IRQS = "kernel:irqs"
WORKQUEUES = "kernel:workqueues"
KERNEL_HOLDERS = (IRQS, WORKQUEUES)


def is_kernel(unit: str) -> bool:
    """Whether ``unit`` is a pseudo-unit of the kernel: the interrupts, the workqueues, or one
    device's interrupts (cpuservice.model.device_irqs: option near-irqs)."""
    return unit in KERNEL_HOLDERS or device_irqs.address_of(unit) is not None


def hex_mask(cpus: CPUSet) -> str:
    """The kernel's bitmap text: 32-bit hex words, most significant first, comma-separated."""
    value = sum(1 << c for c in cpus)
    words = []
    while True:
        words.append(f"{value & 0xFFFFFFFF:08x}")
        value >>= 32
        if not value:
            break
    return ",".join(reversed(words))


def parse_hex_mask(text: str) -> CPUSet:
    value = int(text.strip().replace(",", "") or "0", 16)
    return CPUSet(i for i in range(value.bit_length()) if value >> i & 1)


@dataclass
class Report:
    """What the last change did to the interrupts."""

    cpus: CPUSet = field(default_factory=CPUSet)
    confined: list[int] = field(default_factory=list)
    unmovable: list[int] = field(default_factory=list)
    irqbalance: bool = False
    # confined, but the kernel defers the move to the interrupt's next arrival (x86 IO-APIC
    # without interrupt remapping): that one arrival may still land on the CPU it leaves
    pending: list[int] = field(default_factory=list)
    # the interrupts of devices of option near-irqs, by PCI address, as last written
    devices: dict[str, DeviceReport] = field(default_factory=dict)


def pending_moves(effective: Mapping[str, str], cpus: CPUSet) -> list[int]:
    """The IRQs whose effective affinity (the CPUs the kernel delivers them to now, as the
    oneshot read it right after its writes: IRQ -> cpu list) is not yet within ``cpus``."""
    pending = []
    for irq, text in effective.items():
        try:
            if text.strip() and not CPUSet.parse(text.strip()) <= cpus:
                pending.append(int(irq))
        except ValueError:
            continue
    return sorted(pending)


def write_irqs(irq_dir: Path, cpus: CPUSet) -> Report:
    """Every IRQ's affinity and the default one = ``cpus``; what the kernel refused is
    reported (EIO: managed or per-CPU; EINVAL: no online CPU it can take)."""
    _write(irq_dir / "default_smp_affinity", hex_mask(cpus))
    report = Report(cpus)
    text = cpus.format()
    for irq in _irqs(irq_dir):
        try:
            (irq_dir / str(irq) / "smp_affinity_list").write_text(text)
            report.confined.append(irq)
        except FileNotFoundError:
            continue  # freed meanwhile
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.EINVAL, errno.EPERM):
                raise IsolationFailed(f"IRQ {irq}: {exc.strerror}") from None
            report.unmovable.append(irq)
    return report


def _irqs(irq_dir: Path) -> list[int]:
    try:
        return sorted(int(p.name) for p in irq_dir.iterdir() if p.name.isdigit())
    except OSError:
        return []


class Starter(Protocol):
    """What the kernel adapter asks of systemd: run a transient unit and wait for its job."""

    async def start_transient(self, unit: str, props: Mapping[str, tuple[str, Any]]) -> None: ...


class Kernel:
    """The daemon's side: it may not write /proc/irq or /sys itself (its unit keeps
    ProtectKernelTunables=yes), so it has systemd run a short oneshot service (a shell script)
    that writes both holders at once and reports beside the checkpoint. irqbalance is told from
    here (its socket is in /run).

    Writes are coalesced: at most one oneshot is in flight, and it writes the latest wanted
    CPUs of both holders. A change that takes CPUs from a holder waits until a write that
    started after it is done (the reconcile transaction's order depends on it). A change that
    only gives CPUs back (a release) returns at once: it is written shortly after, together with
    whatever came meanwhile, so that a loop of Allocate and Release does not rewrite every
    interrupt of the host twice per round. A background write that fails is tried again."""

    GIVE_BACK_DELAY = 0.2  # seconds a give-back waits for more changes to write with it
    RETRY_SECONDS = 5.0

    def __init__(self, systemd: Starter, state_dir: str | Path,
                 irqbalance: Irqbalance | None = None) -> None:
        self.systemd = systemd
        self.state_dir = Path(state_dir)
        self.irqbalance = irqbalance if irqbalance is not None else Irqbalance()
        self.report = Report()
        self.writes = 0  # oneshots run (the metrics, the tests)
        self._tag = os.urandom(4).hex()
        self._want: dict[str, CPUSet] = {}  # the latest CPUs asked for, per holder
        self._have: dict[str, CPUSet] = {}  # what the last write set (absent: unknown)
        self._flying: dict[str, CPUSet] = {}  # what the write in flight sets
        # device holders no allocation keeps any more: their interrupts follow the pool again
        self._released: set[str] = set()
        self._asked = 0  # the number of the latest change that must wait for its write
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()

    def _report_path(self, holder: str) -> Path:
        return self.state_dir / f"{holder.split(':')[1]}-report.json"

    @property
    def _devices_path(self) -> Path:
        """The devices whose interrupts are kept, with their CPUs (read after a restart)."""
        return self.state_dir / "devices-report.json"

    async def get_cpus(self, holder: str) -> CPUSet | None:
        """What the last write set (None: unknown, the next change writes it anyway)."""
        try:
            address = device_irqs.address_of(holder)
            if address is not None:
                return CPUSet.parse(irq_devices.held(self._devices_path)[address])
            return CPUSet.parse(json.loads(self._report_path(holder).read_text())["cpus"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def devices(self) -> list[str]:
        """The device holders whose interrupts the last writes keep (this run of the daemon's
        or an earlier one's)."""
        return sorted(device_irqs.holder(a) for a in irq_devices.held(self._devices_path))

    async def release(self, holder: str) -> None:
        """A device holder no allocation keeps: its interrupts follow the pool again (a
        give-back: written shortly after, with whatever comes meanwhile)."""
        self._want.pop(holder, None)
        self._have.pop(holder, None)
        self._released.add(holder)
        self._start()

    async def set_cpus(self, holder: str, cpus: CPUSet) -> None:
        """The holder's CPUs = ``cpus``: written before this returns when the holder loses a
        CPU it has, or may have, now; soon after otherwise."""
        await self.set_many({holder: cpus})

    async def set_many(self, wants: Mapping[str, CPUSet]) -> None:
        """Several holders at once: one write when any of them must wait."""
        if unknown := {h for h in wants if not is_kernel(h)}:
            raise IsolationFailed(f"unknown kernel holder {sorted(unknown)!r}")
        self._want.update(wants)
        self._released -= set(wants)
        if all(self._gives_back(h, c) for h, c in wants.items()):
            self._start()
            return
        await self._written()

    def _gives_back(self, holder: str, cpus: CPUSet) -> bool:
        """Whether ``cpus`` takes nothing the holder has, or may have once the write in flight
        is done."""
        have, flying = self._have.get(holder), self._flying.get(holder, CPUSet())
        return have is not None and cpus >= have | flying

    async def settle(self) -> None:
        """Wait until what was asked for is written (isolation switched off, shutdown)."""
        if self._todo() or self._released:
            await self._written()

    async def _written(self) -> None:
        """Wait for a write that starts after now; its failure is raised here."""
        self._asked += 1
        done = asyncio.get_running_loop().create_future()
        self._waiters.append((self._asked, done))
        self._hurry.set()
        self._start()
        await done

    def _start(self) -> None:
        if self._writer is None or self._writer.done():
            hurry, self._hurry = self._hurry.is_set(), asyncio.Event()  # of this loop
            if hurry:
                self._hurry.set()
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())
            self._writer.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The writer stopped other than by finishing its work (cancelled at shutdown, or a
        bug): nobody may wait forever. (A writer that finished answered everyone up to then;
        a change after it started a writer of its own.)"""
        if task is self._writer and (task.cancelled() or task.exception()) and self._waiters:
            error = IsolationFailed("the interrupt writer stopped before this change was "
                                    "written")
            self._wake(self._asked, error)

    async def _write_loop(self) -> None:
        """One write at a time, each of the latest wanted CPUs, until nothing differs."""
        while True:
            if not self._todo() and not self._released:
                self._wake(self._asked, None)
                return
            if not self._hurry.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), self.GIVE_BACK_DELAY)
            self._hurry.clear()
            todo, number, released = self._todo(), self._asked, set(self._released)
            if not todo and not released:
                continue
            self._flying = todo
            try:
                await self._run(todo, released)
            except Exception as exc:  # a job that timed out, a lost bus: the same as a refusal
                error = exc if isinstance(exc, CPUServiceError) else IsolationFailed(
                    f"writing {', '.join(todo)} failed: {exc!r}")
                for holder in todo:
                    self._have.pop(holder, None)  # partly written, perhaps
                if not self._wake(number, error):
                    log.error("giving CPUs back to %s failed (%s); trying again in %.0f s",
                              ", ".join(todo), error, self.RETRY_SECONDS)
                # changes asked for meanwhile are written at once; otherwise what is still
                # owed (a give-back) is tried again after a while, or at the next change
                if not self._waiters:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._hurry.wait(), self.RETRY_SECONDS)
                continue
            finally:
                self._flying = {}
            self._have.update(todo)
            self._released -= released - set(self._want)
            self._wake(number, None)

    def _todo(self) -> dict[str, CPUSet]:
        return {h: c for h, c in sorted(self._want.items()) if self._have.get(h) != c}

    def _wake(self, number: int, error: Exception | None) -> bool:
        """Answer the changes up to ``number``; whether there was one."""
        woken = [f for n, f in self._waiters if n <= number]
        self._waiters = [(n, f) for n, f in self._waiters if n > number]
        for future in woken:
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        return bool(woken)

    async def _run(self, todo: dict[str, CPUSet], released: set[str] | None = None) -> None:
        """One oneshot that writes ``todo`` (the holders, devices' too, that changed), and the
        devices ``released``, and reports each."""
        self.writes += 1
        unit = f"cpuservice-kernel-{self._tag}-{self.writes}.service"
        args = []
        for holder in KERNEL_HOLDERS:
            cpus = todo.get(holder)
            args += (["-", "-", "-"] if cpus is None else
                     [hex_mask(cpus), cpus.format(), str(self._report_path(holder))])
        devices = irq_devices.wants(self._want, todo, released or set(), IRQS)
        args += irq_devices.args(self._devices_path, self._want.get(IRQS), devices)
        # systemd expands $NAME and ${NAME} in ExecStart= (also over D-Bus): $$ is a plain $
        argv = ["/bin/sh", "-c", SET_KERNEL.replace("$", "$$"), "sh", *args]
        what = ", ".join(f"{h.split(':', 1)[1]} on CPUs {c.format()}" for h, c in todo.items()) \
            or "device interrupts given back"
        props: dict[str, tuple[str, Any]] = {
            "Description": ("s", f"cpuservice: {what}"),
            "Type": ("s", "oneshot"),
            "ExecStart": ("a(sasb)", [[argv[0], argv, False]]),
            "CollectMode": ("s", "inactive-or-failed"),
        }
        try:
            await self.systemd.start_transient(unit, props)
        except CPUServiceError as exc:
            raise IsolationFailed(f"setting the {what} failed: {exc}") from None
        cpus = todo.get(IRQS)
        if cpus is not None:
            try:
                done = json.loads(self._report_path(IRQS).read_text())
                self.report = Report(cpus, sorted(done["confined"]), sorted(done["unmovable"]),
                                     pending=pending_moves(done.get("effective", {}), cpus),
                                     devices=self.report.devices)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                self.report = Report(cpus, devices=self.report.devices)
            self.report.irqbalance = self.irqbalance.ban(cpus)
            log.info("IRQs on %s: %d confined, unmovable %s, moved at their next arrival %s%s",
                     cpus.format(), len(self.report.confined), self.report.unmovable or "none",
                     self.report.pending or "none",
                     "; irqbalance told" if self.report.irqbalance else "")
        if devices is not None:
            self._devices_written(devices)

    def _devices_written(self, devices: irq_devices.Wants) -> None:
        reports = irq_devices.written(self._devices_path, devices, self.report.devices,
                                      pending_moves)
        self.report = Report(self.report.cpus, self.report.confined, self.report.unmovable,
                             self.report.irqbalance, self.report.pending, reports)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise IsolationFailed(f"cannot write {path}: {exc.strerror}") from None


def main(argv: list[str]) -> int:
    """What systemd runs for the daemon, and the Debian package's prerm:
    ``set irqs|workqueues CPU-LIST [REPORT]`` and ``release irqs|workqueues`` (every online
    CPU; irqbalance's ban cleared)."""
    if len(argv) >= 2 and argv[0] == "release" and f"kernel:{argv[1]}" in KERNEL_HOLDERS:
        cpus_text, report_path = Path("/sys/devices/system/cpu/online").read_text(), None
    elif len(argv) in (3, 4) and argv[0] == "set" and f"kernel:{argv[1]}" in KERNEL_HOLDERS:
        cpus_text, report_path = argv[2], (argv[3] if len(argv) == 4 else None)
    else:
        print("usage: python3 -m cpuservice.host.irqs set irqs|workqueues CPU-LIST [REPORT] | "
              "release irqs|workqueues", file=sys.stderr)
        return 2
    cpus = CPUSet.parse(cpus_text.strip())
    try:
        if argv[1] == "irqs":
            report = write_irqs(Path("/proc/irq"), cpus)
            if argv[0] == "release":
                Irqbalance().ban(cpus)
        else:
            _write(Path("/sys/devices/virtual/workqueue/cpumask"), hex_mask(cpus))
            report = Report(cpus)
    except IsolationFailed as exc:
        print(f"cpuservice.host.irqs: {exc}", file=sys.stderr)
        return 1
    if report_path:
        out = {"cpus": cpus.format(), "confined": report.confined,
               "unmovable": report.unmovable}
        tmp = Path(f"{report_path}.tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, report_path)
    print(f"{argv[1]} on {cpus.format()}: {len(report.confined)} confined, unmovable "
          f"{report.unmovable or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
