"""irqbalance's runtime control: the CPUs it must leave alone (everything outside the shared
pool), told through its socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

from cpuservice.model.cpuset import CPUSet

log = logging.getLogger(__name__)


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
