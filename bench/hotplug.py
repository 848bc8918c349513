"""Hotplug benchmark in the VM lab (QEMU software emulation, 8 vCPUs, real cpuserviced).

Time from writing 1 to a CPU's online file to systemd showing the repaired AllowedCPUs of
cpuservice-shared.slice (asked over D-Bus in a tight loop). Prints, last:
    hotplug_repair_ms p50 <float> max <float>
"""

from __future__ import annotations

import os
import sys

from tests.envs import lab

ROUNDS = int(os.environ.get("CPUSERVICE_BENCH_ROUNDS", "21"))


def main() -> int:
    outcome = lab.run({
        "bench": lab.Scenario("bash /payload/scripts/install.sh >/dev/null\n"
                              f"python3 /payload/tests/lab/scenarios/hotplug.py bench {ROUNDS}\n",
                              timeout=300 + 20 * ROUNDS),
    })
    result = outcome.results["bench"]
    rows = result.rows()
    if result.status != 0 or not rows:
        print(result.output)
        return 1
    print("\n".join(line for line in result.output.splitlines() if "CPU hotplug" in line)[-800:])
    print(f"rounds {rows[0]['rounds']}; the write to online itself took p50 "
          f"{rows[0]['write_p50']:.1f} ms (VM boot {outcome.boot_seconds:.1f} s)")
    print(f"hotplug_repair_ms p50 {rows[0]['p50']:.1f} max {rows[0]['max']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
