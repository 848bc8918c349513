"""cpuservicectl and cpuservice-run against the real bus API (cpuservice.bus, the real
service code) on a private dbus-daemon, with the in-memory systemd of tests.unit.fake_systemd:
no root, no container. Output modes, JSON nulls, show -p/--value, status, watch, the one-call
reads, errors that name the fix; terminal behaviour (colour, pager, ASCII) in a real
pseudo-terminal."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuservice.bus.api import BUS_NAME
from cpuservice.model import config as config_mod
from cpuservice.model.fixtures import write_sysfs
from tests.conftest import unavailable
from tests.envs import privbus

ROOT = Path(__file__).parents[2]


class PrivateService:
    """dbus-daemon --session on a socket of its own, and the service serving on it."""

    def __init__(self, tmp: Path) -> None:
        if shutil.which("dbus-daemon") is None:
            unavailable("dbus-daemon is not installed")
        self.socket = tmp / "bus"
        self.address = f"unix:path={self.socket}"
        self.daemon = subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", "--nopidfile", f"--address={self.address}"],
            stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            assert time.monotonic() < deadline, "dbus-daemon did not start"
            time.sleep(0.02)
        cfg = config_mod.validate({"sysfs_root": str(write_sysfs(tmp / "sys", "b")),
                                   "state_file": str(tmp / "state" / "state.json")})
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.error: BaseException | None = None

        async def serve() -> None:
            self.bus, _, self.manager = await privbus.serve(self.address, cfg)

        def thread() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(serve())
            except BaseException as exc:  # reported by the fixture
                self.error = exc
            ready.set()
            if self.error is None:
                self.loop.run_forever()

        self.thread = threading.Thread(target=thread, daemon=True)
        self.thread.start()
        ready.wait(30)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.bus.disconnect)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.daemon.terminate()
        self.daemon.wait(10)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), **extra}

    def ctl(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cpuservice.cli.ctl", "--bus-address", self.address, *args],
            capture_output=True, text=True, env=self.env(**env), timeout=60)


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[PrivateService]:
    s = PrivateService(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def on_pty(argv: list[str], env: dict[str, str], answer: bytes = b"",
           seconds: float = 30) -> str:
    """Run argv on a new pseudo-terminal; everything it wrote there."""
    pid, fd = pty.fork()
    if pid == 0:  # child
        os.execvpe(argv[0], argv, env)
    out = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            if answer:
                os.write(fd, answer)
                answer = b""
    os.waitpid(pid, 0)
    os.close(fd)
    return out.decode(errors="replace").replace("\r\n", "\n")


def test_json_modes_and_nulls(svc: PrivateService) -> None:
    made = svc.ctl("allocate", "web", "2", "--bind", "-o", "json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["CPUSet"] == "0,8"
    assert "\n" not in svc.ctl("list", "--json=short").stdout.strip()
    pretty = svc.ctl("list", "--json=pretty").stdout
    assert pretty.startswith("[\n  {")
    rows = json.loads(svc.ctl("-j", "list").stdout)
    assert [r["Name"] for r in rows] == ["web"]
    assert rows[0]["CPUQuotaPerSecUSec"] is None  # not 18446744073709551615
    assert svc.ctl("list", "--json=off").stdout.startswith("NAME")
    assert json.loads(svc.ctl("capacity", "1", "-j").stdout) == {"capacity": None,
                                                                 "unlimited": True}
    assert json.loads(svc.ctl("plan", "2", "-j").stdout)["fragment-cpu"] is None
    resized = json.loads(svc.ctl("resize", "web", "3", "-j").stdout)
    assert resized["CPUs"] == "3" and resized["CPUSet"] == "0-1,8"
    assert json.loads(svc.ctl("release", "web", "-j").stdout) == {"Name": "web",
                                                                  "Released": True}


def test_show_property_value_and_systemd_habits(svc: PrivateService) -> None:
    svc.ctl("allocate", "db", "1.5", "--bind")
    show = svc.ctl("show", "db").stdout
    assert "CPUQuotaPerSecUSec=1s 500ms" in show and "Bound=yes" in show
    assert svc.ctl("show", "db", "-p", "CPUSet", "--value").stdout == "0,8\n"
    assert svc.ctl("show", "db", "-p", "CPUs,Bound").stdout == "CPUs=1.5\nBound=yes\n"
    svc.ctl("allocate", "u", "1")
    assert svc.ctl("show", "u", "-p", "CPUQuotaPerSecUSec").stdout == \
        "CPUQuotaPerSecUSec=1s\n"
    bad = svc.ctl("show", "db", "-p", "Nope")
    assert bad.returncode == 2 and "no property Nope" in bad.stderr


def test_list_legend_quiet_and_user_names(svc: PrivateService) -> None:
    svc.ctl("allocate", "a", "1", "--bind")
    full = svc.ctl("list").stdout.splitlines()
    assert full[0].split()[-2:] == ["USER", "UNIT"] and "root(0)" in full[1]
    assert full[-1] == "1 allocation(s) listed."
    bare = svc.ctl("list", "--no-legend").stdout.splitlines()
    assert len(bare) == 1 and bare[0].startswith("a ")
    assert svc.ctl("allocate", "b", "1", "-q").stdout == ""


def test_status_pools_and_one_allocation(svc: PrivateService) -> None:
    svc.ctl("allocate", "web", "2", "--bind")
    pools = svc.ctl("status").stdout
    assert "16 CPUs online" in pools and "Exclusive: 0,8 (2)" in pools
    one = svc.ctl("status", "web").stdout
    assert one.startswith("web - 2 CPU(s), bound, active")
    assert "NUMA nodes: 0" in one and "Owner: root (0)" in one
    assert "Health: ok" in one and "Aligned: no (memory not restricted" in one
    # no systemd on this bus: the unit's state is unknown, and said so
    assert "Unit: cpuservice-bound-web.slice: unknown" in one
    js = json.loads(svc.ctl("status", "web", "-j").stdout)
    assert js["MemoryNodes"] == "0" and js["UnitState"] == {"LoadState": "unknown"}
    assert svc.ctl("status", "nope").returncode == 4


def test_reads_are_one_call(svc: PrivateService) -> None:
    if shutil.which("dbus-monitor") is None:
        unavailable("dbus-monitor is not installed")
    for i in range(5):
        svc.ctl("allocate", f"n{i}", "1")
    monitor = subprocess.Popen(["dbus-monitor", "--address", svc.address,
                                "type='method_call',destination='org.cpuservice1'"],
                               stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    svc.ctl("list")
    time.sleep(0.5)
    monitor.terminate()
    out, _ = monitor.communicate(10)
    calls = [line for line in out.splitlines() if line.startswith("method call")]
    assert len(calls) == 1 and "member=GetManagedObjects" in calls[0], calls


def test_watch_timestamps_property_changes_and_json(svc: PrivateService) -> None:
    cmd = [sys.executable, "-m", "cpuservice.cli.ctl", "--bus-address", svc.address, "watch"]
    text = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=svc.env())
    js = subprocess.Popen([*cmd, "-j"], stdout=subprocess.PIPE, text=True, env=svc.env())
    time.sleep(2)
    svc.ctl("allocate", "w", "1", "--bind")
    svc.ctl("resize", "w", "2")
    svc.ctl("release", "w")
    time.sleep(1)
    for p in (text, js):
        p.terminate()
    lines = text.communicate(10)[0].splitlines()
    events = [json.loads(line) for line in js.communicate(10)[0].splitlines()]
    assert lines[0] == "watching cpuservice; Ctrl-C to stop"
    date, clock, rest = lines[1].split(" ", 2)
    assert len(date) == 10 and len(clock) == 15
    assert rest == "AllocationAdded w /org/cpuservice1/allocation/w"
    body = [line.split(" ", 2)[2] for line in lines[1:]]
    assert any(b.startswith("PropertiesChanged w ") and "CPUs=2" in b for b in body), body
    assert any(b.startswith("PropertiesChanged Manager ") for b in body), body
    assert "AllocationRemoved w /org/cpuservice1/allocation/w" in body
    changed = [e for e in events if e["signal"] == "PropertiesChanged" and e["allocation"] == "w"]
    assert changed and changed[0]["changed"]["CPUs"] == "2"
    assert all(e["realtime_usec"] > 0 for e in events)


def test_export_nrt_json_yaml_and_watch(svc: PrivateService) -> None:
    """export nrt through the real Manager: the schema, YAML by default, and --watch printing
    once at the start and again within a second or two of a change (issue 28)."""
    from tests.schema import nrt_errors

    one = svc.ctl("export", "nrt", "--node-name", "w1", "-o", "json")
    assert one.returncode == 0, one.stderr
    obj = json.loads(one.stdout)
    assert nrt_errors(obj) == [] and obj["metadata"]["name"] == "w1"
    assert svc.ctl("export", "nrt").stdout.startswith("---\napiVersion: ")
    bad = svc.ctl("export", "nrt", "--node-name", "W_1")
    assert bad.returncode == 2 and "kubectl get nodes" in bad.stderr
    cmd = [sys.executable, "-m", "cpuservice.cli.ctl", "--bus-address", svc.address, "export",
           "nrt", "--watch", "-o", "json"]
    watch = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=svc.env())
    time.sleep(2)
    svc.ctl("allocate", "w", "2", "--bind")
    time.sleep(2)
    watch.terminate()
    objects = [json.loads(line) for line in watch.communicate(10)[0].splitlines()]
    assert len(objects) == 2 and all(nrt_errors(o) == [] for o in objects)
    counts = [next(a["value"] for a in o["attributes"]
                   if a["name"] == "cpuservice.io/bound-allocations") for o in objects]
    assert counts == ["0", "1"]


def test_errors_name_the_fix(svc: PrivateService, tmp_path: Path) -> None:
    nobody = svc.ctl("--bus-address", f"unix:path={tmp_path}/none", "status")
    assert nobody.returncode == 1 and "cannot reach the bus at" in nobody.stderr
    no_system = subprocess.run(
        [sys.executable, "-m", "cpuservice.cli.ctl", "status"], capture_output=True, text=True,
        env=svc.env(DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={tmp_path}/none"))
    assert no_system.returncode == 1 and "systemctl status dbus" in no_system.stderr
    svc.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(
        svc.bus.release_name(BUS_NAME)))
    time.sleep(0.5)
    gone = svc.ctl("status")
    assert gone.returncode == 1 and len(gone.stderr.splitlines()) == 1
    assert "cpuserviced is not running" in gone.stderr
    assert "systemctl status cpuservice" in gone.stderr


def test_terminal_colour_pager_and_ascii(svc: PrivateService) -> None:
    svc.ctl("allocate", "web", "2", "--bind")
    svc.ctl("allocate", "db", "1", "--bind")
    base = [sys.executable, "-m", "cpuservice.cli.ctl", "--bus-address", svc.address]
    env = svc.env(SYSTEMD_PAGER="sed s/^/PAGED:/", TERM="xterm", LANG="C.UTF-8")
    env.pop("NO_COLOR", None)
    paged = on_pty([*base, "topology"], env)
    assert "PAGED:Machine:" in paged
    assert "\033[1;34mcpu" in paged and "\033[1;31mcpu" in paged  # one colour each
    assert "└─" in paged
    unpaged = on_pty([*base, "topology", "--no-pager", "--no-color"], env)
    assert "PAGED:" not in unpaged and "\033[" not in unpaged
    piped = subprocess.run([*base, "topology"], capture_output=True, text=True, env=env)
    assert "PAGED:" not in piped.stdout and "\033[" not in piped.stdout
    ascii_env = {**env, "LANG": "C", "LC_ALL": "C"}
    ascii_out = on_pty([*base, "topology", "--no-pager"], ascii_env)
    assert "`- " in ascii_out and "└" not in ascii_out
