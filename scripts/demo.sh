#!/usr/bin/env bash
# Show the running service: its pools, a bound allocation and the systemd unit behind it.
set -euo pipefail
dest=(org.cpuservice1 /org/cpuservice1 org.cpuservice1.Manager)
echo "== systemctl status cpuservice.service"
systemctl --no-pager --lines=3 status cpuservice.service || true
echo "== pools"
for p in Version OnlineCPUs SharedCPUs ExclusiveCPUs FragmentCPUs; do
    printf '%-14s %s\n' "$p" "$(busctl get-property "${dest[@]}" "$p")"
done
echo "== Allocate demo 1 CPU bound"
busctl call "${dest[@]}" Release s demo >/dev/null 2>&1 || true
busctl call "${dest[@]}" Allocate 'ssa{sv}' demo 1 1 bind b true
busctl call "${dest[@]}" ListAllocations
echo "== its unit"
systemctl show 'cpuservice-bound-demo.slice' -p Id -p ActiveState -p AllowedCPUs -p CPUWeight \
    -p CPUQuotaPerSecUSec
systemctl show cpuservice-shared.slice -p Id -p AllowedCPUs
echo "== cpuservicectl topology"
cpuservicectl --no-ask-password topology
