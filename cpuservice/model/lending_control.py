"""The lending controller (issue 26; per core since issue 37), pure: from what an owner's threads
did in one sample, which of its whole cores are lent and which are withdrawn.

The signal. An owner's threads are the only ones on its exclusive CPUs (kernel threads aside;
on a lent core also the borrowers), so what each of them ran, and where, tells which cores the
owner is busy on: each thread's run time over the sample (``/proc/TID/schedstat``, in ns) is
counted on the CPU it ran on last (``/proc/TID/stat`` field 39). The cgroup's own total
(``cpu.stat`` ``usage_usec``) checks it: what the threads read do not account for (threads
gone meanwhile, threads not read) may have run anywhere, so it counts on every core. Loads are
in percent of one CPU: a core's load is its CPUs' placed time plus the unplaced time.

The rules, per whole core of the owner (every online thread of it one of its lendable CPUs):

- a core whose load is above ``lend_busy_percent`` is withdrawn (or stays unlent) at once;
- a core is lent once its load has stayed below ``lend_idle_percent`` for
  ``lend_idle_seconds``; between the two thresholds nothing changes but its idle time starts
  again (hysteresis);
- an owner with T busy threads (each above ``lend_busy_percent``) keeps at least T whole cores
  unlent (a busy thread's own core among them: its load is above the threshold), so that the
  scheduler can give each of them a core no borrower shares: what is not lent yet is held
  back first, then the busiest lent cores are withdrawn;
- an owner's lends are at least ``DWELL_SECONDS`` apart, and after a withdrawal too (cores
  that become idle meanwhile join the next lend: one change, not one per core); withdrawals
  are never held back;
- a load that cannot be read withdraws everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.lending import lendable, lenders, lent
from cpuservice.model.state import State
from cpuservice.model.topology import Topology

DWELL_SECONDS = 1.0  # an owner's lends at least this far apart, and from its last withdrawal


class Thresholds(Protocol):
    """The configuration keys of the controller (cpuservice.model.config.Config has them)."""

    @property
    def lend_busy_percent(self) -> int: ...
    @property
    def lend_idle_percent(self) -> int: ...
    @property
    def lend_idle_seconds(self) -> float: ...


def cores_of(topology: Topology, cpus: CPUSet) -> dict[int, CPUSet]:
    """``cpus`` (whole cores, as lendable() gives them) by core index."""
    out: dict[int, list[int]] = {}
    for cpu in cpus:
        out.setdefault(topology.core_of(cpu), []).append(cpu)
    return {core: CPUSet(members) for core, members in out.items()}


@dataclass(frozen=True)
class Load:
    """What an owner did in one sample, in percent of one CPU: its threads' time on each CPU
    they ran on last, the time no thread read accounts for (it may have been on any core),
    how many threads on its lendable CPUs (or on no CPU known) were busy, and what it used in
    all (no core can have more)."""

    cpus: Mapping[int, float] = field(default_factory=dict)
    unplaced: float = 0.0
    busy_threads: int = 0
    ceiling: float = float("inf")

    def on(self, core: CPUSet) -> float:
        """The owner's load on ``core``: its CPUs' placed time and all the unplaced time, at
        most what it used in all (each thread's figure is an upper bound of its own: together
        on one core they may add up to more than the owner used)."""
        return min(sum(self.cpus.get(cpu, 0.0) for cpu in core) + self.unplaced, self.ceiling)


Thread = tuple[int, int]  # run time in ns since the thread started; the CPU it ran on last


def percent(used_us: float, seconds: float) -> float:
    """``used_us`` microseconds of CPU time over ``seconds`` in percent of one CPU."""
    return used_us / 1e6 / seconds * 100 if seconds > 0 else 0.0


def thread_load(before: Mapping[int, int], after: Mapping[int, Thread], used_us: int,
                seconds: float, busy_percent: float, cpus: CPUSet, skipped_us: int = 0,
                gap_us: int = 0, gap_now_us: int = 0) -> Load:
    """The owner's Load over one sample of ``seconds``, from its threads' run times at its
    start (``before``: tid -> ns) and at its end (``after``: tid -> (ns, CPU)), and its
    cgroup's ``used_us`` over the sample. ``skipped_us``: what the cgroup used between
    ``before`` and the sample's start (samples that read no thread). ``gap_us``: what the
    cgroup's usage grew by while ``before`` was read (it was read before and after the
    threads): the kernel may account a thread's time (at a tick, a switch) between the
    readings, so the threads' figures may lead the cgroup's reading before them by that much;
    ``gap_now_us``: the same while ``after`` was read.

    Both ways conservative: a thread's time on its CPU is at most its run time since
    ``before``, at most the sample (a thread runs on one CPU at a time) and at most what the
    cgroup used in it (``before`` may be older: samples that read no thread), all of that
    when it is new (not in ``before``, or its run time went back: another thread of that id);
    what counts as placed against the cgroup's total is at least the known threads' run time
    since ``before`` less ``skipped_us`` (nothing of a new thread's), and ``gap_us``; the rest
    is unplaced. A thread counts as busy (``busy_percent``) on the same
    upper bound, when its CPU is one of ``cpus`` (the lendable ones) or unknown
    (negative)."""
    if seconds <= 0:
        return Load(unplaced=100.0)
    window = seconds * 1e9
    cap = min(window, (used_us + gap_now_us) * 1000.0)  # what one thread can have run in it
    placed: dict[int, float] = {}
    accounted = 0.0
    busy = 0
    for tid, (runtime, cpu) in after.items():
        was = before.get(tid)
        if was is not None and runtime >= was:
            delta = runtime - was
            if cpu >= 0:
                accounted += delta
        else:
            delta = runtime
        share = min(delta, cap) / window * 100
        if share <= 0:
            continue
        if cpu >= 0:
            placed[cpu] = placed.get(cpu, 0.0) + share
        if share > busy_percent and (cpu < 0 or cpu in cpus):
            busy += 1
    accounted = max(0.0, accounted - skipped_us * 1000.0)  # what they ran in skipped samples
    unplaced = max(0.0, (used_us - gap_us) * 1000.0 - accounted) / window * 100
    return Load(placed, unplaced, busy, cap / window * 100)


@dataclass(frozen=True)
class Lender:
    """One lending allocation as the controller sees it: the CPUs it lends now (whole cores),
    since when each of its cores (by core index) has stayed below the idle threshold, and when
    its cores were last lent or withdrawn (None: not since the daemon started)."""

    lent: CPUSet = EMPTY
    idle_since: Mapping[int, float] = field(default_factory=dict)
    changed: float | None = None


def step(lender: Lender, load: Load | None, cores: Mapping[int, CPUSet], now: float,
         cfg: Thresholds) -> Lender:
    """One sample of the owner's ``load`` (None: it could not be read, which withdraws
    everything) over its lendable ``cores`` (cores_of) at time ``now`` (seconds): the lender
    after it, whose ``lent`` is what should be lent now (see the module's rules)."""
    if load is None:
        return Lender(EMPTY, {}, now if lender.lent else lender.changed)
    idle: dict[int, float] = {}
    keep: dict[int, float] = {}  # the cores lent after this sample -> their load
    for core, cpus in cores.items():
        x = load.on(cpus)
        was = cpus <= lender.lent
        if x > cfg.lend_busy_percent:
            continue
        if x < cfg.lend_idle_percent:
            since = lender.idle_since.get(core, now)
            idle[core] = since
            if was or now - since >= cfg.lend_idle_seconds:
                keep[core] = x
        elif was:
            keep[core] = x
    excess = load.busy_threads - (len(cores) - len(keep))
    if excess > 0:  # T busy threads keep T cores: first what is not lent yet, then the busiest
        order = sorted(keep, key=lambda c: (cores[c] <= lender.lent, -keep[c], c))
        for core in order[:excess]:
            del keep[core]
    held = {c for c in keep if cores[c] <= lender.lent}
    new = set(keep) - held
    if new and lender.changed is not None and now - lender.changed < DWELL_SECONDS:
        new = set()  # the dwell: their idle time goes on, they join the next lend
    out = CPUSet(cpu for c in held | new for cpu in cores[c])
    return Lender(out, idle, now if out != lender.lent else lender.changed)


def resync(lenders_now: Mapping[str, Lender], topology: Topology, state: State
           ) -> dict[str, Lender]:
    """The controller's lenders for ``state``: one per allocation that may lend, kept while
    it agrees with what the state says is lent, derived from the state otherwise (at startup,
    after a restart, after SetLending, a failed commit or a change that took lent CPUs away):
    what the state says is lent, every core's idle time from the next sample on."""
    out: dict[str, Lender] = {}
    for name in lenders(state):
        if not lendable(topology, state.ledger.allocations[name]):
            continue
        lending = lent(topology, state, name)
        known = lenders_now.get(name)
        if known is not None and known.lent == lending:
            out[name] = known
        else:
            out[name] = Lender(lending, {}, known.changed if known is not None else None)
    return out
