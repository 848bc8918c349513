# Sourced by the VM lab's shell scenarios. Each step has its own time limit; a step that fails or
# runs over ends the scenario at once with the reason, so a broken run reports in seconds.
#   step LIMIT WHAT CMD...       run CMD (a program, not a shell function) within LIMIT seconds
#   wait_until LIMIT WHAT CMD... poll CMD every 0.1 s until it succeeds, at most LIMIT seconds
#   fail WHAT                    end the scenario with a reason
fail() { echo "FAILED STEP: $*"; exit 1; }
step() {
    limit=$1 what=$2; shift 2
    timeout -k 2 "$limit" "$@"; rc=$?
    [ "$rc" = 124 ] && fail "$what (over $limit s)"
    [ "$rc" = 0 ] || fail "$what (exit $rc)"
}
wait_until() {
    limit=$1 what=$2; shift 2
    end=$(($(date +%s) + limit))
    until "$@"; do
        [ "$(date +%s)" -ge "$end" ] && fail "$what (not within $limit s)"
        sleep 0.1
    done
}
M="org.cpuservice1 /org/cpuservice1 org.cpuservice1.Manager"
