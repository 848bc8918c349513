"""cpuserviced installed as a real systemd service in the container host, driven with busctl."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpuservice.model.fixtures import write_sysfs
from tests.envs.container import CHECKOUT, ContainerHost

FIXTURES = "/srv/cpuservice-fixtures"
CONFIG = "/etc/cpuservice/cpuservice.toml"
STATE = "/var/lib/cpuservice/state.json"
DEST = ("org.cpuservice1", "/org/cpuservice1", "org.cpuservice1.Manager")


def eventually(check: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait until ``check()`` holds (the daemon acts on signals asynchronously)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    assert check()


class BusctlError(RuntimeError):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class ServiceHost:
    """The daemon inside one container, installed by scripts/install.sh (the package under
    /usr/local/lib/cpuservice, the shipped hardened unit); each configure() starts it afresh."""

    def __init__(self, container: ContainerHost) -> None:
        self.install(container)

    def install(self, container: ContainerHost) -> None:
        """Install the service into ``container`` with scripts/install.sh (again, when the tests
        booted a new one)."""
        self.c = container
        container.run(["bash", str(CHECKOUT / "scripts/install.sh")], timeout=300)

    def fixture(self, machine: str) -> str:
        path = f"{FIXTURES}/{machine}"
        if not (self.c.root / path.lstrip("/")).exists():
            write_sysfs(self.c.root / path.lstrip("/"), machine)
        return path

    def configure(self, machine: str | None = "a", wipe: bool = True, **settings: Any) -> None:
        """Stop the daemon and its units, write the config, start it again."""
        self.stop(wipe=wipe)
        if machine is not None:
            settings.setdefault("sysfs_root", self.fixture(machine))
        lines = []
        defaults = settings.pop("defaults", None)
        for key, value in settings.items():
            lines.append(f"{key} = {json.dumps(value)}")
        if defaults:
            lines.append("[defaults]")
            lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in defaults.items()]
        path = self.c.root / CONFIG.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        self.start()

    def start(self) -> None:
        result = self.c.run(["systemctl", "start", "cpuservice.service"], check=False)
        if result.returncode != 0:
            raise RuntimeError(f"cpuservice.service did not start: {self.journal()[-3000:]}")

    def stop(self, wipe: bool = False) -> None:
        self.c.run(["systemctl", "stop", "cpuservice.service"], check=False)
        self.c.run(["systemctl", "reset-failed", "cpuservice.service"], check=False)
        if wipe:
            self.c.run(["sh", "-c", "systemctl stop 'cpuservice-*.slice' 'cpuservice-*.scope';"
                        " systemctl reset-failed; rm -rf /var/lib/cpuservice"], check=False)

    def kill9(self) -> None:
        self.c.run(["systemctl", "kill", "-s", "KILL", "cpuservice.service"])
        for _ in range(100):
            state = self.c.run(["systemctl", "is-active", "cpuservice.service"],
                               check=False).stdout.strip()
            if state != "active":
                return
            time.sleep(0.05)

    def busctl(self, *args: str, check: bool = True, user: str | None = None) -> Any:
        """busctl in the container, as root or (``user``) as another user."""
        as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] \
            if user else []
        result = self.c.run([*as_user, "busctl", "--json=short", *args], check=False)
        if result.returncode != 0:
            if check:
                raise BusctlError(result.stderr.strip())
            return BusctlError(result.stderr.strip())
        lines = result.stdout.strip().splitlines()
        if not lines:
            return None
        return json.loads(lines[0]) if len(lines) == 1 else [json.loads(x) for x in lines]

    def call(self, member: str, signature: str = "", *args: str) -> list[Any]:
        out = self.busctl("call", *DEST, member, *([signature, *args] if signature else []))
        return out["data"] if out else []

    def error(self, member: str, signature: str = "", *args: str) -> str:
        """The error text of a call that must fail."""
        out = self.busctl("call", *DEST, member, *([signature, *args] if signature else []),
                          check=False)
        assert isinstance(out, BusctlError), f"{member} {args} succeeded: {out}"
        return out.text

    def prop(self, name: str, path: str = DEST[1], iface: str = DEST[2]) -> Any:
        return self.busctl("get-property", DEST[0], path, iface, name)["data"]

    def shares(self, path: str) -> dict[int, int]:
        """An allocation's Shares (busctl cannot print a{uu} as JSON)."""
        out = self.c.run(["busctl", "get-property", DEST[0], path, "org.cpuservice1.Allocation",
                          "Shares"]).stdout.split()
        numbers = [int(x) for x in out[2:]]
        return dict(zip(numbers[::2], numbers[1::2], strict=True))

    def allocate(self, name: str, cpus: str, **options: Any) -> str:
        sig = {bool: "b", str: "s"}
        flat: list[str] = [str(len(options))]
        for key, value in options.items():
            flat += [key.replace("_", "-"), sig[type(value)], str(value).lower()
                     if isinstance(value, bool) else str(value)]
        return str(self.call("Allocate", "ssa{sv}", name, cpus, *flat)[0])

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """systemctl show, with CPU lists in the cpu-list format (systemctl separates ranges
        with spaces)."""
        out = self.c.run(["systemctl", "show", unit, *[f"-p{p}" for p in props]]).stdout
        values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        for key in ("AllowedCPUs", "AllowedMemoryNodes", "EffectiveCPUs"):
            if key in values:
                values[key] = values[key].replace(" ", ",")
        return values

    def state_file(self) -> dict[str, Any]:
        """The checkpoint's payload (snapshot and journal), as the daemon would load it."""
        from cpuservice.host.checkpoint import Store

        return Store(self.state_path()).load() or {}

    def state_path(self) -> Path:
        return self.c.root / STATE.lstrip("/")

    def journal(self) -> str:
        return self.c.run(["journalctl", "-u", "cpuservice.service", "--no-pager", "-o", "cat"],
                          check=False).stdout
