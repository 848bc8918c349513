"""VM lab scenario: cpuserviced's metrics through the real prometheus-node-exporter. Starts the
exporter (installed in the image, not started at boot), scrapes it on 127.0.0.1:9100 and checks
that the cpuservice metrics are there and follow an allocation and its release. Prints lines
starting with ``RESULT `` (JSON); a failed check prints ``FAILED STEP: ...`` and exits 1.

    python3 metrics.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

URL = "http://127.0.0.1:9100/metrics"
SHARED = 'cpuservice_pool_cpus{pool="shared"}'
INFO = 'cpuservice_allocation_info{allocation="metrics1"'

PROM = "/var/lib/prometheus/node-exporter/cpuservice.prom"
M = ["org.cpuservice1", "/org/cpuservice1", "org.cpuservice1.Manager"]


def fail(what: str) -> None:
    print(f"FAILED STEP: {what}", flush=True)
    raise SystemExit(1)


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def scrape() -> dict[str, float]:
    with urllib.request.urlopen(URL, timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?) (\S+)", line)
        if m and not line.startswith("#"):
            out[m[1]] = float(m[2])
    return out


def until(what: str, check: object, seconds: float = 30) -> dict[str, float]:
    """Scrape until ``check(metrics)`` holds."""
    end = time.monotonic() + seconds
    last: dict[str, float] = {}
    while time.monotonic() < end:
        try:
            last = scrape()
            if check(last):  # type: ignore[operator]
                return last
        except OSError:
            pass
        time.sleep(0.5)
    ours = {k: v for k, v in last.items() if k.startswith(("cpuservice_", "node_textfile"))}
    fail(f"{what} (not within {seconds} s); last scrape: {json.dumps(ours)}")
    return last


def busctl(*args: str) -> str:
    return subprocess.run(["busctl", "--json=short", *args], check=True, capture_output=True,
                          text=True).stdout


def prop(name: str) -> str:
    return str(json.loads(busctl("get-property", *M, name))["data"])


def count(cpus: str) -> int:
    n = 0
    for part in filter(None, cpus.split(",")):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def main() -> int:
    started = time.monotonic()
    subprocess.run(["systemctl", "start", "prometheus-node-exporter"], check=True)
    shared = prop("SharedCPUs")
    first = until("the node exporter serves cpuservice's metrics",
                  lambda m: SHARED in m)
    result(check="scraped", seconds=round(time.monotonic() - started, 1),
           shared=first[SHARED],
           textfile_error=first.get("node_textfile_scrape_error"),
           families=sorted({k.split("{")[0] for k in first if k.startswith("cpuservice_")}))
    if first.get("node_textfile_scrape_error") != 0:
        fail("the textfile collector reports an error")
    if first[SHARED] != count(shared):
        fail(f"shared CPUs {first[SHARED]} in the metrics, {shared} on the bus")
    busctl("call", *M, "Allocate", "ssa{sv}", "metrics1", "2", "1", "bind", "b", "true")
    began = time.monotonic()
    while 'allocation="metrics1"' not in Path(PROM).read_text():
        if time.monotonic() - began > 10:
            fail("the allocation is not in the metrics file within 10 s")
        time.sleep(0.01)
    written = time.monotonic() - began
    after = until("the allocation shows in the scrape",
                  lambda m: m.get('cpuservice_allocation_cpus{allocation="metrics1"}') == 2)
    followed = time.monotonic() - began
    ok = 'cpuservice_requests_total{method="Allocate",result="ok"}'
    result(check="allocated", followed_s=round(followed, 2), written_s=round(written, 3),
           shared=after[SHARED],
           exclusive=after['cpuservice_pool_cpus{pool="exclusive"}'],
           allocate_ok=after.get(ok),
           info=[k for k in after if k.startswith(INFO)])
    if after[SHARED] != count(shared) - 2:
        fail("the shared pool did not shrink by 2 in the metrics")
    busctl("call", *M, "Release", "s", "metrics1")
    gone = until("the release shows in the scrape",
                 lambda m: not any('allocation="metrics1"' in k for k in m))
    result(check="released", shared=gone[SHARED],
           release_ok=gone.get('cpuservice_requests_total{method="Release",result="ok"}'))
    subprocess.run(["systemctl", "stop", "cpuservice"], check=True)
    until("the metrics go when the service stops",
          lambda m: not any(k.startswith("cpuservice_") for k in m))
    result(check="stopped", file_left=subprocess.run(["test", "-e", PROM]).returncode == 0)
    subprocess.run(["systemctl", "start", "cpuservice"], check=True)
    subprocess.run(["systemctl", "stop", "prometheus-node-exporter"], check=False)
    print(f"metrics_follow_s {followed:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
