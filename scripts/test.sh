#!/usr/bin/env bash
# The README's test command: set up everything on a fresh Debian 12 or 13 (as root), run every
# tier, each even after another failed. Prints each tier's time and, at the end, a table of
# them and what failed; exits non-zero when any tier failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export CPUSERVICE_TIER_DIR CPUSERVICE_TEST_START
CPUSERVICE_TEST_START=$(date +%s)
CPUSERVICE_TIER_DIR=$(mktemp -d)
images=
cleanup() {
  [ -n "$images" ] && kill "$images" 2>/dev/null
  rm -rf "$CPUSERVICE_TIER_DIR"
}
trap cleanup EXIT
bash scripts/tier.sh setup-deps bash scripts/install-deps.sh all
bash scripts/tier.sh setup-venv bash scripts/setup-venv.sh
# The VM images (debootstrap: network and disk more than CPU) build while the other tiers run;
# the lab tier waits for them on the cache's lock (tests/envs/lab.py base_image).
bash scripts/tier.sh images bash scripts/lab-images.sh > "$CPUSERVICE_TIER_DIR/images.out" 2>&1 &
images=$!
make --no-print-directory test
wait "$images" 2>/dev/null
images=
bash scripts/summary.sh
