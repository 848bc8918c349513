"""Re-packing's refusals (issue 40), for bench/placement.py: the time of the ``repack`` calls
that found nothing, apart from those that found moves, on churns whose refusals include
requests there are too few free CPUs for as well as fragmented ones.

- 128 CPUs: the churn of bench/placement.py (fixture c, core 0 reserved) with a share (0.3,
  as its re-packing lines) of the requests movable and the requested occupancy kept between
  80 % and 99 %, so that allocate refuses often; every refusal goes to ``repack`` (which
  first checks ``fragmented`` itself, as the daemon calls it); and the same kept between 90 %
  and 110 % (``band=over``), whose refusals include too few free CPUs;
- 1,024 CPUs: the fragmented ledger of bench/repack.py, probed with full-pcpus and packed
  requests of 2 to 512 CPUs (with and without single-numa-node), the larger ones more than the
  free CPUs.

Prints ``repack_found_us cpus=<n> count=<n> p50=<f> p99=<f> max=<f>`` and
``repack_refused_us cpus=<n> count=<n> too_few=<n> fragmented=<n> p50=<f> p99=<f> max=<f>``
(too_few: refusals ``fragmented`` ruled out; fragmented: refusals whose search ran).

The times are this thread's CPU time (time.thread_time_ns) with the garbage collector paused
during the call, as timeit times: on this shared 2-core machine the wall clock of a 5 ms call
carries other sessions' time slices (a p99 of 480 ms wall for 19 ms of CPU), and a collection
of the bench's own heap that happens to start inside a call added up to 35 ms to it (the same
call timed again: 2.5 ms).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

from cpuservice import placement
from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology
from cpuservice.placement.repack import fragmented, repack

BAND = (0.80, 0.99)
# requested occupancy up to 110 %: refusals for too few free CPUs as well (the band above,
# counting refused requests as live, leaves the placed ones short of the free CPUs: every
# refusal there is one of fragmentation)
OVER = (0.90, 1.10)
SHARE = 0.3


def _stats(times: list[float]) -> str:
    if not times:
        return "count=0 p50=0.0 p99=0.0 max=0.0"
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (f"count={len(times)} p50={statistics.median(ordered):.1f} p99={p99:.1f} "
            f"max={ordered[-1]:.1f}")


class Tally:
    def __init__(self) -> None:
        self.found: list[float] = []
        self.refused: list[float] = []
        self.too_few = 0
        self.fragmented = 0

    def attempt(self, topology: Topology, ledger: Ledger, name: str, request: Request
                ) -> Ledger | None:
        """allocate, and on a refusal repack (timed, refusal and search together: CPU time,
        the garbage collector paused)."""
        gc.disable()
        try:
            start = time.thread_time_ns()
            try:
                new, _ = placement.allocate(topology, ledger, name, request)
                return new
            except InsufficientCPUs:
                found = repack(topology, ledger, name, request)
            elapsed = (time.thread_time_ns() - start) / 1000
        finally:
            gc.enable()
        if found is not None:
            self.found.append(elapsed)
            check_invariants(found[0])
            return found[0]
        self.refused.append(elapsed)
        if fragmented(ledger, request):
            self.fragmented += 1
        else:
            self.too_few += 1
        return None

    def lines(self, cpus: int, tag: str = "") -> list[str]:
        return [f"repack_found_us cpus={cpus}{tag} {_stats(self.found)}",
                f"repack_refused_us cpus={cpus}{tag} too_few={self.too_few} "
                f"fragmented={self.fragmented} {_stats(self.refused)}"]


def churn_refusals(topology: Topology, seeds: list[int], ops: int = 4000,
                   band: tuple[float, float] = BAND) -> Tally:
    from bench.placement import churn_trace, with_movable  # bench.placement imports this
    tally = Tally()
    for seed in seeds:
        ledger = Ledger(topology.online, reserved=topology.cores[0])
        warmup, trace = churn_trace(seed, len(ledger.allocatable), ops, band=band)
        for op in with_movable(warmup, SHARE, seed):
            assert op.request is not None
            with contextlib.suppress(InsufficientCPUs):
                ledger, _ = placement.allocate(topology, ledger, op.name, op.request)
        for op in with_movable(trace, SHARE, seed):
            if op.request is None:
                if op.name in ledger.allocations:
                    ledger = placement.release(ledger, op.name)
                continue
            new = tally.attempt(topology, ledger, op.name, op.request)
            if new is not None:
                ledger = new
    return tally


def probe_refusals(topology: Topology, ledger: Ledger) -> Tally:
    tally = Tally()
    for size in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512):
        for policy in ("full-pcpus", "packed"):
            for options in ({}, {"numa-alignment": "single-numa-node"}):
                request = Request.parse(str(size), {"bind": True, "policy": policy,
                                                    "movable": "anywhere", **options})
                tally.attempt(topology, ledger, "probe", request)
    return tally
