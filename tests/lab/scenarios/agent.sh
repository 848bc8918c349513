# VM lab: polkit's text agent on a terminal (run by tests/lab/test_lab_agent.py after install).
. /payload/tests/lab/scenarios/lib.sh
echo 'alice:wonderland-42' | chpasswd || fail "chpasswd"
# alice must prove she is alice (her own password) to allocate; systemd-run's transient scope in
# the system manager is granted outright, so cpuservice-run's only prompts are cpuservice's
cat > /etc/polkit-1/rules.d/50-alice-agent.rules <<'RULES'
polkit.addRule(function(action, subject) {
    if (subject.user != "alice") return polkit.Result.NOT_HANDLED;
    if (action.id == "org.cpuservice1.allocate") return polkit.Result.AUTH_SELF;
    if (action.id == "org.freedesktop.systemd1.manage-units") return polkit.Result.YES;
    return polkit.Result.NOT_HANDLED;
});
RULES
step 30 "restart polkit" systemctl restart polkit
step 400 "the cases on a pseudo-terminal" python3 /payload/tests/lab/scenarios/agent.py
# root's view of one allocation as systemd reports its unit (pure cgroup v2: tasks, CPU time,
# throttling), and the pager: on a terminal (this scenario's output is the serial port, a
# terminal), never when piped
echo "== status"
step 30 "allocate st" cpuservicectl allocate st 0.5 --bind -q
systemd-run --quiet --slice=cpuservice-bound-st.slice --unit=st-worker \
    sh -c 'timeout 3 sh -c "while :; do :; done"; exec sleep 300'
sleep 5
SYSTEMD_PAGER="sed s/^/PAGED:/" cpuservicectl status st
echo "== status piped"
SYSTEMD_PAGER="sed s/^/PAGED:/" cpuservicectl status st | cat
cpuservicectl status st -j | cat
systemctl stop st-worker
cpuservicectl release st
