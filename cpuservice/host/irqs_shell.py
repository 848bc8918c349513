"""The shell the kernel oneshot runs (cpuservice.host.irqs.Kernel): a shell starts in
milliseconds, where a Python interpreter takes seconds under emulation."""

# What the oneshot runs: for the interrupts, then the workqueues, a hex mask, a CPU list and a
# report path each ("-" three times: leave it). A shell starts in milliseconds, where a Python
# interpreter takes seconds under emulation. An IRQ whose affinity the kernel will not set
# (managed, per-CPU) is listed as unmovable; one that vanished is skipped. Where the kernel
# delivers each confined IRQ right after (effective_affinity_list) tells a deferred move.
# Then the devices of option near-irqs (cpuservice.host.irq_devices.args): a report path and
# the CPUs released devices go back to ("-" twice: none; "-" alone: every online CPU), then an
# address and a CPU list (or "release") per device: its msi_irqs and legacy irq, after the pool.
SET_KERNEL = r"""
if [ "$1" != - ]; then
    echo "$1" > /proc/irq/default_smp_affinity || exit 1
    ok= no= eff=
    for d in /proc/irq/[0-9]*; do
        n=${d#/proc/irq/}
        if echo "$2" > "$d/smp_affinity_list" 2>/dev/null; then
            ok="$ok,$n" e=
            read -r e 2>/dev/null < "$d/effective_affinity_list"
            eff="$eff,\"$n\":\"$e\""
        elif [ -e "$d" ]; then no="$no,$n"; fi
    done
    printf '{"cpus":"%s","confined":[%s],"unmovable":[%s],"effective":{%s}}' \
        "$2" "${ok#,}" "${no#,}" "${eff#,}" > "$3.tmp"
    mv "$3.tmp" "$3"
fi
if [ "$4" != - ]; then
    echo "$4" > /sys/devices/virtual/workqueue/cpumask || exit 1
    printf '{"cpus":"%s"}' "$5" > "$6.tmp" && mv "$6.tmp" "$6"
fi
if [ "${7:--}" != - ]; then
    report=$7 back=$8 out=
    [ "$back" = - ] && read -r back < /sys/devices/system/cpu/online
    shift 8
    while [ $# -ge 2 ]; do
        d=/sys/bus/pci/devices/$1 cpus=$2 ok= no= eff= seen=" "
        [ "$cpus" = release ] && cpus=$back
        legacy=0
        read -r legacy 2>/dev/null < "$d/irq"
        for n in "$d"/msi_irqs/[0-9]* "$legacy"; do
            n=${n##*/}
            case "$seen" in *" $n "*) continue ;; esac
            seen="$seen$n "
            [ "$n" != 0 ] && [ -e "/proc/irq/$n" ] || continue
            if echo "$cpus" > "/proc/irq/$n/smp_affinity_list" 2>/dev/null; then
                ok="$ok,$n" e=
                read -r e 2>/dev/null < "/proc/irq/$n/effective_affinity_list"
                eff="$eff,\"$n\":\"$e\""
            else no="$no,$n"; fi
        done
        out="$out,\"$1\":{\"cpus\":\"$cpus\",\"confined\":[${ok#,}],\"unmovable\":[${no#,}],\"effective\":{${eff#,}}}"
        shift 2
    done
    printf '{%s}' "${out#,}" > "$report.tmp" && mv "$report.tmp" "$report"
fi
"""
