#!/usr/bin/env bash
# The README's test command: set up everything on a fresh Debian 12 (as root) and run all tests.
# Prints each step's time and, at the end, a table of them.
set -euo pipefail
cd "$(dirname "$0")/.."
export CPUSERVICE_TIER_LOG
CPUSERVICE_TIER_LOG=$(mktemp)
trap 'echo "==> summary"; cat "$CPUSERVICE_TIER_LOG"; rm -f "$CPUSERVICE_TIER_LOG"' EXIT
bash scripts/tier.sh setup-deps bash scripts/install-deps.sh all
bash scripts/tier.sh setup-venv bash scripts/setup-venv.sh
make --no-print-directory test
