"""Lending benchmark in the VM lab (QEMU software emulation, real cpuserviced, cgroup v2).

An owner of 4 bound CPUs that lends them runs cyclictest on them (SCHED_OTHER, one wake-up every
10 ms per CPU) while a borrower runs stress-ng on every CPU; first with lending off, then lent
(tests/lab/scenarios/lending.py bench). Prints, last:
    lending owner_p99_us unlent=<f> lent=<f> ratio=<f>
    lending harvest=<f>
    lending withdraw_ms p50 <f> max <f>
harvest: the borrower's CPU time on the lent cores over the owner's idle time there;
withdraw_ms: from the owner's spinners starting to the borrow slice's cgroup without its cores.
Goals: ratio <= 1.5, harvest >= 0.8, withdraw p50 <= 200 ms.
"""

from __future__ import annotations

import os
import sys

from tests.envs import lab

ROUNDS = int(os.environ.get("CPUSERVICE_BENCH_ROUNDS", "11"))
SECONDS = int(os.environ.get("CPUSERVICE_LENDING_SECONDS", "30"))
OWNER = os.environ.get("CPUSERVICE_LENDING_OWNER", "1")
SOCKETS, CORES, THREADS = (int(x) for x in
                           os.environ.get("CPUSERVICE_LENDING_SHAPE", "1x2x1").split("x"))
APPEND = os.environ.get("CPUSERVICE_LENDING_APPEND", "idle=poll")


def main() -> int:
    outcome = lab.run({
        "bench": lab.Scenario("bash /payload/scripts/install.sh >/dev/null\n"
                              f"CPUSERVICE_LENDING_SECONDS={SECONDS} "
                              f"CPUSERVICE_LENDING_OWNER={OWNER} python3 "
                              f"/payload/tests/lab/scenarios/lending.py bench {ROUNDS}\n",
                              timeout=300 + 2 * SECONDS + 30 * ROUNDS),
    }, lab.Shape(sockets=SOCKETS, cores=CORES, threads=THREADS, nodes=1, append=APPEND))
    result = outcome.results["bench"]
    rows = result.rows()
    if result.status != 0 or not rows:
        print(result.output)
        return 1
    r = rows[-1]
    print(f"cyclictest {r['seconds']} s per phase ({r['samples']} wake-ups lent), max us "
          f"unlent {r['unlent_max']:.0f} lent {r['lent_max']:.0f}; steady throughout: "
          f"{r['lent_throughout']}; lent again {r['relent_seconds']:.1f} s after cyclictest "
          f"started; {r['rounds']} withdrawals (VM boot {outcome.boot_seconds:.1f} s)")
    ratio = r["lent_p99"] / r["unlent_p99"] if r["unlent_p99"] else float("inf")
    print(f"lending owner_p99_us unlent={r['unlent_p99']:.1f} lent={r['lent_p99']:.1f} "
          f"ratio={ratio:.2f}")
    print(f"lending harvest={r['harvest']:.2f}")
    # the same measure with lending off: what others got of the owner's idle CPUs without it
    print(f"lending harvest_unlent={r['unlent_harvest']:.2f}")
    print(f"lending withdraw_ms p50 {r['withdraw_p50']:.1f} max {r['withdraw_max']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
