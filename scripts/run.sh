#!/usr/bin/env bash
# The README's main-job command: run the real cpuservice on this machine (as root).
#   bash scripts/run.sh          install and start it, then show it working
#   bash scripts/run.sh shell    a shell where it runs (the container, on a host without systemd)
#   bash scripts/run.sh stop     tear the container down
# Where systemd is PID 1 it installs cpuservice.service on the system bus. Elsewhere (systemd not
# PID 1, as on this project's build machines) it boots this machine's own OS in a throwaway
# systemd-nspawn container and runs the same service there, on this machine's real topology.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d /run/systemd/system ] && [ "$(cat /proc/1/comm)" = systemd ]; then
    case "${1:-start}" in
        start) bash scripts/install.sh && bash scripts/demo.sh ;;
        shell) exec bash -l ;;
        stop) systemctl disable --now cpuservice.service ;;
        *) echo "usage: $0 [start|shell|stop]" >&2; exit 2 ;;
    esac
    exit 0
fi
bash scripts/install-deps.sh base runtime integration
exec /usr/bin/python3 -m tests.envs.demo "${1:-start}"
