"""The VM lab: availability check (a skipped tier fails under CI=true), the Debian packages and
the shared boots every lab test module reads (tests/lab/plan.py), with their times reported at
the end of the run.

The boots start as soon as the session knows which it needs, side by side (``Scheduler``): a
VM under QEMU's software emulation keeps up to every core busy when its guest is busy and little
when it is idle, so two at a time (``CPUSERVICE_LAB_PARALLEL``) fill this project's 2-core
machines, the longest first (``Boot.seconds``, measured). While the file named
by ``CPUSERVICE_LAB_SHARED_UNTIL`` does not exist (scripts/tiers.sh: the other tiers still run
beside the lab), the second lane takes only the boots that may fill in (``Boot.filler``: the
small boot) and runs them at niceness FILLER_NICE: they take what CPU the other tiers and the
first lane's boot leave, and the first lane's boot keeps most of its share."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import unavailable
from tests.envs import lab
from tests.envs.lab import CHECKOUT
from tests.lab import plan

BOOTS: dict[str, lab.Run] = {}
DEFAULT = lab.Shape()


def lab_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the VM lab needs root (debootstrap, chroot)"
    for tool in ("qemu-system-x86_64", "debootstrap", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-deps.sh lab)"
    try:
        lab.kernel()
    except lab.LabError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def lab_ready() -> None:
    reason = lab_unavailable_reason()
    if reason:
        unavailable(reason)


def _build_debs(out: Path, release: lab.Release) -> list[Path]:
    """cpuservice 0.1.0 built from the checkout for ``release`` (with lintian's log): here when
    this machine runs that release, else in a chroot of it (scripts/test-release.sh, whose root
    scripts/lab-images.sh prepares); and the same package as 0.1.1, for the upgrade."""
    first = out / "0.1.0"
    if release.suite == lab.host_codename():
        subprocess.run(["bash", str(CHECKOUT / "scripts/build-deb.sh")], check=True,
                       env={**os.environ, "CPUSERVICE_DEB_OUT": str(first)},
                       stdout=subprocess.DEVNULL)
    else:
        subprocess.run(["bash", str(CHECKOUT / "scripts/test-release.sh"), release.suite,
                        "--deb", str(first)], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["bash", str(CHECKOUT / "tests/lab/scenarios/reversion.sh"),
                    str(first / "cpuservice_0.1.0_all.deb"), "0.1.1", str(out / "0.1.1")],
                   check=True, stdout=subprocess.DEVNULL)
    return sorted(out.glob("*/cpuservice_*_all.deb"))


@dataclass(frozen=True)
class Boot:
    """One boot the test modules share: its scenarios, shape, release, the release whose
    package it carries (in /payload/files), and about how long it takes alone (its order)."""

    name: str
    scenarios: dict[str, lab.Scenario]
    shape: lab.Shape = DEFAULT
    release: lab.Release = lab.BOOKWORM
    debs: lab.Release | None = None
    seconds: int = 60
    # may run niced beside the other tiers (Scheduler.turn): a quick boot, a kernel that boots
    # quickly, nothing timed in it, and over long before the main boot's timed scenarios
    # (lending, figures, guard) start. Run starved (niceness 10, a machine loaded by other
    # sessions), the sid kernel did not boot within 300 s; a filler that was still running (at
    # niceness 5) when the main boot's lending scenario ran made it miss its 20 s bound, and
    # the integration tier beside them took 7m24s instead of 5m12s.
    filler: bool = False


# by the fixture that returns its Run
PLANNED = {
    # (seconds: whole runs in the gate of issue 41's last session, beside the other tiers)
    "main_boot": Boot("main", plan.MAIN, debs=lab.BOOKWORM, seconds=640),
    "containers_boot": Boot("containers", plan.CONTAINERS, release=lab.PODMAN, seconds=185),
    "trixie_boot": Boot("trixie", plan.DEBIAN13, release=lab.TRIXIE, debs=lab.TRIXIE,
                        seconds=207),
    "modern_boot": Boot("modern", plan.MODERN, release=lab.SID, seconds=146),
    "small_boot": Boot("small", plan.SMALL_SCENARIOS, plan.SMALL, seconds=40, filler=True),
    "near_boot": Boot("near", plan.NEAR_SCENARIOS, plan.NEAR, seconds=86),
}


# the niceness of a boot that fills in beside the other tiers (a weight of 335 to their 1024)
FILLER_NICE = 5


@dataclass
class Scheduler:
    """Runs the boots on threads, ``parallel()`` at a time, in the order they were asked for
    (the longest first: the lanes end together); while the other tiers run, the second lane
    takes only the boots that may fill in, from the end of that order, at FILLER_NICE
    (``turn``). Each one's Run (or its error) is a Future. Packages are built once per
    release."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    queue: list[str] = field(default_factory=list)
    running: int = 0
    fillers: int = 0  # running at FILLER_NICE
    may_fill: set[str] = field(default_factory=set)
    futures: dict[str, Future[lab.Run]] = field(default_factory=dict)
    packages: dict[str, Future[list[Path]]] = field(default_factory=dict)
    scratch: list[Path] = field(default_factory=list)

    @staticmethod
    def parallel() -> int:
        return max(1, int(os.environ.get("CPUSERVICE_LAB_PARALLEL", "2")))

    @staticmethod
    def shared() -> bool:
        """Whether the other tiers still run beside the lab."""
        shared_until = os.environ.get("CPUSERVICE_LAB_SHARED_UNTIL")
        return bool(shared_until) and not Path(shared_until).exists()

    def turn(self, name: str) -> int | None:
        """The niceness ``name`` starts at if it may start now, else None."""
        if not self.queue or self.running >= self.parallel():
            return None
        if self.running - self.fillers == 0 or not self.shared():  # the longest first
            return 0 if self.queue[0] == name else None
        fill = [n for n in self.queue if n in self.may_fill]
        return FILLER_NICE if fill and fill[-1] == name else None

    def submit(self, name: str, task: Callable[[int], lab.Run],
               filler: bool = False) -> Future[lab.Run]:
        with self.cond:
            if name not in self.futures:
                self.futures[name] = Future()
                self.queue.append(name)
                if filler:
                    self.may_fill.add(name)
                threading.Thread(target=self._run, args=(name, task), name=f"lab-{name}",
                                 daemon=True).start()
            return self.futures[name]

    def _run(self, name: str, task: Callable[[int], lab.Run]) -> None:
        with self.cond:
            while (nice := self.turn(name)) is None:
                self.cond.wait(1.0)  # the share file appears without a notification
            self.queue.remove(name)
            self.running += 1
            self.fillers += nice > 0
            self.cond.notify_all()
        future = self.futures[name]
        try:
            run = task(nice)
            BOOTS[name] = run
            _keep_output(name, run)
            future.set_result(run)
        except BaseException as exc:  # handed to the test that waits for it
            future.set_exception(exc)
        finally:
            with self.cond:
                self.running -= 1
                self.fillers -= nice > 0
                self.cond.notify_all()

    def debs(self, release: lab.Release) -> list[Path]:
        """The package (0.1.0 and 0.1.1) for ``release``, built by the first to ask."""
        with self.cond:
            future = self.packages.get(release.suite)
            mine = future is None
            if future is None:
                future = self.packages[release.suite] = Future()
        if mine:
            out = Path(tempfile.mkdtemp(prefix=f"cpuservice-debs-{release.suite}-",
                                        dir="/var/tmp"))
            self.scratch.append(out)
            try:
                future.set_result(_build_debs(out, release))
            except BaseException as exc:  # every caller sees it
                future.set_exception(exc)
        return future.result()

    def boot(self, boot: Boot) -> Future[lab.Run]:
        def task(nice: int) -> lab.Run:
            files = self.debs(boot.debs) if boot.debs else []
            return lab.run(boot.scenarios, boot.shape, files=files, release=boot.release,
                           nice=nice)
        return self.submit(boot.name, task, boot.filler)

    def cleanup(self) -> None:
        for out in self.scratch:
            shutil.rmtree(out, ignore_errors=True)


SCHEDULER = Scheduler()


def _keep_output(name: str, run: lab.Run) -> None:
    """With CPUSERVICE_LAB_OUTPUT=DIR, what each scenario of boot ``name`` printed, in
    DIR/NAME/SCENARIO.txt (a passing test shows none of it): to see how long each check took."""
    out = os.environ.get("CPUSERVICE_LAB_OUTPUT")
    if not out:
        return
    where = Path(out) / name
    where.mkdir(parents=True, exist_ok=True)
    for result in run.results.values():
        (where / f"{result.name}.txt").write_text(
            f"exit {result.status}, {result.seconds:.1f} s\n{result.output}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start every boot the selected tests need (longest first), before the first test."""
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())
              if name in PLANNED}
    if needed and lab_unavailable_reason() is None:
        # every package the boots carry is built now, beside the first boot (a build takes 15-20
        # s; a boot that waited for its own at its start added that to the lab's end)
        for release in {PLANNED[n].debs.suite: PLANNED[n].debs for n in needed
                        if PLANNED[n].debs}.values():
            threading.Thread(target=SCHEDULER.debs, args=(release,), daemon=True,
                             name=f"debs-{release.suite}").start()
        for name in sorted(needed, key=lambda n: -PLANNED[n].seconds):
            SCHEDULER.boot(PLANNED[name])


def pytest_sessionfinish(session: pytest.Session) -> None:
    SCHEDULER.cleanup()


def _wait(future: Future[lab.Run]) -> lab.Run:
    return future.result()


@pytest.fixture(scope="session")
def debs(lab_ready: None) -> list[Path]:
    """The package for the Debian 12 guests, 0.1.0 and 0.1.1."""
    return SCHEDULER.debs(lab.BOOKWORM)


@pytest.fixture(scope="session")
def trixie_debs(lab_ready: None) -> list[Path]:
    """The package for the Debian 13 guest, 0.1.0 and 0.1.1."""
    return SCHEDULER.debs(lab.TRIXIE)


def _boot(name: str, scenarios: dict[str, lab.Scenario], shape: lab.Shape = DEFAULT,
          files: list[Path] | None = None, release: lab.Release = lab.BOOKWORM) -> lab.Run:
    """A boot of a test module's own (the shared ones are PLANNED)."""
    return _wait(SCHEDULER.submit(name, lambda nice: lab.run(
        scenarios, shape, files=files or [], release=release, nice=nice)))


def main_scenario(name: str) -> lab.Result:
    """Scenario ``name`` of the main boot: its result there when the main boot ran it (the
    whole tier), else from a boot of its own with the package installed (one module alone)."""
    main = BOOTS.get("main")
    if main is not None and name in main.results:
        return main.results[name]
    run = _boot(name, {"install": plan.MAIN["install"], name: plan.MAIN[name]})
    assert run.results["install"].status == 0, run.results["install"].output
    return run.results[name]


@pytest.fixture(scope="session")
def main_boot(lab_ready: None) -> lab.Run:
    """One boot of the default shape that runs every scenario of plan.MAIN."""
    return _wait(SCHEDULER.boot(PLANNED["main_boot"]))


@pytest.fixture(scope="session")
def containers_boot(lab_ready: None) -> lab.Run:
    """One boot of Debian 12 with podman (lab.PODMAN) that runs plan.CONTAINERS."""
    return _wait(SCHEDULER.boot(PLANNED["containers_boot"]))


@pytest.fixture(scope="session")
def modern_boot(lab_ready: None) -> lab.Run:
    """One boot of Debian sid (systemd >= 261, Linux 7.x) that runs every scenario of
    plan.MODERN."""
    return _wait(SCHEDULER.boot(PLANNED["modern_boot"]))


@pytest.fixture(scope="session")
def trixie_boot(lab_ready: None) -> lab.Run:
    """One boot of Debian 13 (its own kernel) that runs every scenario of plan.DEBIAN13."""
    return _wait(SCHEDULER.boot(PLANNED["trixie_boot"]))


@pytest.fixture(scope="session")
def small_boot(lab_ready: None) -> lab.Run:
    return _wait(SCHEDULER.boot(PLANNED["small_boot"]))


@pytest.fixture(scope="session")
def near_boot(lab_ready: None) -> lab.Run:
    """One boot of a q35 machine with devices behind a PCI expander bridge on node 1 that runs
    plan.NEAR_SCENARIOS (option near and near-irqs, issue 38)."""
    return _wait(SCHEDULER.boot(PLANNED["near_boot"]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for name, run in BOOTS.items():
        times = ", ".join(f"{r.name} {r.seconds:.0f}/{run.cpu_by_state.get(r.name, 0):.0f}"
                          for r in run.results.values())
        terminalreporter.write_line(
            f"VM lab boot {name}: booted in {run.boot_seconds:.0f} s "
            f"({run.cpu_by_state.get('boot', 0):.0f} s of CPU), whole run "
            f"{run.total_seconds:.0f} s ({run.cpu_seconds:.0f} s of CPU); scenarios "
            f"(s, wall/CPU): {times}")
        if run.boot_panic:
            terminalreporter.write_line(f"VM lab boot {name}: booted again after a kernel "
                                        f"panic: {run.boot_panic[:1200]}")
        if "sysfs" in run.results:  # what the kernel showed half-way through hotplug
            for line in run.results["sysfs"].output.splitlines():
                if '"transitions"' in line:
                    states = line[len(lab.RESULT):]
                    terminalreporter.write_line(f"VM lab kernel hotplug states: {states}")
