"""VM lab scenario: podman containers on allocated CPUs, the three ways people start them
(docs/guides/podman.md's "Containers" recipes are these commands; their containers' PID 1 ends
on SIGTERM, so no stop waits out systemd's 90 s, and the attached one ends once it has been
seen). For each, the container's main process: its Cpus_allowed_list and its cgroup, which must
be the allocation's CPUs and a child of its unit. Prints lines starting with ``RESULT `` (JSON); a
failed check prints ``FAILED STEP: ...`` and exits 1.

    python3 containers.py setup|parent|run|service
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

IMAGE = "localhost/bb:1"
# a container's PID 1 that ends on SIGTERM: one that ignores it, as sleep does as PID 1, is
# killed only after systemd's 90 s stop timeout, so releasing an allocation (which stops its
# slice) or stopping a service would take that long
WAITS = "sh -c 'trap \"exit 0\" TERM; sleep 600 & wait'"
STORAGE = """[storage]
driver = "vfs"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
"""


def fail(what: str) -> None:
    print(f"FAILED STEP: {what}", flush=True)
    raise SystemExit(1)


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def sh(command: str, timeout: float = 120, check: bool = True) -> str:
    out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        fail(f"{command} (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    return out.stdout.strip()


def until(what: str, check: Callable[[], Any], seconds: float = 30) -> Any:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    fail(f"{what} (not within {seconds} s)")


def cpus(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def show(name: str, prop: str) -> str:
    return sh(f"cpuservicectl --no-pager show {name} -p {prop} --value")


def held(name: str) -> bool:
    return name in sh("cpuservicectl --no-pager list --no-legend", check=False)


def container(name: str) -> dict[str, Any]:
    """The container's main process: pid, cgroup, allowed CPUs."""
    pid = until(f"container {name} running",
                lambda: sh(f"podman inspect -f '{{{{.State.Pid}}}}' {name}", check=False)
                not in ("", "0") and sh(f"podman inspect -f '{{{{.State.Pid}}}}' {name}"))
    cgroup = Path(f"/proc/{pid}/cgroup").read_text().strip().split(":", 2)[2]
    status = Path(f"/proc/{pid}/status").read_text()
    allowed = next(line.split()[1] for line in status.splitlines()
                   if line.startswith("Cpus_allowed_list"))
    return {"pid": int(pid), "cgroup": cgroup, "allowed": cpus(allowed)}


def cgroup_of(unit: str) -> str:
    return sh(f"systemctl show {unit} -p ControlGroup --value")


def placed(check: str, name: str, allocation: str, unit: str) -> dict[str, Any]:
    """The container against its allocation: same CPUs, a cgroup below the unit's."""
    c = container(name)
    want, parent = cpus(show(allocation, "CPUSet")), cgroup_of(unit)
    result(check=check, allocation=want, unit=unit, unit_cgroup=parent, **c)
    if c["allowed"] != want:
        fail(f"{check}: the container runs on {c['allowed']}, the allocation is {want}")
    if not c["cgroup"].startswith(parent + "/"):
        fail(f"{check}: the container's cgroup {c['cgroup']} is not below {parent}")
    return c


def setup() -> None:
    """podman on this VM's ext4 root without the overlay module: the vfs driver; a local image
    of busybox-static (no registry, no network)."""
    Path("/etc/containers").mkdir(exist_ok=True)
    Path("/etc/containers/storage.conf").write_text(STORAGE)
    root = Path("/tmp/bb/bin")
    root.mkdir(parents=True, exist_ok=True)
    sh(f"cp /bin/busybox {root}/")
    for applet in ("sh", "sleep", "cat", "grep"):
        (root / applet).symlink_to("busybox")
    began = time.monotonic()
    sh(f"tar -C /tmp/bb -c . | podman import -q - {IMAGE}", timeout=300)
    result(check="setup", podman=sh("podman --version"), import_s=round(time.monotonic() - began,
                                                                          1))


def parent() -> None:
    """1. cpuservicectl allocate, then podman run --cgroup-parent=<the allocation's slice>;
    what --cpuset-cpus does on top; hotplug repair reaching the container; release."""
    sh("cpuservicectl --no-pager allocate web 2 --bind -q")
    unit = show("web", "Unit")
    sh(f"podman run -d --name web --network none --cgroup-parent={unit} {IMAGE} {WAITS}")
    placed("parent", "web", "web", unit)
    mine = cpus(show("web", "CPUSet"))
    online = cpus(Path("/sys/devices/system/cpu/online").read_text())
    other = next(c for c in online if c not in mine)
    seen = {}
    for label, cpu in (("inside", mine[-1]), ("outside", other)):
        sh(f"podman run -d --name web-{label} --network none --cgroup-parent={unit} "
           f"--cpuset-cpus={cpu} {IMAGE} {WAITS}")
        seen[label] = {"asked": cpu, **container(f"web-{label}")}
    result(check="cpuset-cpus", allocation=mine, **seen)
    victim = max(c for c in mine if c != 0)
    Path(f"/sys/devices/system/cpu/cpu{victim}/online").write_text("0")
    after = until("the allocation repaired after its CPU went offline",
                  lambda: (now := cpus(show("web", "CPUSet"))) != mine and victim not in now
                  and now)
    followed = until("the container follows the repair",
                     lambda: container("web")["allowed"] == after and container("web"))
    result(check="repair", before=mine, offline=victim, after=after, **followed)
    Path(f"/sys/devices/system/cpu/cpu{victim}/online").write_text("1")
    began = time.monotonic()
    sh("cpuservicectl --no-pager release web", timeout=200)
    took = round(time.monotonic() - began, 1)
    state = until("the container stopped with its allocation",
                  lambda: sh("podman inspect -f '{{.State.Status}}' web") != "running"
                  and sh("podman inspect -f '{{.State.Status}}' web"), 60)
    result(check="released", status=state, held=held("web"), release_s=took)
    sh("podman rm -f web web-inside web-outside", check=False)


def run() -> None:
    """2. cpuservice-run -- podman run: attached, detached, and a refused option."""
    # the attached container runs until it has been seen (not for a fixed time): it ends when
    # /run/job-go/done appears (a bind mount in it)
    go = Path("/run/job-go")
    go.mkdir(exist_ok=True)
    wrapper = subprocess.Popen(
        ["cpuservice-run", "--cpus", "2", "--bind", "--name", "job", "--", "podman", "run",
         "--rm", "--name", "job", "--network", "none", "-v", f"{go}:/go", IMAGE, "sh", "-c",
         "while [ ! -e /go/done ]; do sleep 0.2; done"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    unit = until("the allocation of cpuservice-run", lambda: held("job") and show("job", "Unit"))
    placed("run", "job", "job", unit)
    (go / "done").touch()
    out, _ = wrapper.communicate(timeout=120)
    until("job released after its container ended", lambda: not held("job"))
    result(check="run-ended", exit=wrapper.returncode, output=out[-300:])
    began = time.monotonic()
    sh(f"cpuservice-run --cpus 1 --bind --name batch -- podman run -d --name batch "
       f"--network none {IMAGE} {WAITS}")
    returned = round(time.monotonic() - began, 1)
    placed("detached", "batch", "batch", show("batch", "Unit"))
    sh("podman stop -t 1 batch")
    until("batch released after its detached container stopped", lambda: not held("batch"))
    result(check="detached-ended", returned_s=returned)
    refused = subprocess.run(
        ["cpuservice-run", "--cpus", "1", "--bind", "--name", "pinned", "--", "podman", "run",
         "--rm", "--cpuset-cpus=0", "--network", "none", IMAGE, "true"],
        capture_output=True, text=True, timeout=60)
    result(check="refused", exit=refused.returncode, stderr=refused.stderr.strip(),
           held=held("pinned"))
    sh("podman rm -f batch", check=False)


def service() -> None:
    """3. A container run as a systemd service (podman generate systemd --new, with
    --cgroups=split so that the container stays in the service's cgroup), allocated with
    unit=; the container follows, also after the service restarts."""
    sh(f"podman create --name db --network none {IMAGE} {WAITS}")
    sh("podman generate systemd --new --name db "
       "| sed 's/--cgroups=no-conmon/--cgroups=split/' > /etc/systemd/system/container-db.service")
    sh("systemctl daemon-reload && systemctl start container-db.service", timeout=180)
    sh("cpuservicectl --no-pager allocate db 2 --bind --unit container-db.service -q")
    first = placed("service", "db", "db", "container-db.service")
    sh("systemctl restart container-db.service", timeout=180)
    until("the restarted service's container", lambda: container("db")["pid"] != first["pid"])
    placed("service-restarted", "db", "db", "container-db.service")
    sh("cpuservicectl --no-pager release db")
    sh("systemctl stop container-db.service", timeout=180)


if __name__ == "__main__":
    {"setup": setup, "parent": parent, "run": run, "service": service}[sys.argv[1]]()
