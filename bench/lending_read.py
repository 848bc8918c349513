"""What reading an owner's threads costs the lending loop (issue 37), on this machine's real
/proc: this process starts THREADS threads (asleep), a cgroup tree of its own lists them (a
temporary directory standing in for cgroupfs), and cpuservice.host.cgroup.read_threads reads
them as the loop does every lend_sample_ms while the owner is busy: once with none of them
having run since the last reading (one schedstat read each), once with all of them new (their
last CPU read too); then an owner of 10,000 threads, which the loop does not read thread by
thread (refused after a bounded read of its cgroup.threads). Prints:
    lending read_threads threads=<n> unchanged_ms=<f> all_read_ms=<f>
    lending read_threads threads=10000 refused_ms=<f>
(medians over ROUNDS readings). Goal: a busy owner's reading well under lend_sample_ms (50).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cpuservice.host import cgroup

THREADS = int(os.environ.get("CPUSERVICE_BENCH_THREADS", str(cgroup.MAX_THREADS)))
ROUNDS = int(os.environ.get("CPUSERVICE_BENCH_ROUNDS", "51"))


def median_ms(call: Callable[[], object], rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> int:
    stop = threading.Event()
    tids: list[int] = []
    started = threading.Barrier(THREADS)

    def sleeper() -> None:
        tids.append(threading.get_native_id())
        started.wait()
        stop.wait()

    workers = [threading.Thread(target=sleeper, daemon=True) for _ in range(THREADS - 1)]
    for w in workers:
        w.start()
    tids.append(threading.get_native_id())
    started.wait()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "owner.slice/app.service").mkdir(parents=True)
            (root / "owner.slice/cgroup.threads").write_text("")
            (root / "owner.slice/app.service/cgroup.threads").write_text(
                "".join(f"{t}\n" for t in tids))
            known = {t: r for t, (r, _) in
                     (cgroup.read_threads("/owner.slice", {}, root) or {}).items()}
            if len(known) != THREADS:
                print(f"read {len(known)} of {THREADS} threads", file=sys.stderr)
                return 1
            unchanged = median_ms(lambda: cgroup.read_threads("/owner.slice", known, root))
            all_read = median_ms(lambda: cgroup.read_threads("/owner.slice", {}, root))
            (root / "big.slice").mkdir()
            (root / "big.slice/cgroup.threads").write_text(
                "".join(f"{4_000_000 + i}\n" for i in range(10_000)))
            refused = median_ms(lambda: cgroup.read_threads("/big.slice", {}, root))
            assert cgroup.read_threads("/big.slice", {}, root) is None
    finally:
        stop.set()
    print(f"lending read_threads threads={THREADS} unchanged_ms={unchanged:.2f} "
          f"all_read_ms={all_read:.2f}")
    print(f"lending read_threads threads=10000 refused_ms={refused:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
