"""Metrics in the Prometheus text format, for the node exporter's textfile collector (Debian's
prometheus-node-exporter reads ``/var/lib/prometheus/node-exporter/*.prom``): the pools, each
allocation's CPUs and state, D-Bus requests by result, repairs and their latency.

``render`` is pure (the text from the state and the counters); ``Textfile`` writes it
atomically (temp file + rename in the same directory, mode 0644 so the exporter's user can read
it) and only when the text changed, a short moment after a change so that a burst of requests
is one write, and never so often that writing takes more than MAX_SHARE of the daemon's time:
the text has lines for every allocation, 70-190 ms of CPU to render at 3,000 allocations, which
a write every 0.2 s under a stream of changes spent again and again (issue 40). The writes
spend a budget of CPU time that fills at MAX_SHARE of the time that passes, up to BUDGET: after
a quiet while a change is written within the delay, whatever it costs; under a stream of costly
writes, the next waits until the budget is back. A missing directory (no node exporter
installed) is skipped with one log line; the file is removed when the daemon stops, so a
stopped service is seen as absent metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cpuservice.apply import views
from cpuservice.host.checkpoint import State
from cpuservice.model import lending
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.topology import Topology

log = logging.getLogger(__name__)
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REPAIRS = ("hotplug", "revalidate")  # the triggers a running daemon repairs on
WRITE_DELAY = 0.2  # seconds: one write for a burst of changes
MAX_SHARE = 0.05  # of the daemon's time, at most, writing the metrics (over a while)
BUDGET = 0.25  # seconds of CPU the writes may spend at once after a quiet while


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


class Counters:
    """What happened since the daemon started; ``listeners`` are told of every change."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.repairs: dict[str, int] = {}
        self.repaired: dict[str, int] = {}
        self.durations: dict[str, Histogram] = {}
        self.repair_failures: dict[str, int] = {}
        self.moves: dict[str, int] = {}  # allocations moved, by why (repack, defragment)
        # lending (option lend): CPU time offered on lent CPUs, withdrawals and their latency
        self.lent_seconds = 0.0
        self.withdrawals = 0
        self.withdraw_latency = Histogram()
        self.listeners: list[Callable[[], None]] = []

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def request(self, method: str, result: str) -> None:
        """A D-Bus method call ended: ``result`` is "ok" or the error's name."""
        key = (method, result)
        self.requests[key] = self.requests.get(key, 0) + 1
        self._changed()

    def repair(self, trigger: str, seconds: float, changed: int) -> None:
        """A repair ran (``trigger``: startup, hotplug, revalidate) and changed ``changed``
        allocations."""
        self.repairs[trigger] = self.repairs.get(trigger, 0) + 1
        self.repaired[trigger] = self.repaired.get(trigger, 0) + changed
        self.durations.setdefault(trigger, Histogram()).observe(seconds)
        self._changed()


    def moved(self, why: str, count: int) -> None:
        """``count`` movable allocations were moved (``why``: repack, defragment)."""
        if count:
            self.moves[why] = self.moves.get(why, 0) + count
            self._changed()

    def lent(self, cpus: int, seconds: float) -> None:
        """``cpus`` CPUs were lent for ``seconds`` (counted at every sample: the listeners are
        told by flush(), not on each)."""
        self.lent_seconds += cpus * seconds

    def withdrawn(self, seconds: float) -> None:
        """Lent CPUs were withdrawn, ``seconds`` after the sample that found the owner busy."""
        self.withdrawals += 1
        self.withdraw_latency.observe(seconds)
        self._changed()

    def flush(self) -> None:
        """Tell the listeners of counts kept quietly (lent CPU time)."""
        self._changed()

    def repair_failed(self, trigger: str) -> None:
        """A repair (``trigger``: hotplug, revalidate) failed: systemd or the checkpoint
        refused its result, which was rolled back."""
        self.repair_failures[trigger] = self.repair_failures.get(trigger, 0) + 1
        self._changed()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, text: str,
               samples: Iterable[tuple[dict[str, str], float]]) -> None:
        self.lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        self.samples(name, samples)

    def samples(self, name: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        self.lines += [f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples]


def render(topology: Topology, state: State, counters: Counters, version: str,
           checkpoint: tuple[bool, int] = (False, 0)) -> str:
    """The metrics as Prometheus text (pure); ``checkpoint``: whether the checkpoint cannot
    be written now (the service refuses changes) and how many writes failed since the start.
    The alert rules shipped with the package (prometheus/cpuservice.rules.yml) use these."""
    ledger = state.ledger
    out = _Text()
    out.family("cpuservice_info", "gauge", "The running cpuserviced (value 1).",
               [({"version": version}, 1)])
    pools = {"online": ledger.online, "reserved": ledger.reserved, "isolated": ledger.isolated,
             "shared": ledger.shared, "exclusive": ledger.exclusive, "fragment": ledger.fragment}
    out.family("cpuservice_pool_cpus", "gauge", "CPUs in each pool.",
               [({"pool": pool}, len(cpus)) for pool, cpus in pools.items()])
    out.family("cpuservice_shared_min_cpus", "gauge",
               "The fewest CPUs the shared pool keeps (min_shared_cpus).",
               [({}, ledger.min_shared_cpus)])
    out.family("cpuservice_pool_info", "gauge", "The CPUs of each pool as a cpu list (value 1).",
               [({"pool": pool, "cpus": cpus.format()}, 1) for pool, cpus in pools.items()])
    values = {name: views.allocation(topology, state, name) for name in sorted(ledger.allocations)}
    out.family("cpuservice_allocations", "gauge", "Allocations by kind and state.",
               [({"bound": b, "state": s}, sum(1 for v in values.values()
                                               if _bool(v["Bound"]) == b and v["State"] == s))
                for b in ("true", "false") for s in ("active", "degraded")])
    out.family("cpuservice_allocation_info", "gauge",
               "Each allocation's CPUs, unit, owner and state (value 1).",
               [({"allocation": n, "cpus": v["CPUSet"], "bound": _bool(v["Bound"]),
                  "unit": v["Unit"], "uid": str(v["Owner"]), "state": v["State"],
                  "lifetime": v["Lifetime"]}, 1) for n, v in values.items()])
    out.family("cpuservice_allocation_requested_cpus", "gauge",
               "The CPUs each allocation asked for (may be fractional).",
               [({"allocation": n}, float(v["CPUs"])) for n, v in values.items()])
    out.family("cpuservice_allocation_cpus", "gauge",
               "The CPUs each allocation's unit may run on (its AllowedCPUs).",
               [({"allocation": n}, _count(v["CPUSet"])) for n, v in values.items()])
    out.family("cpuservice_allocation_degraded", "gauge",
               "1 while an allocation holds fewer CPUs than it asked for.",
               [({"allocation": n}, int(v["State"] == "degraded")) for n, v in values.items()])
    out.family("cpuservice_requests_total", "counter",
               "D-Bus method calls by method and result (ok or the error's name).",
               [({"method": m, "result": r}, n)
                for (m, r), n in sorted(counters.requests.items())])
    out.family("cpuservice_repairs_total", "counter",
               "Repairs of the allocations against the topology, by trigger.",
               [({"trigger": t}, n) for t, n in sorted(counters.repairs.items())])
    out.family("cpuservice_repaired_allocations_total", "counter",
               "Allocations a repair changed, by trigger.",
               [({"trigger": t}, n) for t, n in sorted(counters.repaired.items())])
    out.family("cpuservice_repair_failures_total", "counter",
               "Repairs that failed and were rolled back, by trigger.",
               [({"trigger": t}, counters.repair_failures.get(t, 0))  # 0 from the start:
                for t in sorted({*REPAIRS, *counters.repair_failures})])  # increase() sees 1
    out.family("cpuservice_moves_total", "counter",
               "Movable allocations moved to other CPUs, by why (repack: to place a request "
               "refused for fragmentation; defragment).",
               [({"why": w}, counters.moves.get(w, 0)) for w in ("repack", "defragment")])
    out.family("cpuservice_lent_cpus", "gauge",
               "CPUs lent to borrowers now (idle whole cores of allocations with option lend).",
               [({}, len(lending.all_lent(topology, state)))])
    out.family("cpuservice_lent_cpu_seconds_total", "counter",
               "CPU time offered to borrowers on lent CPUs (CPUs lent x seconds).",
               [({}, round(counters.lent_seconds, 3))])
    out.family("cpuservice_lending_withdrawals_total", "counter",
               "Owners whose lent CPUs were withdrawn because they got busy (or their load "
               "could not be read).",
               [({}, counters.withdrawals)])
    out.family("cpuservice_checkpoint_write_failing", "gauge",
               "1 while the state cannot be written (every change is refused).",
               [({}, int(checkpoint[0]))])
    out.family("cpuservice_checkpoint_write_failures_total", "counter",
               "Failed writes of the checkpoint since the start.", [({}, checkpoint[1])])
    out.family("cpuservice_repair_duration_seconds", "histogram",
               "How long a repair took, from reading the topology to systemd holding the result.",
               [])
    for trigger, h in sorted(counters.durations.items()):
        out.samples("cpuservice_repair_duration_seconds_bucket",
                    [({"trigger": trigger, "le": _number(b)}, c)
                     for b, c in zip(BUCKETS, h.counts, strict=True)]
                    + [({"trigger": trigger, "le": "+Inf"}, h.count)])
        out.samples("cpuservice_repair_duration_seconds_sum", [({"trigger": trigger}, h.total)])
        out.samples("cpuservice_repair_duration_seconds_count", [({"trigger": trigger}, h.count)])
    h = counters.withdraw_latency
    out.family("cpuservice_lending_withdraw_seconds", "histogram",
               "From the load sample that found a lending owner busy to systemd holding the "
               "borrow slice without its CPUs.", [])
    out.samples("cpuservice_lending_withdraw_seconds_bucket",
                [({"le": _number(b)}, c) for b, c in zip(BUCKETS, h.counts, strict=True)]
                + [({"le": "+Inf"}, h.count)])
    out.samples("cpuservice_lending_withdraw_seconds_sum", [({}, h.total)])
    out.samples("cpuservice_lending_withdraw_seconds_count", [({}, h.count)])
    return "\n".join(out.lines) + "\n"


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _count(cpus: str) -> int:
    return len(CPUSet.parse(cpus))


class Textfile:
    """Writes ``render()`` to ``path`` when it changed (see the module's docstring)."""

    def __init__(self, path: str, render: Callable[[], str], delay: float = WRITE_DELAY,
                 clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.process_time) -> None:
        self.path = Path(path)
        self.render = render
        self.delay = delay
        self.clock = clock
        self.cpu = cpu
        self._written: str | None = None
        self._pending: asyncio.TimerHandle | None = None
        self._skipping = False
        self._budget = BUDGET  # seconds of CPU the writes may spend, as of self._at
        self._at = clock()

    def _budget_now(self) -> float:
        return min(BUDGET, self._budget + (self.clock() - self._at) * MAX_SHARE)

    def changed(self) -> None:
        """Something changed: write soon (once for a burst; later while writing has spent its
        budget)."""
        if self._pending is None:
            wait = max(self.delay, -self._budget_now() / MAX_SHARE)
            self._pending = asyncio.get_running_loop().call_later(wait, self._fire)

    def _fire(self) -> None:
        self._pending = None
        self.write()

    def write(self) -> bool:
        """Write now if the text changed; False when the directory is missing or unwritable."""
        budget, start = self._budget_now(), self.cpu()
        try:
            return self._write()
        finally:
            self._budget, self._at = budget - (self.cpu() - start), self.clock()

    def _write(self) -> bool:
        directory = self.path.parent
        if not directory.is_dir():
            if not self._skipping:
                log.info("not writing metrics: %s does not exist (no node exporter?)", directory)
                self._skipping = True
            return False
        text = self.render()
        if text == self._written and self.path.exists():
            return True
        try:
            _replace_file(directory, self.path.name, text.encode())
        except OSError as exc:
            if not self._skipping:
                log.warning("cannot write metrics to %s: %s", self.path, exc)
                self._skipping = True
            return False
        if self._skipping:
            log.info("writing metrics to %s", self.path)
        self._skipping = False
        self._written = text
        return True

    def remove(self) -> None:
        """The daemon stops: its metrics go (a stopped service shows as absent metrics)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove %s: %s", self.path, exc)


def _replace_file(directory: Path, name: str, data: bytes) -> None:
    """Replace ``directory/name`` with ``data`` (mode 0644), safely in a directory another
    user may write (Debian's /var/lib/prometheus/node-exporter belongs to prometheus): the
    directory is opened without following a link, the temp file gets a fresh random name with
    O_EXCL|O_NOFOLLOW (mkstemp's flags, relative to the directory), its mode is set on the
    descriptor, and the rename happens inside the directory; nothing follows a planted link."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"  # not *.prom: the exporter never reads it
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dfd)
        try:
            try:
                os.fchmod(fd, 0o644)  # the exporter's user reads it, whatever the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)
