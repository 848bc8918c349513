"""VM lab scenario: how each allocation fares, on a real kernel with cgroup v2 (issue 39). Prints
one JSON object per check on lines starting with ``RESULT ``; a failed check prints ``FAILED
STEP: ...`` and exits 1.

    python3 figures.py

With statistics_seconds = 1 and health_seconds = 2 (a drop-in, removed at the end):
- pressured: a bound allocation of one CPU runs four busy threads: its CPU pressure shows
  within seconds, and its Health becomes degraded with reason pressured;
- throttled: an unbound allocation of 0.2 CPU runs a busy loop: its quota throttles it, and
  Health says throttled;
- memory-remote: a service writes 128 MiB to tmpfs while it may only use one NUMA node, then a
  bound allocation with option memory-nodes on the other node is applied to it (option unit;
  the kernel migrates mapped pages when cpuset.mems changes, not page cache or shared memory):
  most of its memory is remote, and Health says memory-remote;
- ``cpuservicectl top -b -n 2`` shows the three, ``status`` the figures, and the metrics file
  has them, labelled by allocation.

Each busy second of the emulated VM costs the host a core, so memory-remote runs first, the two
loads run side by side only until their checks and the views are done, and the polling is
busctl's (a C program), not the Python command's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

DROPIN = Path("/etc/cpuservice/cpuservice.toml.d/50-figures.toml")
PROM = Path("/var/lib/prometheus/node-exporter/cpuservice.prom")
BUSY = "for i in 1 2 3 4; do (while :; do :; done) & done; wait"
TOUCH = ("import signal; open('/dev/shm/figmem', 'wb').write(b'\\x01' * (128 << 20)); "
         "open('/run/figmem.ready', 'w').close(); signal.pause()")
NAMES = ("figbusy", "figquota", "figmem")


def fail(what: str) -> None:
    print(f"FAILED STEP: {what}", flush=True)
    raise SystemExit(1)


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def sh(*argv: str, check: bool = True) -> str:
    out = subprocess.run(argv, capture_output=True, text=True)
    if check and out.returncode != 0:
        fail(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def status(name: str) -> dict:  # type: ignore[type-arg]
    return json.loads(sh("cpuservicectl", "status", name, "-j", "--no-pager"))


def looks(names: tuple[str, ...], health: bool = True) -> dict:  # type: ignore[type-arg]
    """Health, HealthReason, State, MemoryNodes and Statistics of the allocations ``names``:
    what ``cpuservicectl status -j`` shows of them, through busctl (a C program, quick to start
    in the emulated VM, where each Python start costs seconds of a busy core): GetStatistics
    for all, and with ``health`` one get-property for each. That makes one Get per name, so
    HealthReason is read before Health: a reason raised between the two reads then shows in
    both (read the other way round, a look once had Health "ok" beside HealthReason
    "pressured"), and nothing clears a reason within a look (health_seconds). (One GetAll per
    allocation would be one reply, but systemd 252's busctl --json fails, exit 1 and no
    message, on a bound allocation's Shares: a dict with integer keys.)"""
    stats = json.loads(sh("busctl", "--json=short", "call", "org.cpuservice1",
                          "/org/cpuservice1", "org.cpuservice1.Manager", "GetStatistics", "as",
                          str(len(names)), *names))["data"][0]
    out = {}
    for name in names:
        out[name] = {"Statistics": {k: v["data"] for k, v in stats.get(name, {}).items()}}
        if health:
            keys = ("HealthReason", "Health", "State", "MemoryNodes")
            lines = sh("busctl", "--json=short", "get-property", "org.cpuservice1",
                       f"/org/cpuservice1/allocation/{name}", "org.cpuservice1.Allocation",
                       *keys).splitlines()
            values = [json.loads(line)["data"] for line in lines if line.strip()]
            out[name].update(zip(keys, values, strict=True))
    return out


def until(what: str, names: tuple[str, ...], test,  # type: ignore[no-untyped-def]
          seconds: float = 90.0, health: bool = True) -> dict:  # type: ignore[type-arg]
    """Poll ``test(looks(names, health))`` until it holds; the looks then. Every 0.2 s for
    the first 3 s, then every second: each look starts processes, which under emulation cost
    the host a core while they run."""
    start = time.monotonic()
    last: dict = {}  # type: ignore[type-arg]
    while time.monotonic() - start < seconds:
        last = looks(names, health)
        if test(last):
            return last
        time.sleep(0.2 if time.monotonic() - start < 3 else 1.0)
    fail(f"{what} (not within {seconds:.0f} s); last: {json.dumps(last)}")
    raise AssertionError  # (fail exits)


def figure(s: dict, key: str) -> float:  # type: ignore[type-arg]
    return float((s.get("Statistics") or {}).get(key, -1))


def main() -> int:
    DROPIN.parent.mkdir(parents=True, exist_ok=True)
    DROPIN.write_text("statistics_seconds = 1\nhealth_seconds = 2\n")
    sh("systemctl", "restart", "cpuservice")
    try:
        return checks()
    finally:
        for name in NAMES:
            sh("cpuservicectl", "release", name, check=False)
        for unit in ("figbusy-load", "figquota-load", "figmem-load"):
            sh("systemctl", "stop", unit, check=False)
        Path("/dev/shm/figmem").unlink(missing_ok=True)
        DROPIN.unlink(missing_ok=True)
        sh("systemctl", "restart", "cpuservice", check=False)


def memory_remote() -> None:
    """A running service wrote a file on tmpfs while it could only use one node; an allocation
    with memory nodes on the other is then applied to it (option unit). The kernel moves the
    pages its processes map to the new nodes (cgroup v2's cpuset.mems migrates them) but not its
    page cache and shared memory: those stay remote."""
    plan = json.loads(sh("cpuservicectl", "plan", "1", "--bind", "--memory-nodes", "-j"))
    own = plan["memory-nodes"]
    other = "1" if own == "0" else "0"
    other_cpus = Path(f"/sys/devices/system/node/node{other}/cpulist").read_text().strip()
    Path("/run/figmem.ready").unlink(missing_ok=True)
    sh("systemd-run", "--unit=figmem-load", f"-pAllowedMemoryNodes={other}",
       f"-pAllowedCPUs={other_cpus}", "python3", "-c", TOUCH)
    end = time.monotonic() + 120
    while not Path("/run/figmem.ready").exists():
        if time.monotonic() > end:
            fail("the memory toucher did not get ready within 120 s")
        time.sleep(0.3)
    sh("cpuservicectl", "allocate", "figmem", "1", "--bind", "--memory-nodes",
       "--unit", "figmem-load.service")
    started = time.monotonic()
    s = until("Health says memory-remote", ("figmem",), lambda s: "memory-remote" in s[
        "figmem"]["HealthReason"])["figmem"]
    result(check="memory-remote", seconds=round(time.monotonic() - started, 1),
           nodes=s["MemoryNodes"], touched=other, remote_percent=figure(s, "memory-remote-percent"),
           remote_bytes=figure(s, "memory-remote-bytes"), health=s["Health"],
           reason=s["HealthReason"])


def checks() -> int:
    sh("cpuservicectl", "allocate", "figbusy", "1", "--bind")
    sh("cpuservicectl", "allocate", "figquota", "0.2")
    busy, quota = status("figbusy"), status("figquota")
    result(check="allocated", busy=busy["CPUSet"], quota=quota["CPUQuotaPerSecUSec"],
           unreadable=busy["Statistics"]["unreadable"])
    # first what needs no busy loop: under emulation each second of one costs a host core
    memory_remote()

    # pressure: four busy threads on one CPU, GetStatistics asked with busctl every 0.2 s until
    # the kernel's 10 s average shows it (it is updated every 2 s)
    sh("systemd-run", "--unit=figbusy-load", f"--slice={busy['Unit']}", "sh", "-c", BUSY)
    started = time.monotonic()
    b = until("CPU pressure shows", ("figbusy",), lambda s: figure(
        s["figbusy"], "cpu-pressure-some-avg10") > 0, 60, health=False)["figbusy"]
    result(check="pressure", seconds=round(time.monotonic() - started, 1),
           avg10=figure(b, "cpu-pressure-some-avg10"),
           total_usec=figure(b, "cpu-pressure-some-total-usec"))
    # throttled: a busy loop under a 20 % quota, beside the first load; then both health
    # reasons, looked at together
    sh("systemd-run", "--unit=figquota-load", f"--slice={quota['Unit']}", "sh", "-c",
       "while :; do :; done")
    quota_started = time.monotonic()
    q = until("throttling shows", ("figquota",), lambda s: figure(
        s["figquota"], "cpu-throttled-periods") > 0, health=False)["figquota"]
    result(check="throttling", seconds=round(time.monotonic() - quota_started, 1),
           periods=figure(q, "cpu-periods"), throttled=figure(q, "cpu-throttled-periods"))
    seen: dict[str, tuple[float, dict]] = {}  # type: ignore[type-arg]

    def note(looks: dict) -> bool:  # type: ignore[type-arg]
        for check, name, since in (("pressured", "figbusy", started),
                                   ("throttled", "figquota", quota_started)):
            if check in looks[name]["HealthReason"] and check not in seen:
                seen[check] = (round(time.monotonic() - since, 1), looks[name])
        return len(seen) == 2

    until("pressured and throttled show", ("figbusy", "figquota"), note)
    t, b = seen["pressured"]
    result(check="pressured", seconds=t, health=b["Health"], state=b["State"],
           reason=b["HealthReason"], avg10=figure(b, "cpu-pressure-some-avg10"))
    t, q = seen["throttled"]
    result(check="throttled", seconds=t, health=q["Health"], reason=q["HealthReason"])

    # what people look at, while the loads run: top, status, the metrics file
    top = sh("cpuservicectl", "top", "-b", "-n", "2", "-d", "1", "--order", "name")
    print(top, flush=True)
    rows = {line.split()[0]: line.split() for line in top.split("\n\n")[-1].splitlines()[1:]}
    text = sh("cpuservicectl", "status", "figbusy", "--no-pager")
    print(text, flush=True)
    metrics = PROM.read_text() if PROM.exists() else ""
    wanted = ('cpuservice_allocation_cpu_pressure_seconds_total{allocation="figbusy",kind="some"}',
              'cpuservice_allocation_cpu_throttled_periods_total{allocation="figquota"}',
              'cpuservice_allocation_memory_remote_ratio{allocation="figmem"}',
              'cpuservice_allocation_health{allocation="figbusy",reason="pressured"} 1')
    result(check="shown", top={n: rows.get(n) for n in NAMES},
           status_pressure=[ln.strip() for ln in text.splitlines() if "Pressure:" in ln],
           metrics={w: w in metrics for w in wanted})

    # the loads stop: the reason clears
    sh("systemctl", "stop", "figbusy-load", "figquota-load")
    started = time.monotonic()
    s = until("pressured clears once the load stops", ("figbusy",), lambda s: "pressured"
              not in s["figbusy"]["HealthReason"], 120)["figbusy"]
    result(check="cleared", seconds=round(time.monotonic() - started, 1), health=s["Health"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
