"""VM lab: QEMU (software emulation) booting a Debian kernel on a debootstrapped Debian root.

Three releases (RELEASE: bookworm, trixie, sid; podman is Debian 12 with podman): Debian 12
(``BOOKWORM``: the host's own kernel from /boot, systemd 252), Debian 13 (``TRIXIE``: the kernel
installed in the image itself, Linux 6.12, systemd 257) and Debian sid (``SID``: its own kernel
too, systemd >= 261 with ``CPUSetPartition=``). Every image comes from the Debian archive this
machine's apt uses (``mirror()``), whichever release the machine runs.

Default shape: 8 vCPUs as 2 sockets x 2 cores x 2 threads, 2 NUMA nodes, pure cgroup v2, udev,
polkitd and an unprivileged user ``alice``. The root filesystem image is built once and cached,
keyed by its recipe; every run boots it with ``snapshot=on`` (the image never changes) plus a small
payload disk holding the checkout's package and the scenarios. A oneshot unit in the image runs
each scenario as root and writes its output and exit status to the second serial port, then
powers off.

    python -m tests.envs.lab [--RELEASE] build           # build (or find) the cached image
    python -m tests.envs.lab [--RELEASE] run SCRIPT...   # boot once, run scripts, print output
    python -m tests.envs.lab mirror                      # the archive the images come from
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CPUSERVICE_LAB_CACHE", "/var/cache/cpuservice-lab"))
PAYLOAD_DIRS = ("cpuservice", "dbus", "systemd", "scripts", "tests/lab/scenarios")
PACKAGES = (
    "systemd", "systemd-sysv", "libpam-systemd", "dbus", "udev", "polkitd", "python3",
    "python3-dbus-fast", "python3-pydantic", "python3-pyudev", "procps", "util-linux",
    "irqbalance", "prometheus-node-exporter",
    "rt-tests", "stress-ng",  # lending (issue 26): cyclictest as the owner, a borrower
)


@dataclass(frozen=True)
class Release:
    """A Debian release the lab can boot: its suite, packages, and where its kernel comes from
    (the host's /boot, or the image's own /boot, copied out beside the cached image)."""

    suite: str
    packages: tuple[str, ...]
    own_kernel: bool = False
    panic_boots: int = 0  # boots again after a kernel panic anywhere, at most this often
    cpu: str = "Skylake-Server"  # QEMU's -cpu model
    tcg_threads: str = "multi"  # QEMU's TCG: a host thread per vCPU (multi) or one (single)
    name: str = ""  # the cached image's name when not the suite's (another package set)

    @property
    def label(self) -> str:
        return self.name or self.suite


BOOKWORM = Release("bookworm", PACKAGES)
# Sid's Linux 7.2.13 panicked now and then under QEMU's software emulation with -cpu
# Skylake-Server, in scheduler and timer code (sched_clock_cpu and enqueue_timer 2 s into a boot,
# update_sd_lb_stats and update_se later), whatever ran: about 4 of 20 boots. With -cpu max (the
# features TCG itself implements, none it only claims): 1 of 23 (issue 23: 20 of 20 under load in
# a dedicated run, then enqueue_task_fair 2 s into one of three test runs' boots). A panic is
# reported, and the boot tried again, up to three times. Later, under a loaded host, it panicked
# in 4 of 4 boots that ran a hotplug storm (25 rounds of CPUs 1, 3, 5, 7 off and on, two busy
# loops on the host): "Oops: int3" in scheduler code, a breakpoint the kernel places while it
# patches its own code (static keys flip as SMT siblings go off and on) seen by another vCPU
# after the patch, which QEMU's multi-threaded TCG allows. With one TCG thread for all vCPUs:
# 0 of 2, at about the same host CPU (57 s for the boot and the storm); its wall time is its
# CPU time, which in the gate's CPU-bound lanes is what a boot costs anyway.
# Debian 12 with podman and a static busybox to build a local image from (no registry, no
# network): the containers lab (tests/lab/test_lab_containers.py), its own cached image.
PODMAN = Release("bookworm", (*PACKAGES, "podman", "netavark", "crun", "conmon",
                              "busybox-static"), name="podman")
SID = Release("sid", (*PACKAGES, "linux-image-amd64"), own_kernel=True, panic_boots=3,
              cpu="max", tcg_threads="single")
# Debian 13, Debian's stable release since August 2025, with its own kernel (Linux 6.12) and
# systemd 257: the package and the service on it (tests/lab/test_lab_debian13.py). Its kernel
# panicked once with -cpu Skylake-Server on a loaded host (get_page_from_freelist, in an
# interrupt, 220 s into the boot), so it boots with -cpu max and again after a panic, as sid.
TRIXIE = Release("trixie", (*PACKAGES, "linux-image-amd64"), own_kernel=True, panic_boots=3,
                 cpu="max")
RELEASES = {"bookworm": BOOKWORM, "podman": PODMAN, "trixie": TRIXIE, "sid": SID}
RUNNER = """#!/bin/sh
# Mounts the payload disk and runs its runner (so the runner can change without a new image).
mkdir -p /payload
mount -o ro /dev/vdb /payload
exec >/dev/ttyS1 2>&1
echo "@@BOOTED $(cut -d' ' -f1 /proc/uptime)"
sh /payload/runner.sh
systemctl poweroff --no-block
"""
# On the payload: every scenario in order, each under its own time limit (then killed, reason
# printed); a scenario whose `needs` failed is not run (status 77). The VM powers off after.
PAYLOAD_RUNNER = """#!/bin/sh
echo "@@LAB-BEGIN"
: > /run/lab-failed
for script in /payload/scenarios/*.sh; do
    name=$(basename "$script" .sh)
    read -r limit needs < "/payload/scenarios/$name.conf"
    missing=""
    for need in $needs; do grep -qx "$need" /run/lab-failed && missing="$missing $need"; done
    echo "@@SCENARIO-BEGIN $name $(cut -d' ' -f1 /proc/uptime)"
    if [ -n "$missing" ]; then
        echo "not run: it needs$missing, which failed"
        status=77
    else
        (cd /payload && PYTHONPATH=/payload timeout -k 5 "$limit" sh "$script")
        status=$?
        [ "$status" = 124 ] || [ "$status" = 137 ] && echo "TIMEOUT: $name ran over $limit s"
    fi
    if [ "$status" != 0 ]; then
        echo "${name#*-}" >> /run/lab-failed
        [ "$status" = 77 ] || journalctl -b -u cpuservice --no-pager -n 30 -o short-monotonic
    fi
    echo "@@SCENARIO-END $name $status $(cut -d' ' -f1 /proc/uptime)"
done
echo "@@LAB-END"
python3 -c 'import termios; termios.tcdrain(1)'
systemctl poweroff -ff
"""
UNIT = """[Unit]
Description=cpuservice lab scenarios
After=multi-user.target dbus.service polkit.service systemd-logind.service systemd-udevd.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/cpuservice-lab-runner

[Install]
WantedBy=multi-user.target
"""
RECIPE_VERSION = 3
# Every guest boots without the CPU vulnerability mitigations (page-table isolation, retpolines,
# flushes on every kernel entry): under software emulation they are the costliest part of each
# system call, and nothing the lab proves depends on them. Measured, the same boot and work
# (Python starts, systemctl daemon-reload, small reads) twice each: 39/44 -> 30/35 s of the
# host's CPU to boot, 75/86 -> 57/59 s for the work.
GUEST_ARGS = ("mitigations=off systemd.mask=ldconfig.service "
              "systemd.mask=systemd-journal-catalog-update.service "
              "systemd.mask=systemd-update-done.service systemd.mask=getty@tty1.service "
              "systemd.mask=modprobe@drm.service systemd.mask=systemd-binfmt.service")
BOOT_ALLOWANCE = 300  # seconds from QEMU's start to the first scenario, with room


class LabError(RuntimeError):
    pass


@dataclass(frozen=True)
class Shape:
    """CPU and NUMA shape of one VM, plus extra kernel arguments."""

    sockets: int = 2
    cores: int = 2
    threads: int = 2
    nodes: int = 2
    memory_mb: int = 2048
    append: str = ""
    machine: str = ""  # QEMU's -machine ("": its default, i440fx)
    # more QEMU arguments (devices); "{workdir}" is the run's directory (for backing files,
    # made by ``disks``: file name -> size in MiB, sparse)
    qemu: tuple[str, ...] = ()
    disks: tuple[tuple[str, int], ...] = ()

    @property
    def cpus(self) -> int:
        return self.sockets * self.cores * self.threads


@dataclass(frozen=True)
class Scenario:
    """A shell script run as root in the VM, killed after ``timeout`` seconds; not run when a
    scenario it ``needs`` failed."""

    script: str
    timeout: int = 120
    needs: tuple[str, ...] = ()


SKIPPED = 77


RESULT = "RESULT "  # a scenario reports a check as this, then one JSON object, on one line


@dataclass(frozen=True)
class Result:
    name: str
    status: int
    output: str
    seconds: float = 0.0

    def rows(self) -> list[dict[str, Any]]:
        """The checks the scenario reported (RESULT lines), in order."""
        return [json.loads(line[len(RESULT):]) for line in self.output.splitlines()
                if line.startswith(RESULT)]

    def checks(self) -> dict[str, dict[str, Any]]:
        """The reported checks by their "check" name (the last one of a name wins)."""
        return {row["check"]: row for row in self.rows()}


def kernel(boot: Path = Path("/boot")) -> tuple[Path, Path]:
    """The newest Debian kernel in ``boot`` with its initrd."""
    for vmlinuz in sorted(boot.glob("vmlinuz-*"), reverse=True):
        initrd = boot / vmlinuz.name.replace("vmlinuz-", "initrd.img-")
        if initrd.exists():
            return vmlinuz, initrd
    raise LabError(f"no kernel with an initrd in {boot} (scripts/install-deps.sh lab)")


# Debian's suites by name: a source with one of these (or the host's own codename) is Debian's
# main archive; -security, -updates and -backports suites are not.
DEBIAN_SUITES = frozenset({"bullseye", "bookworm", "trixie", "forky", "duke", "sid", "oldstable",
                           "stable", "testing", "unstable"})


def _sources(text: str) -> Iterator[tuple[str, list[str]]]:
    """(URI, suites) of every Debian archive entry in an apt sources file: deb822 stanzas and
    one-line entries."""
    for stanza in re.split(r"\n\s*\n", text):
        uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
        suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
        types = re.search(r"^Types:\s*(.+)$", stanza, re.M)
        enabled = re.search(r"^Enabled:\s*(\S+)", stanza, re.M)
        if uris and suites and (not types or "deb" in types.group(1).split()) and (
                not enabled or enabled.group(1).lower() not in ("no", "false")):
            yield uris.group(1), suites.group(1).split()
    for line in text.splitlines():
        m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s", line)
        if m:
            yield m.group(1), [m.group(2)]


def host_codename(os_release: Path = Path("/etc/os-release")) -> str:
    """This machine's Debian codename (bookworm, trixie, ...), or "" when it has none."""
    text = os_release.read_text() if os_release.exists() else ""
    m = re.search(r"^VERSION_CODENAME=\"?([a-z]+)", text, re.M)
    return m.group(1) if m else ""


def mirror(apt: Path = Path("/etc/apt"), codename: str | None = None) -> str:
    """The Debian archive this machine's apt uses (never hard-coded in the project): the source of
    the machine's own release (Debian 12, 13 or later), else any source of a Debian suite;
    ``CPUSERVICE_MIRROR`` overrides it. Every lab release is debootstrapped from it, whichever
    release the machine runs: the archive carries them all."""
    if os.environ.get("CPUSERVICE_MIRROR"):
        return os.environ["CPUSERVICE_MIRROR"]
    own = host_codename() if codename is None else codename
    paths = [*sorted((apt / "sources.list.d").glob("*.sources")), apt / "sources.list",
             *sorted((apt / "sources.list.d").glob("*.list"))]
    entries = [entry for path in paths if path.exists() for entry in _sources(path.read_text())]
    for wanted in ({own} - {""}, DEBIAN_SUITES):
        for uri, suites in entries:
            if wanted & set(suites):
                return uri
    raise LabError(f"no Debian archive ({own or 'any Debian suite'}) found in the apt sources "
                   f"under {apt}; set CPUSERVICE_MIRROR=URL")


def recipe_key(release: Release = BOOKWORM) -> str:
    recipe = {"version": RECIPE_VERSION, "suite": release.suite, "packages": release.packages,
              "runner": RUNNER, "unit": UNIT}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def base_image(release: Release = BOOKWORM) -> Path:
    """The cached root filesystem image of ``release`` for the current recipe, built when
    missing (with, for a release with its own kernel, that kernel and initrd beside it)."""
    image = CACHE / f"{release.label}-{recipe_key(release)}.img"
    with _locked(CACHE / "build.lock"):
        if image.exists():
            return image
        for old in [*CACHE.glob(f"{release.label}-*"), *CACHE.glob("base-*.img")]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        rootfs = CACHE / f"rootfs-{release.label}.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(release.packages)}",
             release.suite, str(rootfs), mirror()],
            check=True, stdout=subprocess.DEVNULL,
        )
        _customize(rootfs)
        if release.own_kernel:
            boot = image.with_suffix(".boot")
            boot.mkdir()
            for part in kernel(rootfs / "boot"):
                shutil.copy(part, boot / part.name)
        partial = image.with_suffix(".tmp")
        _mkfs(rootfs, partial, "3G")
        partial.rename(image)
        shutil.rmtree(rootfs)
    return image


def kernel_of(release: Release, image: Path) -> tuple[Path, Path]:
    """The kernel and initrd to boot ``image`` of ``release`` with."""
    return kernel(image.with_suffix(".boot")) if release.own_kernel else kernel()


def _mkfs(tree: Path, image: Path, size: str) -> None:
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(image)], check=True)


def _customize(rootfs: Path) -> None:
    systemd = rootfs / "etc/systemd/system"
    (systemd / "serial-getty@ttyS0.service").symlink_to("/dev/null")
    (systemd / "serial-getty@ttyS1.service").symlink_to("/dev/null")
    runner = rootfs / "usr/local/sbin/cpuservice-lab-runner"
    runner.parent.mkdir(parents=True, exist_ok=True)
    runner.write_text(RUNNER)
    runner.chmod(0o755)
    (systemd / "cpuservice-lab.service").write_text(UNIT)
    wants = systemd / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    (wants / "cpuservice-lab.service").symlink_to("/etc/systemd/system/cpuservice-lab.service")
    (rootfs / "etc/hostname").write_text("cpuservice-lab\n")
    # irqbalance is there for the interrupt isolation scenario, which starts it itself
    (wants / "irqbalance.service").unlink(missing_ok=True)
    # the node exporter is there for the metrics scenario, which starts it itself
    (wants / "prometheus-node-exporter.service").unlink(missing_ok=True)
    subprocess.run(["chroot", str(rootfs), "useradd", "-m", "alice"], check=True)


def _payload(workdir: Path, scenarios: Mapping[str, Scenario], files: Sequence[Path]) -> Path:
    tree = workdir / "payload"
    (tree / "files").mkdir(parents=True)
    for extra in files:
        shutil.copy(extra, tree / "files" / extra.name)
    for name in PAYLOAD_DIRS:
        if (CHECKOUT / name).is_dir():
            shutil.copytree(CHECKOUT / name, tree / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (tree / "runner.sh").write_text(PAYLOAD_RUNNER)
    (tree / "scenarios").mkdir()
    for i, (name, scenario) in enumerate(scenarios.items()):
        if not re.fullmatch(r"[a-z0-9-]+", name):
            raise LabError(f"scenario name {name!r}: use a-z, 0-9 and -")
        unknown = set(scenario.needs) - set(list(scenarios)[:i])
        if unknown:
            raise LabError(f"scenario {name} needs {sorted(unknown)}, which do not run before it")
        (tree / "scenarios" / f"{i:02d}-{name}.sh").write_text(scenario.script)
        (tree / "scenarios" / f"{i:02d}-{name}.conf").write_text(
            f"{scenario.timeout} {' '.join(scenario.needs)}\n")
    image = workdir / "payload.img"
    _mkfs(tree, image, "64M")
    return image


def _qemu_argv(shape: Shape, base: Path, payload: Path, workdir: Path,
               boot: tuple[Path, Path], cpu: str = BOOKWORM.cpu,
               tcg_threads: str = BOOKWORM.tcg_threads) -> list[str]:
    vmlinuz, initrd = boot
    per_node = shape.cpus // shape.nodes
    mem = shape.memory_mb // shape.nodes
    numa: list[str] = []
    for n in range(shape.nodes):
        numa += ["-object", f"memory-backend-ram,id=m{n},size={mem}M",
                 "-numa", f"node,nodeid={n},cpus={n * per_node}-{(n + 1) * per_node - 1},"
                 f"memdev=m{n}"]
    for name, size in shape.disks:
        with open(workdir / name, "wb") as disk:
            disk.truncate(size << 20)
    return [
        "qemu-system-x86_64", "-accel", f"tcg,thread={tcg_threads}", "-m", f"{shape.memory_mb}M",
        *(["-machine", shape.machine] if shape.machine else []),
        "-smp", f"{shape.cpus},sockets={shape.sockets},cores={shape.cores},"
        f"threads={shape.threads}",
        "-cpu", cpu, *numa,
        "-display", "none", "-vga", "none", "-nic", "none", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{workdir}/console.log", "-serial", f"file:{workdir}/scenarios.log",
        *_disks(shape, base, payload),
        "-kernel", str(vmlinuz), "-initrd", str(initrd),
        "-append", f"console=ttyS0 root=/dev/vda rw panic=-1 quiet {GUEST_ARGS} "
                   f"{shape.append}".strip(),
        *(arg.replace("{workdir}", str(workdir)) for arg in shape.qemu),
    ]


def _disks(shape: Shape, base: Path, payload: Path) -> list[str]:
    """The root (vda) and payload (vdb) disks: QEMU places them on the newest PCI bus, so with
    a machine of its own (PCI expander bridges) on the root bus, in that order, explicitly."""
    drives = [f"file={base},format=raw,if=virtio,snapshot=on",
              f"file={payload},format=raw,if=virtio,readonly=on"]
    if not shape.machine:
        return [arg for drive in drives for arg in ("-drive", drive)]
    out = []
    for i, drive in enumerate(drives):
        out += ["-drive", drive.replace("if=virtio", f"if=none,id=vd{i}"),
                "-device", f"virtio-blk-pci,drive=vd{i},bus=pcie.0,addr={4 + i:#x}"]
    return out


@dataclass
class Run:
    """What one boot produced."""

    results: dict[str, Result]
    boot_seconds: float
    total_seconds: float
    console: str
    boot_panic: str = ""  # a kernel panic while booting, after which it booted again
    # QEMU's CPU time on the host (user + system, every thread), in all and by what the VM was
    # doing then (boot, a scenario's name, between scenarios, poweroff): what a boot costs the
    # machine, as against its wall time (an idle guest costs little under TCG)
    cpu_seconds: float = 0.0
    cpu_by_state: dict[str, float] = field(default_factory=dict)


def run(
    scenarios: Mapping[str, str | Scenario],
    shape: Shape = Shape(),
    files: Sequence[Path] = (),
    release: Release = BOOKWORM,
    nice: int = 0,
) -> Run:
    """Boot ``release`` once, run the scenarios (name -> shell script or Scenario) in order,
    return their results. ``files`` are copied to /payload/files in the VM. The whole run is
    bounded by the boot allowance plus every scenario's time limit. ``nice`` > 0: QEMU runs at
    that niceness (its threads and its autogroup), taking what CPU the rest leaves.

    A kernel that panics while booting, before the first scenario, is booted once more; a
    release with ``panic_boots`` is booted again after a panic anywhere, that often. Every panic
    is reported in ``Run.boot_panic``; one more fails the run."""
    plan = {n: s if isinstance(s, Scenario) else Scenario(s) for n, s in scenarios.items()}
    base = base_image(release)
    boot = kernel_of(release, base)
    panics: list[str] = []
    while True:
        try:
            outcome = _run_once(plan, shape, files, base, boot, bool(release.panic_boots),
                                release.cpu, nice, release.tcg_threads)
        except _BootPanic as panic:
            panics.append(str(panic))
            if len(panics) > max(1, release.panic_boots):
                raise LabError(f"the kernel panicked in {len(panics)} boots: "
                               + " | ".join(panics)) from None
            continue
        outcome.boot_panic = " | ".join(panics)
        return outcome


class _BootPanic(LabError):
    """The kernel panicked (and may boot again)."""


def _run_once(plan: Mapping[str, Scenario], shape: Shape, files: Sequence[Path], base: Path,
              boot: tuple[Path, Path], any_panic: bool = False, cpu: str = BOOKWORM.cpu,
              nice: int = 0, tcg_threads: str = BOOKWORM.tcg_threads) -> Run:
    # a niced QEMU gets what CPU the rest leaves: it may take longer to boot
    allowance = BOOT_ALLOWANCE * (2 if nice else 1)
    timeout = allowance + sum(s.timeout + 10 for s in plan.values())
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cpuservice-lab-", dir="/var/tmp") as tmp:
        workdir = Path(tmp)
        payload = _payload(workdir, plan, files)
        env = {**os.environ, "TMPDIR": str(workdir)}
        # QEMU gets SIGKILL when the thread that started it ends (the test run is over, or
        # was killed); setpriv sets that in QEMU's process, no Python runs after fork()
        niced = ["nice", "-n", str(nice)] if nice else []
        argv = _qemu_argv(shape, base, payload, workdir, boot, cpu, tcg_threads)
        qemu = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", *niced, *argv],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        if nice:  # a session of its own is an autogroup of its own: the scheduler shares the
            # CPU between autogroups first, so the autogroup's niceness is the one that counts
            with contextlib.suppress(OSError):
                Path(f"/proc/{qemu.pid}/autogroup").write_text(f"{nice}\n")
        spent: dict[str, float] = {}
        reason = _watch(qemu, workdir / "scenarios.log", plan, timeout, spent, allowance)
        if reason:
            qemu.kill()
            qemu.communicate()
            raise LabError(f"{reason}: {_tail(workdir)}")
        _, err = qemu.communicate()
        total = time.monotonic() - began
        log = (workdir / "scenarios.log").read_text(errors="replace")
        console = (workdir / "console.log").read_text(errors="replace")
        if "@@LAB-END" not in log:
            if "Kernel panic" in console and (any_panic or "@@SCENARIO-BEGIN" not in log):
                raise _BootPanic(_tail(workdir))
            raise LabError(f"VM ended early (qemu {qemu.returncode}: {err.decode()[-500:]}); "
                           f"console: {console[-1500:]} scenarios: {log[-1500:]}")
        results = _parse(log)
        booted = re.search(r"@@BOOTED ([0-9.]+)", log)
        return Run(results, float(booted.group(1)) if booted else 0.0, total, console,
                   cpu_seconds=sum(spent.values()), cpu_by_state=spent)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all its threads), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _watch(qemu: subprocess.Popen[bytes], log_path: Path, plan: Mapping[str, Scenario],
           timeout: float, cpu: dict[str, float] | None = None,
           allowance: int = BOOT_ALLOWANCE) -> str | None:
    """Follow the VM's report until QEMU exits. The reason to stop it early, if any: it did not
    boot within ``allowance``, a scenario ran well over its limit (the VM's own timeout should
    have ended it), it did not power off after the last scenario, or the whole run is over.
    ``cpu`` gets QEMU's CPU seconds by state (read every half second: the last half second of
    a state may count for the next)."""
    limits = {f"{i:02d}-{n}": s.timeout for i, (n, s) in enumerate(plan.items())}
    began = time.monotonic()
    state, since = "boot", began
    used = 0.0
    cpu = {} if cpu is None else cpu
    while qemu.poll() is None:
        time.sleep(0.5)
        now = time.monotonic()
        total = _cpu_seconds(qemu.pid)
        if total is not None:
            key = "between" if state.startswith("between") else re.sub(r"^\d+-", "", state)
            cpu[key] = cpu.get(key, 0.0) + total - used
            used = total
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        starts = re.findall(r"@@SCENARIO-BEGIN (\S+)", log)
        ends = re.findall(r"@@SCENARIO-END (\S+)", log)
        if "@@LAB-END" in log:
            current, limit = "poweroff", 120
        elif len(starts) > len(ends):
            current, limit = starts[-1], limits.get(starts[-1], 0) + 30
        elif "@@BOOTED" in log:
            current, limit = f"between scenarios after {len(ends)}", 60
        else:
            current, limit = "boot", allowance
        if current != state:
            state, since = current, now
        if now - since > limit:
            return f"stopped the VM: {state} took over {limit} s"
        if now - began > timeout:
            return f"stopped the VM: the whole run took over {timeout} s"
    return None


def _tail(workdir: Path) -> str:
    parts = []
    for name in ("console.log", "scenarios.log"):
        path = workdir / name
        if path.exists():
            text = path.read_text(errors="replace")
            # a kernel oops: from its first line; scenarios: enough to see the last ones
            oops = max(text.find("------------[ cut here ]"), text.find("BUG: "))
            parts.append(f"{name}: {text[oops:oops + 3000] if oops >= 0 else text[-1500:]}"
                         if name == "console.log" else f"{name}: {text[-6000:]}")
    return " | ".join(parts)


def _parse(log: str) -> dict[str, Result]:
    results = {}
    pattern = (r"@@SCENARIO-BEGIN \d+-(\S+) ([0-9.]+)\r?\n(.*?)"
               r"@@SCENARIO-END \d+-\1 (\d+) ([0-9.]+)")
    for m in re.finditer(pattern, log, re.S):
        results[m.group(1)] = Result(m.group(1), int(m.group(4)), m.group(3).replace("\r", ""),
                                     float(m.group(5)) - float(m.group(2)))
    return results


def main(argv: Sequence[str]) -> int:
    release = BOOKWORM
    if argv[:1] and argv[0][2:] in RELEASES:
        release, argv = RELEASES[argv[0][2:]], argv[1:]
    if argv[:1] == ["build"]:
        print(base_image(release))
        return 0
    if argv[:1] == ["mirror"]:
        print(mirror())
        return 0
    if argv[:1] == ["run"] and len(argv) > 1:
        scripts = {re.sub(r"[^a-z0-9-]", "-", Path(p).stem.lower()): Path(p).read_text()
                   for p in argv[1:]}
        outcome = run(scripts, release=release)
        for result in outcome.results.values():
            print(f"== {result.name}: exit {result.status}\n{result.output}")
        print(f"boot {outcome.boot_seconds:.1f} s, total {outcome.total_seconds:.1f} s")
        return max((r.status for r in outcome.results.values()), default=1)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
