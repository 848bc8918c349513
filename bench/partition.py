"""Kernel cpuset partition benchmark in the sid VM lab (QEMU software emulation, 8 vCPUs, Debian
sid's systemd >= 261 and Linux 7.x, real cpuserviced): how long an Allocate with
partition=isolated takes until the kernel reports the slice's partition isolated, and whether
the kernel then refuses to pin a system.slice process to its CPUs. Prints, last:
    partition_apply_ms p50 <float>
    partition_isolated_enforced yes|no
"""

from __future__ import annotations

import os
import sys

from tests.envs import lab

ROUNDS = int(os.environ.get("CPUSERVICE_BENCH_ROUNDS", "21"))
SCRIPT = "python3 /payload/tests/lab/scenarios/partitions.py"


def main() -> int:
    outcome = lab.run({
        "install": lab.Scenario("bash /payload/scripts/install.sh >/dev/null", timeout=300),
        "bench": lab.Scenario(f"{SCRIPT} bench {ROUNDS}", timeout=120 + 5 * ROUNDS,
                              needs=("install",)),
    }, release=lab.SID)
    result = outcome.results["bench"]
    rows = result.rows()
    if result.status != 0 or not rows:
        print(result.output)
        return 1
    row = rows[-1]
    print(f"(VM boot {outcome.boot_seconds:.1f} s; {row['rounds']} rounds, max "
          f"{row['max']:.1f} ms)")
    print(f"partition_apply_ms p50 {row['p50']:.1f}")
    print(f"partition_isolated_enforced {'yes' if row['enforced'] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
