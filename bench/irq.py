"""Interrupt isolation benchmark in the VM lab (QEMU software emulation, 8 vCPUs, real
cpuserviced with isolate_irqs): where a movable interrupt lands while a bound allocation holds
4 CPUs, without and with irqbalance, and how long Allocate takes until the last interrupt
affinity is written. Prints, last:
    irq_on_bound_cpus movable=<n> deferred=<n> unmovable=<n> total_on_shared=<n> irqbalance=no
    irq_on_bound_cpus movable=<n> deferred=<n> unmovable=<n> total_on_shared=<n> irqbalance=yes
    irq_follow_ms p50 <float>
"""

from __future__ import annotations

import os
import sys

from tests.envs import lab

ROUNDS = int(os.environ.get("CPUSERVICE_BENCH_ROUNDS", "21"))
SCRIPT = "python3 /payload/tests/lab/scenarios/irqs.py"


def main() -> int:
    outcome = lab.run({
        "install": lab.Scenario("bash /payload/scripts/install.sh >/dev/null", timeout=300),
        "no": lab.Scenario(f"{SCRIPT} check no", timeout=150, needs=("install",)),
        "yes": lab.Scenario(f"{SCRIPT} check yes", timeout=150, needs=("install",)),
        "bench": lab.Scenario(f"{SCRIPT} bench {ROUNDS}", timeout=120 + 5 * ROUNDS,
                              needs=("install",)),
    })
    lines = []
    for name in ("no", "yes", "bench"):
        result = outcome.results[name]
        wanted = [x for x in result.output.splitlines()
                  if x.startswith(("irq_on_bound_cpus ", "irq_follow_ms "))]
        if result.status != 0 or not wanted:
            print(result.output)
            return 1
        lines += wanted
        # a movable interrupt that reached a bound CPU: which one, and its affinity then
        lines += [x for x in result.output.splitlines() if '"check": "landed"' in x]
    print(f"(VM boot {outcome.boot_seconds:.1f} s)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
