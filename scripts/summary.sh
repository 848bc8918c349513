#!/usr/bin/env bash
# The closing table of a test run (rows written by scripts/tier.sh into CPUSERVICE_TIER_DIR),
# then, for every failed tier, what failed: pytest's FAILED/ERROR lines, or the end of its
# output. Exits 1 when a tier failed.
set -uo pipefail
dir=${CPUSERVICE_TIER_DIR:?}
[ -f "$dir/table" ] || { echo "==> no tier ran"; exit 1; }
failed=0
while read -r name result _; do
  [ "$result" = passed ] && continue
  failed=1
  echo "==> tier $name failed:"
  lines=$(grep -E '^(FAILED|ERROR) ' "$dir/$name.log" 2>/dev/null | cut -c1-300 | head -n 25)
  if [ -z "$lines" ]; then lines=$(tail -n 15 "$dir/$name.log" 2>/dev/null | cut -c1-300); fi
  printf '%s\n' "$lines" | sed 's/^/    /'
done < "$dir/table"
echo "==> summary"
printf '%-14s %-18s %6s   %s\n' tier result time tests
cat "$dir/table"
if [ -n "${CPUSERVICE_TEST_START:-}" ]; then
  took=$(($(date +%s) - CPUSERVICE_TEST_START))
  printf '%-14s %-18s %3dm%02ds\n' total "" $((took / 60)) $((took % 60))
fi
if [ $failed -eq 0 ]; then echo "==> all tiers passed"; else echo "==> FAILED: see above"; fi
exit $failed
