"""Lending benchmark in the VM lab (QEMU software emulation, real cpuserviced, cgroup v2).

The VM: two vCPUs (CPUSERVICE_LENDING_SHAPE 1x2x1: two cores, no SMT) on the two host cores,
booted with idle=poll (CPUSERVICE_LENDING_APPEND), so that both vCPUs are always busy for the
host whatever the guest runs: the host emulates the same work with lending or without, and
neither phase oversubscribes it. The daemon confines the host's processes, interrupts and
workqueues to the shared pool. An owner of one bound CPU (CPUSERVICE_LENDING_OWNER, a whole
core) that lends runs cyclictest on it (SCHED_OTHER, one wake-up every 10 ms) while a borrower
runs stress-ng on every CPU; one cyclictest run is measured in two windows, lent and then with
lending off (tests/lab/scenarios/lending.py bench). Prints, last:
    lending owner_p99_us unlent=<f> lent=<f> ratio=<f>
    lending harvest=<f>
    lending harvest_unlent=<f>
    lending withdraw_ms p50 <f> max <f>
harvest: the user time others than the owner ran on its CPU over its idle time there, lent;
harvest_unlent: the same with lending off (the borrower's Cpus_allowed_list excludes the CPU);
withdraw_ms: from the owner's spinners being woken to the borrow slice's cgroup without its
cores (CPUSERVICE_BENCH_ROUNDS withdrawals).
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
# the owner's CPUs exclusive host-wide, as a performance engineer would have them: the host's
# own processes, interrupts and workqueues stay on the shared pool, so that what else runs on
# the owner's CPUs is the borrower's (the harvest), and nothing at all without lending
CONFINE = ("mkdir -p /etc/cpuservice/cpuservice.toml.d\n"
           "printf 'confine_host = true\\nisolate_irqs = true\\nisolate_workqueues = true\\n' "
           "> /etc/cpuservice/cpuservice.toml.d/50-bench.toml\n"
           "systemctl restart cpuservice\n")


def main() -> int:
    outcome = lab.run({
        "bench": lab.Scenario("bash /payload/scripts/install.sh >/dev/null\n" + CONFINE +
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
