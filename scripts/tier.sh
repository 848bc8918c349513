#!/usr/bin/env bash
# Run one test tier and say which it is, how long it took and how it ended:
#   scripts/tier.sh NAME COMMAND...
set -uo pipefail
name=$1; shift
start=$(date +%s)
echo "==> tier $name: started $(date +%H:%M:%S)"
"$@"
rc=$?
took=$(($(date +%s) - start))
if [ $rc -eq 0 ]; then result=passed; else result="FAILED (exit $rc)"; fi
printf '==> tier %s: %s in %dm%02ds\n' "$name" "$result" $((took / 60)) $((took % 60))
[ -n "${CPUSERVICE_TIER_LOG:-}" ] && printf '%-16s %-18s %dm%02ds\n' "$name" "$result" \
    $((took / 60)) $((took % 60)) >> "$CPUSERVICE_TIER_LOG"
exit $rc
