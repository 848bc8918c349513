#!/usr/bin/env bash
# Run every tier given as NAME:MAKE-TARGET, each even after another failed; exit non-zero if
# any failed. Started alone (make test), it closes with the table of scripts/summary.sh;
# inside scripts/test.sh (CPUSERVICE_TIER_DIR set) the caller prints that table.
set -uo pipefail
cd "$(dirname "$0")/.."
own=
if [ -z "${CPUSERVICE_TIER_DIR:-}" ]; then
  CPUSERVICE_TIER_DIR=$(mktemp -d)
  own=1
  trap 'rm -rf "$CPUSERVICE_TIER_DIR"' EXIT
fi
export CPUSERVICE_TIER_DIR
failed=0
for spec in "$@"; do
  bash scripts/tier.sh "${spec%%:*}" make --no-print-directory "${spec#*:}" || failed=1
done
if [ -n "$own" ]; then
  bash scripts/summary.sh
  exit $?
fi
exit $failed
