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
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .cpuset import CPUSet
from .errors import CPUServiceError

if TYPE_CHECKING:
    from .engine import SystemdAPI
    from .reconcile import Props

log = logging.getLogger(__name__)
IRQS = "kernel:irqs"
WORKQUEUES = "kernel:workqueues"
KERNEL_HOLDERS = (IRQS, WORKQUEUES)


class IsolationFailed(CPUServiceError):
    """The kernel refused the interrupt or workqueue affinity as a whole."""

    dbus_name = "org.cpuservice1.Error.IsolationFailed"


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


class Kernel:
    """The daemon's side: it may not write /proc/irq or /sys itself (its unit keeps
    ProtectKernelTunables=yes), so it has systemd run ``python3 -m cpuservice.irqs set ...`` as
    a short oneshot service for each change and waits for it; the oneshot writes its report
    beside the checkpoint. irqbalance is told from here (its socket is in /run)."""

    def __init__(self, systemd: SystemdAPI, state_dir: str | Path,
                 irqbalance: Irqbalance | None = None) -> None:
        self.systemd = systemd
        self.state_dir = Path(state_dir)
        self.irqbalance = irqbalance if irqbalance is not None else Irqbalance()
        self.report = Report()
        self._runs = 0
        self._tag = os.urandom(4).hex()

    def _report_path(self, holder: str) -> Path:
        return self.state_dir / f"{holder.split(':')[1]}-report.json"

    async def get_cpus(self, holder: str) -> CPUSet | None:
        """What the last run here set (None: unknown, the next change writes it anyway)."""
        try:
            return CPUSet.parse(json.loads(self._report_path(holder).read_text())["cpus"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    async def set_cpus(self, holder: str, cpus: CPUSet) -> None:
        if holder not in KERNEL_HOLDERS:
            raise IsolationFailed(f"unknown kernel holder {holder!r}")
        what = holder.split(":")[1]
        self._runs += 1
        unit = f"cpuservice-{what}-{self._tag}-{self._runs}.service"
        report = self._report_path(holder)
        script = SET_IRQS if holder == IRQS else SET_WORKQUEUES
        # systemd expands $NAME and ${NAME} in ExecStart= (also over D-Bus): $$ is a plain $
        argv = ["/bin/sh", "-c", script.replace("$", "$$"), "sh", hex_mask(cpus), cpus.format(),
                str(report)]
        props: Props = {
            "Description": ("s", f"cpuservice: {what} on CPUs {cpus.format()}"),
            "Type": ("s", "oneshot"),
            "ExecStart": ("a(sasb)", [[argv[0], argv, False]]),
            "CollectMode": ("s", "inactive-or-failed"),
        }
        try:
            await self.systemd.start_transient(unit, props)
        except CPUServiceError as exc:
            raise IsolationFailed(f"setting the {what} affinity failed: {exc}") from None
        if holder == IRQS:
            try:
                done = json.loads(report.read_text())
                self.report = Report(cpus, sorted(done["confined"]), sorted(done["unmovable"]))
            except (OSError, ValueError, KeyError, TypeError):
                self.report = Report(cpus)
            self.report.irqbalance = self.irqbalance.ban(cpus)
            log.info("IRQs on %s: %d confined, unmovable %s%s", cpus.format(),
                     len(self.report.confined), self.report.unmovable or "none",
                     "; irqbalance told" if self.report.irqbalance else "")


# What the oneshot runs ($1 hex mask, $2 cpu list, $3 report): a shell starts in milliseconds,
# where a Python interpreter takes seconds under emulation. An IRQ whose affinity the kernel
# will not set (managed, per-CPU) is listed as unmovable; one that vanished is skipped.
SET_IRQS = r"""
echo "$1" > /proc/irq/default_smp_affinity || exit 1
ok= no=
for d in /proc/irq/[0-9]*; do
    n=${d#/proc/irq/}
    if echo "$2" > "$d/smp_affinity_list" 2>/dev/null; then ok="$ok,$n"
    elif [ -e "$d" ]; then no="$no,$n"; fi
done
printf '{"cpus":"%s","confined":[%s],"unmovable":[%s]}' "$2" "${ok#,}" "${no#,}" > "$3.tmp"
mv "$3.tmp" "$3"
"""
SET_WORKQUEUES = r"""
echo "$1" > /sys/devices/virtual/workqueue/cpumask || exit 1
printf '{"cpus":"%s"}' "$2" > "$3.tmp" && mv "$3.tmp" "$3"
"""


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise IsolationFailed(f"cannot write {path}: {exc.strerror}") from None


class Irqbalance:
    """irqbalance's runtime control socket: the banned CPUs are everything outside the pool.

    irqbalance 1.9.2 (Debian 12) listens on /run/irqbalance/irqbalance<PID>.sock (stream, one
    command per connection, root only: the kernel passes our uid), takes ``settings cpus
    <cpu-list>`` (``NULL`` clears it; it overrides its own ban of isolated and nohz_full CPUs,
    which are outside the pool anyway), sends no reply, and applies it at its next rescan, up
    to 30 s later, while its socket does not accept meanwhile. So the daemon writes the
    affinities itself at once, and a command that could not be delivered is sent again, the
    latest one, every second until irqbalance takes it."""

    RETRY_SECONDS = 1.0

    def __init__(self, run_dir: str = "/run/irqbalance") -> None:
        self.run_dir = Path(run_dir)
        self._latest: str | None = None
        self._retry: asyncio.Task[None] | None = None

    def sockets(self) -> list[str]:
        """Paths (or abstract names, with a leading NUL) of running irqbalance daemons."""
        try:
            return [str(p) for p in self.run_dir.glob("irqbalance*.sock")]
        except OSError:
            return []

    def ban(self, pool: CPUSet) -> bool:
        """Tell every running irqbalance to keep interrupts on ``pool`` (now, or soon through
        the retry); whether one runs."""
        paths = self.sockets()
        if not paths:
            return False
        banned = _all_cpus() - pool
        self._latest = f"settings cpus {banned.format() or 'NULL'}"
        if not self._send(paths, self._latest) and (self._retry is None or self._retry.done()):
            with contextlib.suppress(RuntimeError):  # no loop: nothing to wait for
                self._retry = asyncio.get_running_loop().create_task(self._again())
        return True

    def _send(self, paths: list[str], command: str) -> bool:
        sent = True
        for path in paths:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(0.2)
                    s.connect(path)
                    s.sendall(command.encode())  # one write, no newline
            except OSError as exc:
                log.info("irqbalance at %s busy (%s): %r follows", path, exc, command)
                sent = False
        return sent

    async def _again(self) -> None:
        """Send the latest command again every second until every running irqbalance took it
        (or none runs any more)."""
        while True:
            await asyncio.sleep(self.RETRY_SECONDS)
            paths = self.sockets()
            if self._latest is None or not paths or self._send(paths, self._latest):
                return


def _all_cpus() -> CPUSet:
    try:
        return CPUSet.parse(Path("/sys/devices/system/cpu/possible").read_text())
    except (OSError, ValueError):
        return CPUSet(range(os.cpu_count() or 1))


def main(argv: list[str]) -> int:
    """What systemd runs for the daemon, and the Debian package's prerm:
    ``set irqs|workqueues CPU-LIST [REPORT]`` and ``release irqs|workqueues`` (every online
    CPU; irqbalance's ban cleared)."""
    if len(argv) >= 2 and argv[0] == "release" and f"kernel:{argv[1]}" in KERNEL_HOLDERS:
        cpus_text, report_path = Path("/sys/devices/system/cpu/online").read_text(), None
    elif len(argv) in (3, 4) and argv[0] == "set" and f"kernel:{argv[1]}" in KERNEL_HOLDERS:
        cpus_text, report_path = argv[2], (argv[3] if len(argv) == 4 else None)
    else:
        print("usage: python3 -m cpuservice.irqs set irqs|workqueues CPU-LIST [REPORT] | "
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
        print(f"cpuservice.irqs: {exc}", file=sys.stderr)
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
