"""The lending controller, core by core (issue 37, cpuservice.model.lending_control): what an
owner's threads ran and where makes its load on each core; a busy core is withdrawn at once, an
idle one lent after lend_idle_seconds; T busy threads keep T whole cores; lends are a dwell
apart; and the readers of the kernel's figures (cpuservice.host.cgroup) on fake trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.host import cgroup
from cpuservice.model import config
from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.fixtures import MACHINES
from cpuservice.model.lending import lendable, with_lent
from cpuservice.model.lending_control import (
    DWELL_SECONDS,
    Lender,
    Load,
    cores_of,
    resync,
    step,
    thread_load,
)
from tests.props import examples
from tests.unit.test_lending import owner, state_of

B = MACHINES["b"].topology()  # 2 nodes x 4 cores x 2 threads; CPU n and n+8 are siblings
CFG = config.validate({})  # busy 20, idle 5, 2 s
EIGHT = CPUSet.parse("0-3,8-11")  # four whole cores
CORES = cores_of(B, EIGHT)
SAMPLE = 0.0625  # seconds (exact in binary)


def core(cpu: int) -> CPUSet:
    return B.siblings(cpu)


def lend_all(cfg: config.Config = CFG) -> Lender:
    """An owner of EIGHT idle long enough: every core lent."""
    lender = step(Lender(), Load(), CORES, 0.0, cfg)
    lender = step(lender, Load(), CORES, cfg.lend_idle_seconds, cfg)
    assert lender.lent == EIGHT
    return lender


def test_cores_of_groups_whole_cores() -> None:
    assert cores_of(B, EIGHT) == {B.core_of(c): core(c) for c in (0, 1, 2, 3)}
    assert cores_of(B, EMPTY) == {}


def test_one_busy_thread_on_eight_cpus_keeps_its_core_the_others_stay_lent() -> None:
    """Issue 37, item 3: one thread at 100 % on 8 CPUs was 12.5 % of them, between the
    thresholds: all 8 stayed lent, the busy core's sibling with a borrower. Now its core is
    withdrawn at the first sample and the three others stay lent."""
    lender = lend_all()
    busy = step(lender, Load({1: 100.0}, 0.0, 1), CORES, 3.0, CFG)
    assert busy.lent == EIGHT - core(1)
    for _ in range(100):  # it stays busy: its core is never lent, the others stay
        busy = step(busy, Load({1: 100.0}, 0.0, 1), CORES, 3.0 + SAMPLE, CFG)
        assert busy.lent == EIGHT - core(1)
    # on its sibling (9) it is the same core
    assert step(lender, Load({9: 100.0}, 0.0, 1), CORES, 3.0, CFG).lent == EIGHT - core(1)


def test_a_core_is_lent_after_its_own_idle_time_with_hysteresis() -> None:
    lender, now, lends = Lender(), 0.0, []
    for _ in range(40):  # 2.5 s: the first sample starts the idle time, lent at 2 s
        now += SAMPLE
        lender = step(lender, Load(), CORES, now, CFG)
        lends.append(lender.lent)
    assert lends[31] == EMPTY and lends[32] == EIGHT
    # between the thresholds on core 2: stays lent; above: withdrawn, alone
    lender = step(lender, Load({2: 10.0}), CORES, now + SAMPLE, CFG)
    assert lender.lent == EIGHT
    assert step(lender, Load({2: 20.0}), CORES, now + 2 * SAMPLE, CFG).lent == EIGHT
    lender = step(lender, Load({2: 20.5}), CORES, now + 3 * SAMPLE, CFG)
    assert lender.lent == EIGHT - core(2) and lender.changed == now + 3 * SAMPLE
    # idle again: lent after 2 s of its own idle time (the dwell is shorter)
    t0 = now + 4 * SAMPLE
    for i in range(40):
        lender = step(lender, Load({2: 12.0} if i == 5 else {}), CORES, t0 + i * SAMPLE, CFG)
        lent_at = i if lender.lent == EIGHT else None
        if lent_at is not None:
            break
    assert lent_at == 6 + 32  # between the thresholds at 5: its idle time started again


def test_t_busy_threads_keep_t_whole_cores() -> None:
    lender = lend_all()
    # two busy threads on the two threads of core 0: core 0 and one more core come back
    two = step(lender, Load({0: 100.0, 8: 100.0}, 0.0, 2), CORES, 3.0, CFG)
    assert not two.lent & core(0) and len(cores_of(B, EIGHT - two.lent)) == 2
    # four busy threads on one CPU each of two cores: all four cores
    four = step(lender, Load({0: 100.0, 8: 50.0, 1: 100.0, 9: 30.0}, 0.0, 4), CORES, 3.0, CFG)
    assert four.lent == EMPTY
    # more busy threads than cores: nothing lent, nothing to lend
    assert step(Lender(), Load({}, 0.0, 9), CORES, 99.0, CFG).lent == EMPTY


def test_what_is_held_back_for_busy_threads_is_first_what_is_not_lent_yet() -> None:
    lender = Lender(EIGHT - core(3), {B.core_of(3): 0.0}, None)  # core 3 idle since 0 s
    # at 5 s core 3 may be lent; a busy thread on core 0 and one more busy thread (on a CPU
    # not lendable): core 3 is held back, the lent cores 1 and 2 stay lent
    out = step(lender, Load({0: 100.0, 15: 100.0}, 0.0, 2), CORES, 5.0, CFG)
    assert out.lent == core(1) | core(2)


def test_unplaced_time_counts_on_every_core() -> None:
    lender = lend_all()
    assert step(lender, Load({}, 25.0), CORES, 3.0, CFG).lent == EMPTY
    assert step(lender, Load({}, 10.0), CORES, 3.0, CFG).lent == EIGHT  # between: stays
    assert step(Lender(), Load({}, 10.0), CORES, 3.0, CFG).idle_since == {}
    assert step(lender, None, CORES, 3.0, CFG) == Lender(EMPTY, {}, 3.0)  # unreadable


def test_lends_are_a_dwell_apart_withdrawals_never_wait() -> None:
    cfg = config.validate({"lend_idle_seconds": 0})
    lender = step(Lender(), Load(), CORES, 10.0, cfg)
    assert lender.lent == EIGHT and lender.changed == 10.0
    lender = step(lender, Load({0: 100.0}), CORES, 10.05, cfg)  # withdrawn at once
    assert lender.lent == EIGHT - core(0) and lender.changed == 10.05
    now = 10.05
    while now < 10.05 + DWELL_SECONDS - 0.1:  # idle again, not lent before the dwell
        now += 0.05
        lender = step(lender, Load(), CORES, now, cfg)
        assert lender.lent == EIGHT - core(0)
    lender = step(lender, Load({1: 100.0}), CORES, now + 0.05, cfg)  # withdrawn all the same
    assert lender.lent == EIGHT - core(0) - core(1)
    lender = step(lender, Load(), CORES, now + 0.1 + DWELL_SECONDS, cfg)
    assert lender.lent == EIGHT  # both in one lend


def test_thread_load_places_each_thread_where_it_ran_last() -> None:
    ms = 1_000_000
    before = {1: 10 * ms, 2: 50 * ms, 3: 7 * ms}
    after = {1: (10 * ms + 50 * ms, 1), 2: (50 * ms, -1), 3: (7 * ms + 1 * ms, 9),
             4: (500 * ms, 3)}  # 4 is new: its whole run time may be in this sample
    load = thread_load(before, after, 100_000, 0.1, 20, EIGHT)
    assert load.cpus == {1: pytest.approx(50.0), 9: pytest.approx(1.0), 3: 100.0}
    # the cgroup's 100 ms less the 51 ms the known threads account for: 49 ms unplaced
    assert load.unplaced == pytest.approx(49.0)
    assert load.busy_threads == 2  # 1 (50 %) and 4 (new, up to 100 %)
    assert load.on(core(1)) == pytest.approx(50.0 + 1.0 + 49.0)
    # a thread id reused (its run time went back): a new thread
    again = thread_load({5: 90 * ms}, {5: (3 * ms, 2)}, 3000, 0.1, 20, EIGHT)
    assert again.cpus == {2: pytest.approx(3.0)} and again.unplaced == pytest.approx(3.0)
    # what the cgroup used in samples that read no thread: subtracted from what is placed
    stale = thread_load({1: 0}, {1: (60 * ms, 1)}, 50_000, 0.05, 20, EIGHT, skipped_us=10_000)
    assert stale.cpus == {1: 100.0}  # up to the sample's length
    assert stale.unplaced == pytest.approx(0.0)  # 60 - 10 = 50 ms accounted for
    # several threads read long ago: what the cgroup used meanwhile is subtracted from their
    # sum once (not from each: 3 ms of theirs in the sample, none of it unplaced); and what
    # one of them may have run in the sample is at most what the cgroup used in it
    three = thread_load({1: 0, 2: 0, 3: 0}, {1: (20 * ms, 0), 2: (20 * ms, 1),
                                             3: (20 * ms, 2)}, 3000, 0.05, 20, EIGHT,
                        skipped_us=57_000)
    assert three.unplaced == pytest.approx(0.0)
    assert three.cpus == {0: pytest.approx(6.0), 1: pytest.approx(6.0), 2: pytest.approx(6.0)}
    # two such threads on one core: each may have run all the owner used, not both
    two = thread_load({1: 0, 2: 0}, {1: (20 * ms, 0), 2: (20 * ms, 8)}, 3000, 0.05, 20, EIGHT,
                      skipped_us=37_000)
    assert two.cpus == {0: pytest.approx(6.0), 8: pytest.approx(6.0)}
    assert two.on(core(0)) == pytest.approx(6.0) and two.ceiling == pytest.approx(6.0)
    # a busy thread on a CPU that is not lendable keeps no core
    assert thread_load({1: 0}, {1: (50 * ms, 15)}, 50_000, 0.05, 20, EIGHT).busy_threads == 0
    assert thread_load({}, {}, 1000, 0.0, 20, EIGHT).unplaced == 100.0


def test_time_accounted_while_the_threads_were_read_is_not_unplaced() -> None:
    """The cgroup's usage is read before and after its threads. The kernel accounts a running
    thread's time at ticks and switches, so one may fall between the readings (under QEMU's
    emulation a tick tens of ms late: 48 % of a 50 ms sample, in the VM lab, withdrew the
    owner's idle core): the threads' figures then lead the cgroup's reading before them by
    what it grew meanwhile. That growth at the sample's start is not unplaced; the rest is."""
    ms = 1_000_000
    # the thread's reading at the start included 24 ms the cgroup's reading before it did not
    load = thread_load({1: 0}, {1: (50 * ms, 1)}, 74_000, 0.05, 20, EIGHT)
    assert load.unplaced == pytest.approx(48.0)
    assert thread_load({1: 0}, {1: (50 * ms, 1)}, 74_000, 0.05, 20, EIGHT,
                       gap_us=24_000).unplaced == 0.0
    # beyond that growth it is unplaced (a short-lived thread's 20 ms, say)
    more = thread_load({1: 0}, {1: (50 * ms, 1)}, 94_000, 0.05, 20, EIGHT, gap_us=24_000)
    assert more.unplaced == pytest.approx(40.0)


def test_resync_follows_the_state() -> None:
    s = state_of(owner("0,8"), owner("1,9", name="p"), lent_cpus={"o": "0,8"})
    assert resync({}, B, s) == {"o": Lender(CPUSet.parse("0,8")), "p": Lender()}
    kept = {"o": Lender(CPUSet.parse("0,8"), {0: 1.0}, 5.0), "p": Lender(EMPTY, {1: 3.0}),
            "gone": Lender(CPUSet.parse("0,8"))}
    assert resync(kept, B, s) == {"o": kept["o"], "p": kept["p"]}
    # SetLending(off) then on, a failed commit, or a Resize that took every lent CPU: the
    # state says unlent; the idle times start again, the dwell stays
    assert resync(kept, B, with_lent(s, {"o": EMPTY}))["o"] == Lender(EMPTY, {}, 5.0)


# ---- random owners (hypothesis, the gate's fixed profile) ----

# one sample: each thread's (CPU index into EIGHT, percent of the sample it ran), and the
# cgroup time no thread read accounts for (threads gone meanwhile)
THREADS = st.lists(st.tuples(st.integers(0, 7), st.sampled_from([0.0, 1.0, 4.0, 10.0, 19.0,
                                                                  21.0, 60.0, 100.0])),
                   min_size=6, max_size=6)
SAMPLES = st.lists(st.tuples(THREADS, st.sampled_from([0.0, 0.0, 0.0, 3.0, 30.0]),
                             st.booleans()), min_size=1, max_size=60)


@settings(max_examples=examples(300))
@given(samples=SAMPLES, idle_seconds=st.sampled_from([0.0, 0.1, 0.25, 2.0]))
def test_an_owner_keeps_a_whole_core_for_each_busy_thread(
        samples: list[tuple[list[tuple[int, float]], float, bool]], idle_seconds: float) -> None:
    """Six threads of an owner of four whole cores, on random CPUs with random loads, sample
    after sample (some threads not running at all: T varies), through thread_load and step:
    with T busy threads at least min(T, 4) whole cores stay unlent, and never a core a busy
    thread ran on; nothing but whole lendable cores is lent; a core is lent only after
    lend_idle_seconds below the idle threshold (the placed and unplaced time of every sample
    since), lends are DWELL_SECONDS apart, and an unreadable load withdraws everything."""
    cfg = config.validate({"lend_idle_seconds": idle_seconds})
    cpus = list(EIGHT)
    runtimes = dict.fromkeys(range(6), 0)
    lender, now, window = Lender(), 0.0, 0.05
    idle_from: dict[int, float | None] = dict.fromkeys(CORES, None)
    last_lend: float | None = None
    for threads, unplaced, readable in samples:
        now += window
        before = dict(runtimes)
        after: dict[int, tuple[int, int]] = {}
        used = 0.0
        for tid, (i, share) in enumerate(threads):
            ran = int(share / 100 * window * 1e9)
            runtimes[tid] += ran
            used += ran / 1000
            after[tid] = (runtimes[tid], cpus[i] if ran else -1)
        used += unplaced / 100 * window * 1e6
        load = thread_load(before, after, int(used), window, cfg.lend_busy_percent, EIGHT)
        was = lender.lent
        lender = step(lender, load if readable else None, CORES, now, cfg)
        if not readable:
            assert lender.lent == EMPTY
            idle_from = dict.fromkeys(CORES, None)
            last_lend = now if was else last_lend
            continue
        busy = [cpus[i] for i, share in threads if share > cfg.lend_busy_percent]
        unlent = [c for c, members in CORES.items() if not members & lender.lent]
        assert len(unlent) >= min(len(busy), len(CORES)), (busy, lender.lent)
        for cpu in busy:
            assert not core(cpu) & lender.lent, (cpu, lender.lent)
        assert lender.lent <= EIGHT
        assert all(members <= lender.lent or not members & lender.lent
                   for members in CORES.values())
        for c, members in CORES.items():
            x = load.on(members)  # the shares on its CPUs and the unplaced time
            idle_from[c] = (idle_from[c] if idle_from[c] is not None else now) \
                if x < cfg.lend_idle_percent else None
            if members <= lender.lent and not members <= was:  # newly lent
                start = idle_from[c]
                assert start is not None and now - start >= idle_seconds - 1e-9
        if lender.lent - was:
            assert last_lend is None or now - last_lend >= DWELL_SECONDS - 1e-9
        if lender.lent != was:
            last_lend = now


# ---- the readers (cpuservice.host.cgroup) on fake trees ----


def _tree(tmp: Path, groups: dict[str, list[int]], threads: dict[int, tuple[int, int]]
          ) -> tuple[Path, Path]:
    root, proc = tmp / "cgroup", tmp / "proc"
    for group, tids in groups.items():
        (root / group).mkdir(parents=True, exist_ok=True)
        (root / group / "cgroup.threads").write_text("".join(f"{t}\n" for t in tids))
    for tid, (runtime, cpu) in threads.items():
        (proc / str(tid)).mkdir(parents=True)
        (proc / str(tid) / "schedstat").write_text(f"{runtime} 12345 67\n")
        fields = ["S"] + ["0"] * 35 + [str(cpu)] + ["0"] * 13
        (proc / str(tid) / "stat").write_text(f"{tid} (a (odd) name) {' '.join(fields)}\n")
    return root, proc


def test_threads_are_read_from_the_cgroup_tree(tmp_path: Path) -> None:
    unit = "cpuservice.slice/cpuservice-bound-o.slice"
    root, proc = _tree(tmp_path, {unit: [], f"{unit}/a.service": [11, 12],
                                  f"{unit}/b.scope/inner": [13, 14]},
                       {11: (100, 1), 12: (200, 9), 13: (300, 2)})  # 14 is gone
    got = cgroup.read_threads(f"/{unit}", {12: 200}, root, proc)
    assert got == {11: (100, 1), 12: (200, -1), 13: (300, 2)}  # 12 did not run: not read
    for bad in ("cpuservice.slice", "/cpuservice.slice/../x", "/nothing"):
        assert cgroup.read_threads(bad, {}, root, proc) is None


def test_an_owner_with_too_many_threads_is_not_read_thread_by_thread(tmp_path: Path) -> None:
    unit = "o.slice"
    root, _ = _tree(tmp_path, {unit: list(range(1000, 1000 + cgroup.MAX_THREADS))}, {})
    assert cgroup.thread_ids(f"/{unit}", root) is not None
    (root / unit / "more").mkdir()
    (root / unit / "more" / "cgroup.threads").write_text("4194304\n")
    assert cgroup.thread_ids(f"/{unit}", root) is None
    # 10,000 threads in one cgroup: refused after reading a bounded part of the file
    (root / unit / "cgroup.threads").write_text("".join(f"{t}\n" for t in range(10_000)))
    assert cgroup.thread_ids(f"/{unit}", root) is None
    for i in range(cgroup.MAX_GROUPS):  # too many cgroups below it
        (root / "deep" / str(i)).mkdir(parents=True)
        (root / "deep" / str(i) / "cgroup.threads").write_text("")
    (root / "deep" / "cgroup.threads").write_text("")
    assert cgroup.thread_ids("/deep", root) is None


def test_lending_is_detected(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (root / "unified").mkdir(parents=True)
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "schedstat").write_text("1 2 3\n")
    ok, why = cgroup.detect_lending(root, proc)
    assert not ok and "hybrid" in why
    (root / "unified").rmdir()
    assert "no cgroup v2" in cgroup.detect_lending(root, proc)[1]
    (root / "cgroup.controllers").write_text("cpuset io memory pids\n")
    assert "cpu controller" in cgroup.detect_lending(root, proc)[1]
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert cgroup.detect_lending(root, proc) == (True, "")
    (proc / "self" / "schedstat").unlink()
    assert "schedstat" in cgroup.detect_lending(root, proc)[1]


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no schedstat here")
def test_this_process_reads_its_own_threads() -> None:
    """The real /proc: this thread's run time and CPU (the cgroup part is a fake tree)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "me").mkdir()
        (root / "me" / "cgroup.threads").write_text(f"{os.getpid()}\n")
        got = cgroup.read_threads("/me", {}, root)
        assert got is not None and got[os.getpid()][0] > 0
        assert got[os.getpid()][1] in os.sched_getaffinity(0)


def test_lendable_cores_of_the_fixture() -> None:
    assert lendable(B, owner("0-3,8-11")) == EIGHT
