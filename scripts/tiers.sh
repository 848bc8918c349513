#!/usr/bin/env bash
# Run every tier given as NAME:MAKE-TARGET, each even after another failed; exit non-zero if
# any failed. A tier given as &NAME:MAKE-TARGET starts first and runs beside the others (the VM
# lab: QEMU keeps about one of two cores busy, the other tiers the other); it learns that they
# are done from the file $CPUSERVICE_LAB_SHARED_UNTIL (then it boots two VMs at a time, see
# tests/lab/conftest.py), and its output follows theirs when it ends.
# Started alone (make test), it closes with the table of scripts/summary.sh; inside
# scripts/test.sh (CPUSERVICE_TIER_DIR set) the caller prints that table.
set -uo pipefail
cd "$(dirname "$0")/.."
own=
beside=()
cleanup() {  # a tier still running beside (the run was interrupted): its process group ends
  for job in "${beside[@]}"; do kill -TERM -- "-${job%%:*}" 2>/dev/null; done
  [ -n "$own" ] && rm -rf "$CPUSERVICE_TIER_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ -z "${CPUSERVICE_TIER_DIR:-}" ]; then
  CPUSERVICE_TIER_DIR=$(mktemp -d)
  own=1
fi
export CPUSERVICE_TIER_DIR
failed=0
for spec in "$@"; do
  [ "${spec#&}" != "$spec" ] || continue
  spec=${spec#&}
  name=${spec%%:*}
  echo "==> tier $name: runs beside the others from $(date +%H:%M:%S); its output follows theirs"
  rm -f "$CPUSERVICE_TIER_DIR/foreground-done"
  CPUSERVICE_LAB_SHARED_UNTIL=$CPUSERVICE_TIER_DIR/foreground-done \
    setsid bash scripts/tier.sh "$name" make --no-print-directory "${spec#*:}" \
    > "$CPUSERVICE_TIER_DIR/$name.beside" 2>&1 &
  beside+=("$!:$name")
done
for spec in "$@"; do
  [ "${spec#&}" = "$spec" ] || continue
  bash scripts/tier.sh "${spec%%:*}" make --no-print-directory "${spec#*:}" || failed=1
done
touch "$CPUSERVICE_TIER_DIR/foreground-done"
for job in "${beside[@]}"; do
  wait "${job%%:*}" || failed=1
  cat "$CPUSERVICE_TIER_DIR/${job#*:}.beside"
done
beside=()
if [ -n "$own" ]; then
  bash scripts/summary.sh
  exit $?
fi
exit $failed
