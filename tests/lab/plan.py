"""What the VM lab runs, in as few boots as possible: one boot of the default shape runs every
scenario below in order (each with its own time limit; a scenario whose `needs` failed is not
run), one small boot checks another shape with kernel arguments. The test modules read the
results of the shared boots (tests/lab/conftest.py)."""

from __future__ import annotations

from tests.envs.lab import Scenario, Shape

LIB = ". /payload/tests/lab/scenarios/lib.sh\n"
M = "org.cpuservice1 /org/cpuservice1 org.cpuservice1.Manager"
A = "org.cpuservice1 /org/cpuservice1/allocation/pkg org.cpuservice1.Allocation"
HOTPLUG = "python3 /payload/tests/lab/scenarios/hotplug.py"
IRQS = "python3 /payload/tests/lab/scenarios/irqs.py"
PARTITIONS = "python3 /payload/tests/lab/scenarios/partitions.py"

TOPOLOGY = """python3 - <<'PY'
import json
from cpuservice.host.sysfs import discover
t = discover("/sys")
print(json.dumps({"cpus": len(t.cpus), "sockets": len(t.sockets), "nodes": len(t.nodes),
                  "cores": len(t.cores), "tpc": t.threads_per_core, "isolated": str(t.isolated),
                  "sibling0": str(t.cores[t.cpus[0].core])}))
PY
"""
UDEV = LIB + """
udevadm monitor --kernel --udev --subsystem-match=cpu > /tmp/udevadm.log &
monitor=$!
python3 - > /tmp/pyudev.log <<'PY' &
import pyudev, select
ctx = pyudev.Context()
mon = pyudev.Monitor.from_netlink(ctx, source="kernel")
mon.filter_by("cpu")
mon.start()
seen = 0
while seen < 2 and select.select([mon.fileno()], [], [], 30)[0]:
    while (dev := mon.poll(timeout=0)) is not None:
        print(dev.action, dev.sys_name, flush=True)
        seen += 1
PY
pyudev=$!
sleep 3
echo 0 > /sys/devices/system/cpu/cpu3/online
echo "online after offline: $(cat /sys/devices/system/cpu/online)"
sleep 1
echo 1 > /sys/devices/system/cpu/cpu3/online
echo "online after online: $(cat /sys/devices/system/cpu/online)"
wait $pyudev
sleep 1
kill $monitor
cat /tmp/udevadm.log /tmp/pyudev.log
"""
POLKIT = """
id alice
runuser -u alice -- systemd-run --no-ask-password true
echo "systemd-run status $?"
runuser -u alice -- busctl call --allow-interactive-authorization=no org.freedesktop.systemd1 \\
  /org/freedesktop/systemd1 org.freedesktop.systemd1.Manager StartUnit ss ssh.service fail
echo "busctl status $?"
"""
# The Debian package (its two versions in /payload/files): installed, an enforced allocation;
# then (DEB_LIFECYCLE) upgraded with it live, removed and purged. dpkg's warnings are reported.
DPKG = """F=/payload/files
dpkg_() {  # dpkg ARGS: prints its warnings on one line; exit status dpkg's
    out=$(dpkg "$@" 2>&1); rc=$?
    echo "warnings: $(echo "$out" | grep -i warning | tr '\\n' ' ')"
    return $rc
}
"""
DEB_INSTALL = DPKG + f"""
dpkg_ -i $F/cpuservice_0.1.0_all.deb; echo "install $?"
echo "active $(systemctl is-active cpuservice)"
echo "unitfile $(systemctl show cpuservice -p FragmentPath --value)"
busctl introspect org.cpuservice1 /org/cpuservice1 >/dev/null; echo "introspect $?"
busctl call {M} Allocate 'ssa{{sv}}' pkg 2 1 bind b true >/dev/null
systemd-run --slice=cpuservice-bound-pkg.slice --unit=pkgworker sleep 1000
pid=$(systemctl show pkgworker -p MainPID --value)
echo "$pid" > /run/pkgworker.pid
echo "cpuset $(busctl get-property {A} CPUSet)"
echo "process $(grep Cpus_allowed_list /proc/$pid/status | cut -f2)"
"""
DEB_LIFECYCLE = DPKG + f"""
pid=$(cat /run/pkgworker.pid)
before=$(systemctl show cpuservice -p MainPID --value)
echo "== upgrade"
dpkg_ -i $F/cpuservice_0.1.1_all.deb; echo "upgrade $?"
echo "version $(dpkg-query -W -f '${{Version}}' cpuservice)"
echo "active $(systemctl is-active cpuservice)"
echo "restarted $([ "$(systemctl show cpuservice -p MainPID --value)" != "$before" ] && echo yes)"
echo "cpuset $(busctl get-property {A} CPUSet)"
echo "process $(grep Cpus_allowed_list /proc/$pid/status | cut -f2)"
echo "== remove"
dpkg_ -r cpuservice; echo "remove $?"
echo "active $(systemctl is-active cpuservice)"
echo "units $(systemctl list-units --all --plain --no-legend 'cpuservice*' \\
    | grep -v cpuservice-lab | awk '$3 != "inactive" || $1 ~ /slice$/ {{print $1 ":" $3}}' \\
    | tr '\\n' ' ')"
echo "process $(kill -0 $pid 2>/dev/null && echo alive || echo gone)"
echo "== purge"
dpkg_ -P cpuservice; echo "purge $?"
echo "left: $(find / -xdev \\( -path /proc -o -path /sys -o -path /payload -o -path /var/lib/dpkg \\
    -o -path /var/log \\) -prune -o -name '*cpuservice*' -print | grep -v cpuservice-lab \\
    | tr '\\n' ' ')"
"""
DEB = DEB_INSTALL + DEB_LIFECYCLE
INSTALL = LIB + """
step 240 "scripts/install.sh" bash /payload/scripts/install.sh >/dev/null
systemctl is-active cpuservice
"""
CLI = LIB + r"""
A="org.cpuservice1 /org/cpuservice1/allocation"
holds() { busctl call $M ListAllocations | grep -q "\"$1\""; }
released() { ! holds "$1"; }
step 90 "cpuservice-run --name vmrun" cpuservice-run --cpus 2 --bind --name vmrun -- sh -c \
    "grep Cpus_allowed_list /proc/self/status; busctl get-property $A/vmrun \
     org.cpuservice1.Allocation CPUSet"
echo "exit 0"
wait_until 15 "vmrun released after its command ended" released vmrun
echo "after exit: 0"
cpuservice-run --cpus 1 --bind --name vmkill -- sh -c 'echo $$ > /run/vmkill.pid; exec sleep 300' &
wrapper=$!
i=0
until [ -s /run/vmkill.pid ]; do
    kill -0 $wrapper 2>/dev/null || { wait $wrapper; fail "cpuservice-run --name vmkill ended \
(exit $?) before its command started"; }
    i=$((i + 1)); [ $i -gt 600 ] && fail "the command of vmkill did not start within 60 s"
    sleep 0.1
done
holds vmkill && echo "running: 1"
kill -9 "$(cat /run/vmkill.pid)"
wait_until 15 "vmkill released after kill -9 of the wrapper" released vmkill
echo "after kill: 0"
"""
RULE = """polkit.addRule(function(action, subject) {
    if (action.id == "org.cpuservice1.allocate" && subject.user == "alice") {
        return polkit.Result.YES;
    }
});"""
ACCESS = f"""
M="{M}"
as_alice() {{ runuser -u alice -- timeout 60 busctl "$@"; echo "status $?"; }}
busctl call $M Allocate 'ssa{{sv}}' rootalloc 1 1 bind b true
echo "== reads"
as_alice get-property $M SharedCPUs
as_alice call $M ListAllocations
echo "== denied"
as_alice call $M Allocate 'ssa{{sv}}' alicealloc 1 1 bind b true
echo "== granted"
printf '%s\\n' '{RULE}' > /etc/polkit-1/rules.d/50-alice.rules
systemctl restart polkit
as_alice call $M Allocate 'ssa{{sv}}' alicealloc 1 1 bind b true
as_alice get-property org.cpuservice1 /org/cpuservice1/allocation/alicealloc \\
    org.cpuservice1.Allocation Owner
echo "== not root's"
as_alice call $M Release s rootalloc
as_alice call $M Resize ss rootalloc 2
echo "== alice attaches her own session's process"
runuser -l alice -c 'exec sleep 300' &
i=0
until pid=$(pgrep -u alice -x sleep | head -1) && [ -n "$pid" ]; do
    i=$((i + 1)); [ $i -gt 100 ] && break; sleep 0.1
done
echo "cgroup $(cut -d: -f3 /proc/$pid/cgroup | tail -1)"
as_alice call $M Attach sau alicealloc 1 $pid
echo "process $(grep Cpus_allowed_list /proc/$pid/status | cut -f2)"
echo "== alice may not move her process out of a system service"
systemd-run --uid=alice --unit=alice-svc sleep 300 >/dev/null 2>&1
svcpid=$(systemctl show -p MainPID --value alice-svc)
as_alice call $M Attach sau alicealloc 1 $svcpid
systemctl stop alice-svc
kill $pid 2>/dev/null
echo "== root releases alice's"
busctl call $M Release s alicealloc; echo "status $?"
busctl call $M ListAllocations
"""
HARDENING = """systemd-analyze security cpuservice.service --no-pager | grep -E '✗|Overall'"""
FULL_DISK = LIB + r"""
# The state directory on a small filesystem that is then filled: requests answer a named error
# and change nothing; what was acknowledged survives a restart; the service keeps serving.
step 30 "stop cpuservice" systemctl stop cpuservice
mkdir -p /var/lib/cpuservice && cp -a /var/lib/cpuservice /tmp/state-copy
step 10 "mount a small state filesystem" \
    mount -t tmpfs -o size=256k,mode=0700 tmpfs /var/lib/cpuservice
cp -a /tmp/state-copy/. /var/lib/cpuservice/
step 60 "start cpuservice" systemctl start cpuservice
names() {
    busctl --json=short call $M ListAllocations | python3 -c \
        'import json,sys; print(" ".join(sorted(r[0] for r in json.load(sys.stdin)["data"][0])))'
}
already=$(names)
busctl call $M Allocate 'ssa{sv}' before 1 1 bind b true >/dev/null || fail "Allocate before"
dd if=/dev/zero of=/var/lib/cpuservice/filler bs=4k 2>/dev/null
echo "free $(df --output=avail -k /var/lib/cpuservice | tail -1)"
ok="before"
for i in $(seq 1 30); do
    if out=$(busctl call $M Allocate 'ssa{sv}' full$i 1 0 2>&1); then ok="$ok full$i"
    else echo "refused full$i: $out"; fi
done
busctl call $M Release s before >/dev/null 2>&1 && ok=${ok#before} && echo "released before"
echo "acknowledged $ok"
echo "active $(systemctl is-active cpuservice)"
rm -f /var/lib/cpuservice/filler
busctl call $M Allocate 'ssa{sv}' after 1 1 bind b true >/dev/null || fail "Allocate after"
ok="$ok after"
step 60 "restart cpuservice" systemctl restart cpuservice
have=$(names)
want=$(echo $already $ok | tr ' ' '\n' | sort | tr '\n' ' ' | sed 's/ $//')
echo "after restart: $have"
echo "expected: $want"
[ "$have" = "$want" ] || fail "allocations after restart differ from what was acknowledged"
for name in $ok; do busctl call $M Release s $name >/dev/null; done
step 30 "stop cpuservice" systemctl stop cpuservice
cp -a /var/lib/cpuservice/. /tmp/state-copy/ && umount /var/lib/cpuservice
cp -a /tmp/state-copy/. /var/lib/cpuservice/
step 60 "start cpuservice on the real disk" systemctl start cpuservice
echo "done"
"""

# The default shape (2 sockets x 2 cores x 2 threads, 2 NUMA nodes), one boot, in this order.
MAIN: dict[str, Scenario] = {
    "cgroup": Scenario("stat -fc %T /sys/fs/cgroup; cat /sys/fs/cgroup/cgroup.controllers", 30),
    "enforce": Scenario(
        "systemd-run -p AllowedCPUs=3 --wait -P grep Cpus_allowed_list /proc/self/status", 60),
    "topology": Scenario(TOPOLOGY, 60),
    "udev": Scenario(UDEV, 90),
    "sysfs": Scenario("python3 /payload/tests/lab/scenarios/sysfs_facts.py", 60),
    "polkit": Scenario(POLKIT, 60),
    "deb": Scenario(DEB, 300),
    "install": Scenario(INSTALL, 300),
    "repair": Scenario(f"{HOTPLUG} repair", 150, ("install",)),
    "storm": Scenario(f"{HOTPLUG} storm", 300, ("install",)),
    "cli": Scenario(CLI, 240, ("install",)),
    "access": Scenario(ACCESS, 240, ("install",)),
    "hardening": Scenario(HARDENING, 60, ("install",)),
    "fulldisk": Scenario(FULL_DISK, 240, ("install",)),
    "irqs": Scenario(f"{IRQS} check no", 120, ("install",)),
    "irqs-irqbalance": Scenario(f"{IRQS} check yes", 150, ("install",)),
    "partition-refused": Scenario(f"{PARTITIONS} refused", 60, ("install",)),
    "agent": Scenario("bash /payload/tests/lab/scenarios/agent.sh", 480, ("install",)),
    "metrics": Scenario("python3 /payload/tests/lab/scenarios/metrics.py", 120, ("install",)),
    "moves": Scenario("python3 /payload/tests/lab/scenarios/moves.py", 120, ("install",)),
    "lending": Scenario("python3 /payload/tests/lab/scenarios/lending.py check", 240,
                        ("install",)),
    "figures": Scenario("python3 /payload/tests/lab/scenarios/figures.py", 600, ("install",)),
    "guard": Scenario("python3 /payload/tests/lab/scenarios/guard.py", 300, ("install",)),
}

# Another shape with a kernel argument, a small and quick boot.
SMALL = Shape(sockets=1, cores=2, threads=2, nodes=1, memory_mb=1024, append="isolcpus=3")
SMALL_SCENARIOS: dict[str, Scenario] = {"topology": Scenario(TOPOLOGY, 60)}

# Debian sid (systemd >= 261, Linux 7.x; lab.SID), the default shape, one boot: the kernel cpuset
# partitions, then the hotplug repair of the Debian 12 boot without and with them, and its storm
# without. The storm with partitions (`hotplug.py storm --partition root|isolated`) panics Linux
# 7.2.13 in this VM now and then (select_fallback_rq, need_active_balance, update_se: the
# scheduler), so it is not part of the run: a kernel bug would fail every run it hits.
MODERN: dict[str, Scenario] = {
    "versions": Scenario("uname -r; systemctl --version | head -1; "
                         "cat /sys/fs/cgroup/cgroup.controllers; python3 -c 'import sys; "
                         "from importlib.metadata import version as v; print(sys.version.split()"
                         "[0], v(\"dbus-fast\"), v(\"pydantic\"))'", 30),
    "install": Scenario(INSTALL, 300),
    "capabilities": Scenario(f"{PARTITIONS} capabilities", 60, ("install",)),
    "partition-isolated": Scenario(f"{PARTITIONS} isolated", 120, ("install",)),
    "partition-offline": Scenario(f"{PARTITIONS} offline", 120, ("install",)),
    "repair": Scenario(f"{HOTPLUG} repair", 150, ("install",)),
    "repair-partitioned": Scenario(f"{HOTPLUG} repair --partition isolated", 150, ("install",)),
    "storm": Scenario(f"{HOTPLUG} storm", 300, ("install",)),
}

# Debian 12 with podman (lab.PODMAN), the default shape, one boot: containers on allocated CPUs,
# the three ways people start them (tests/lab/scenarios/containers.py, docs/guides/podman.md).
CONTAINERS_PY = "python3 /payload/tests/lab/scenarios/containers.py"
CONTAINERS: dict[str, Scenario] = {
    "install": Scenario(INSTALL, 300),
    "podman": Scenario(f"{CONTAINERS_PY} setup", 300, ("install",)),
    "parent": Scenario(f"{CONTAINERS_PY} parent", 300, ("podman",)),
    "run": Scenario(f"{CONTAINERS_PY} run", 300, ("podman",)),
    "service": Scenario(f"{CONTAINERS_PY} service", 300, ("podman",)),
}

# Debian 13 (lab.TRIXIE: its own kernel, systemd 257, Python 3.13), the default shape, one boot:
# the package built on Debian 13 installed, the service enforcing AllowedCPUs, repairing after
# CPU hotplug, then upgraded, removed and purged; then scripts/run.sh
# (tests/lab/test_lab_debian13.py).
VERSIONS = ("cat /etc/debian_version; uname -r; systemctl --version | head -1; "
            "cat /sys/fs/cgroup/cgroup.controllers; python3 -c 'import sys; "
            "from importlib.metadata import version as v; print(sys.version.split()"
            "[0], v(\"dbus-fast\"), v(\"pydantic\"))'")
DEBIAN13: dict[str, Scenario] = {
    "versions": Scenario(VERSIONS, 30),
    "enforce": MAIN["enforce"],
    "package": Scenario(DEB_INSTALL, 240),
    "repair": Scenario(f"{HOTPLUG} repair", 150, ("package",)),
    "lifecycle": Scenario(DEB_LIFECYCLE, 240, ("package",)),
    # the README's first command where systemd is PID 1: install.sh from the checkout, the demo
    "run": Scenario(LIB + 'step 240 "bash scripts/run.sh" bash /payload/scripts/run.sh\n'
                    'echo "active $(systemctl is-active cpuservice)"\n', 300),
}

# Devices next to NUMA node 1 (issue 38): a q35 machine whose PCI expander bridge (pxb-pcie)
# says node 1, with a virtio-net interface and an NVMe controller behind it (each on a root
# port of its own), and a second virtio-net interface on the root bus, which the guest sees
# without locality. The two interfaces share a QEMU hub and nothing else: traffic between them
# (the root-bus one moved into a network namespace) never leaves the VM. 2 sockets x 2 cores,
# one thread each, a node per socket: the smallest shape with a node-1 allocation beside
# node-1 shared CPUs.
NEAR = Shape(sockets=2, cores=2, threads=1, nodes=2, memory_mb=1536, machine="q35", qemu=(
    "-device", "pxb-pcie,id=pxb1,bus_nr=128,bus=pcie.0,numa_node=1",
    "-device", "pcie-root-port,id=rp1,bus=pxb1,chassis=11,slot=1",
    "-device", "pcie-root-port,id=rp2,bus=pxb1,chassis=12,slot=2",
    "-netdev", "hubport,id=hp1,hubid=0",
    "-device", "virtio-net-pci,netdev=hp1,bus=rp1,mac=52:54:00:38:01:01",
    "-drive", "file={workdir}/nvme.img,format=raw,if=none,id=nvm1",
    "-device", "nvme,drive=nvm1,serial=near1,bus=rp2",
    "-netdev", "hubport,id=hp0,hubid=0",
    "-device", "virtio-net-pci,netdev=hp0,bus=pcie.0,mac=52:54:00:38:00:01",
), disks=(("nvme.img", 64),))
NEAR_SCENARIOS: dict[str, Scenario] = {
    "install": Scenario(INSTALL, 300),
    "near": Scenario("python3 /payload/tests/lab/scenarios/near.py check", 180, ("install",)),
}
