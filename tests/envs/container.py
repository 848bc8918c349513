"""Container host: this machine's own OS booted under systemd-nspawn on a throwaway overlay of /.

Real systemd as PID 1, the real system dbus-daemon and polkitd; the checkout is bound in at the
same path. Everything it creates (processes, mounts, cgroup directories) is removed by stop().

    python -m tests.envs.container shell     # boot one, open a shell in it, tear it down after
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

CHECKOUT = Path(__file__).resolve().parents[2]


class ContainerError(RuntimeError):
    pass


def cgroup_roots(mountinfo: str | None = None) -> dict[str, tuple[Path, str]]:
    """Where the cgroup hierarchies that nspawn writes to are mounted, as (mount point, the
    cgroup path at that point): the unified one (cgroup v2), keyed "" as /proc/self/cgroup keys
    it, and a named systemd one (v1), "name=systemd". A pure cgroup v2 host (Debian 13, the VM
    lab) has only the first, at /sys/fs/cgroup; a hybrid one (this project's build machines)
    both, at /sys/fs/cgroup/unified and /sys/fs/cgroup/systemd."""
    text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    roots: dict[str, tuple[Path, str]] = {}
    for line in text.splitlines():
        before, _, after = line.partition(" - ")
        fields, (fstype, _source, options, *_) = before.split(), after.split()
        if fstype == "cgroup2":
            key = ""
        elif fstype == "cgroup" and "name=systemd" in options.split(","):
            key = "name=systemd"
        else:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        roots.setdefault(key, (Path(point), fields[3]))
    return roots


def _own_cgroup_dirs(cgroup: str | None = None, mountinfo: str | None = None) -> list[Path]:
    """The cgroup directories this process lives in (where nspawn puts payload/, supervisor/),
    in each hierarchy of cgroup_roots()."""
    text = Path("/proc/self/cgroup").read_text() if cgroup is None else cgroup
    roots = cgroup_roots(mountinfo)
    dirs = []
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers not in roots:
            continue
        point, mounted = roots[controllers]
        below = os.path.relpath(path, mounted)
        if below != ".." and not below.startswith("../"):
            dirs.append(Path(os.path.normpath(point / below)))
    return dirs


def _cgroup_tree() -> set[Path]:
    found: set[Path] = set()
    for top in _own_cgroup_dirs():
        for root, subdirs, _ in os.walk(top):
            found.update(Path(root, d) for d in subdirs)
    return found


class ContainerHost:
    """One booted container; use as a context manager or call start()/stop()."""

    def __init__(self, name: str = "cpuservice-test", binds: Sequence[Path] = (CHECKOUT,)):
        self.name = name
        self.binds = list(binds)
        self.base: Path | None = None
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.nspawn_pid = 0
        self.pid1 = 0
        self.boot_seconds = 0.0
        self._cgroups_before: set[Path] = set()
        self._mounts: list[Path] = []
        self._log: IO[bytes] | None = None

    @property
    def root(self) -> Path:
        """The container's root as this host sees it (through PID 1's mount namespace)."""
        return Path(f"/proc/{self.pid1}/root")

    @property
    def bus_address(self) -> str:
        """The container's system bus, reachable from the host."""
        return f"unix:path={self.root}/run/dbus/system_bus_socket"

    def start(self, timeout: float = 60) -> ContainerHost:
        began = time.monotonic()
        self._cgroups_before = _cgroup_tree()
        self.base = Path(tempfile.mkdtemp(prefix="cpuservice-ct-", dir="/var/tmp"))
        upper, root = self.base / "t", self.base / "root"
        upper.mkdir()
        root.mkdir()
        try:
            self._mount(["-t", "tmpfs", "tmpfs", str(upper)], upper)
            (upper / "up").mkdir()
            (upper / "work").mkdir()
            self._mount(["-t", "overlay", "overlay", "-o",
                         f"lowerdir=/,upperdir={upper}/up,workdir={upper}/work", str(root)], root)
            (root / "etc/hostname").write_text(self.name + "\n")
            self._log = open(self.base / "nspawn.log", "wb")  # noqa: SIM115 - closed by stop()
            self.nspawn = subprocess.Popen(
                ["systemd-nspawn", "-D", str(root), "-b", "--register=no", "--keep-unit",
                 "--link-journal=no", "-M", self.name, "--console=pipe",
                 *[f"--bind={b}" for b in self.binds]],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.nspawn_pid = self.nspawn.pid
            self._wait_running(began + timeout)
        except BaseException:
            self.stop()
            raise
        self.boot_seconds = time.monotonic() - began
        return self

    def _mount(self, args: list[str], target: Path) -> None:
        subprocess.run(["mount", *args], check=True)
        self._mounts.append(target)

    def _wait_running(self, deadline: float) -> None:
        assert self.nspawn is not None
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited: {self.log_tail()}")
            if not self.pid1:
                self.pid1 = self._find_pid1()
            if self.pid1:
                state = self.run(["systemctl", "is-system-running"], check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.05)
        raise ContainerError(f"container did not boot in time: {self.log_tail()}")

    def _find_pid1(self) -> int:
        for task in Path(f"/proc/{self.nspawn_pid}/task").glob("*/children"):
            for child in task.read_text().split():
                if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                    return int(child)
        return 0

    def log_tail(self) -> str:
        if self.base is None or not (self.base / "nspawn.log").exists():
            return ""
        return (self.base / "nspawn.log").read_text(errors="replace")[-2000:]

    def run(
        self, argv: Sequence[str], check: bool = True, timeout: float = 120, **kw: object
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the container (all its namespaces)."""
        result = subprocess.run(
            ["nsenter", "-t", str(self.pid1), "-a", *argv],
            capture_output=True, text=True, timeout=timeout, **kw,  # type: ignore[call-overload]
        )
        if check and result.returncode != 0:
            raise ContainerError(
                f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result  # type: ignore[no-any-return]

    def _running(self) -> bool:
        if self.nspawn is not None:
            return self.nspawn.poll() is None
        try:
            stat = Path(f"/proc/{self.nspawn_pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return bool(self.nspawn_pid) and stat.rsplit(")", 1)[1].split()[0] != "Z"

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._running()

    def stop(self, timeout: float = 30) -> None:
        """Power off, end nspawn (by PID, if it lingers), unmount, remove its cgroup dirs."""
        if self.nspawn_pid and self._running():
            if self.pid1:
                with contextlib.suppress(Exception):
                    self.run(["systemctl", "poweroff", "--no-block"], check=False, timeout=10)
            if not self._wait_gone(timeout):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.nspawn_pid, signal.SIGKILL)
                self._wait_gone(10)
        if self.nspawn is not None:
            self.nspawn.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        for target in reversed(self._mounts):
            subprocess.run(["umount", str(target)], check=False)
        self._mounts.clear()
        if self.base is not None:
            for d in (self.base / "t", self.base / "root"):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                (self.base / "nspawn.log").unlink()
                self.base.rmdir()
        for leftover in sorted(_cgroup_tree() - self._cgroups_before, key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                leftover.rmdir()
        self.pid1 = self.nspawn_pid = 0

    def detach(self, state_file: Path) -> None:
        """Leave the container running; attach(state_file) finds it again (to stop it)."""
        state = {"name": self.name, "nspawn_pid": self.nspawn_pid, "pid1": self.pid1,
                 "base": str(self.base), "mounts": [str(m) for m in self._mounts],
                 "cgroups_before": sorted(str(c) for c in self._cgroups_before)}
        state_file.write_text(json.dumps(state))
        if self._log is not None:
            self._log.close()
            self._log = None
        self.nspawn = None

    @classmethod
    def attach(cls, state_file: Path) -> ContainerHost:
        state = json.loads(state_file.read_text())
        host = cls(state["name"])
        host.nspawn_pid, host.pid1 = state["nspawn_pid"], state["pid1"]
        host.base = Path(state["base"])
        host._mounts = [Path(m) for m in state["mounts"]]
        host._cgroups_before = {Path(c) for c in state["cgroups_before"]}
        return host

    def __enter__(self) -> ContainerHost:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def booted(name: str = "cpuservice-test") -> Iterator[ContainerHost]:
    with ContainerHost(name) as host:
        yield host


def main(argv: Sequence[str]) -> int:
    if argv[:1] != ["shell"]:
        print(__doc__)
        return 2
    with booted("cpuservice-shell") as host:
        print(f"booted in {host.boot_seconds:.1f} s; PID 1 is {host.pid1}; exit the shell to stop")
        return subprocess.call(["nsenter", "-t", str(host.pid1), "-a", "bash", "-l"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
