#!/usr/bin/env bash
# The README's main-job command. Until the daemon lands (issue: The service), it runs the
# placement engine on this machine's real topology through the planner.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh base unit
PYTHONPATH=$PWD exec /usr/bin/python3 -m cpuservice.plan --sysfs-root /sys "${@:-demo-shared=1 demo-bound=1:bind demo-frac=0.5:bind}"
