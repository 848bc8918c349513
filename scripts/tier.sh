#!/usr/bin/env bash
# Run one test tier and say which it is, how long it took and how it ended:
#   scripts/tier.sh NAME COMMAND...
# With CPUSERVICE_TIER_DIR set, the tier's output is also kept in DIR/NAME.log and its row
# (name, result, time, pytest's counts) appended to DIR/table, for scripts/summary.sh.
set -uo pipefail
name=$1; shift
start=$(date +%s)
echo "==> tier $name: started $(date +%H:%M:%S)"
dir=${CPUSERVICE_TIER_DIR:-}
if [ -n "$dir" ]; then
  "$@" 2>&1 | tee "$dir/$name.log"
  rc=${PIPESTATUS[0]}
else
  "$@"
  rc=$?
fi
took=$(($(date +%s) - start))
if [ $rc -eq 0 ]; then result=passed; else result="FAILED (exit $rc)"; fi
printf '==> tier %s: %s in %dm%02ds\n' "$name" "$result" $((took / 60)) $((took % 60))
if [ -n "$dir" ]; then
  # pytest's closing counts ("1 failed, 443 passed in 50.79s" -> "1 failed, 443 passed")
  counts=$(tail -n 40 "$dir/$name.log" | tr -d '=' \
           | grep -E '^ *[0-9]+ (passed|failed|errors?|skipped|deselected)' | tail -n 1 \
           | sed -E 's/^ +//; s/ in [0-9.]+s.*//')
  printf '%-14s %-18s %3dm%02ds   %s\n' "$name" "$result" $((took / 60)) $((took % 60)) \
    "$counts" >> "$dir/table"
fi
exit $rc
