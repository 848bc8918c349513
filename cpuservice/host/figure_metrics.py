"""How each allocation fares (issue 39), as metrics: the figures the sampler last read
(cpuservice.shell.statistics.Sampler, every ``statistics_seconds``), labelled by
allocation, appended to the metrics file (cpuservice.host.metrics). Pure: the text from the
figures. The kernel is read by the sampler only, never when the file is written for another
change, so a burst of changes on 3,000 allocations does not read 3,000 cgroups each time; the
values are at most one sampling interval old.

Per allocation: CPU time used, periods, throttled periods and throttled time, pressure (some,
full) as counters (use rate()), and for allocations with option memory-nodes the share of their
memory on other nodes: six series each, seven with memory nodes, each only where the kernel
gives the figure; and one series per health reason raised now (cpuservice.model.health)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from cpuservice.host.metrics import _Text
from cpuservice.model.figures import Figures


def render(figures: Mapping[str, Figures], allocations: Iterable[str],
           read_seconds: float | None = None,
           strain: Mapping[str, tuple[str, ...]] = MappingProxyType({})) -> str:
    """The figures' families for the allocations that exist now (``allocations``); a family
    with no sample has its HELP and TYPE only. ``read_seconds``: how long the last reading of
    all of them took; ``strain``: the health reasons the figures raised (one series per
    raised reason: none while every allocation fares well)."""
    names = sorted(set(allocations))
    values = {n: figures[n].values() for n in names if n in figures}
    out = _Text()
    out.family("cpuservice_allocation_health", "gauge",
               "1 while the figures of an allocation raise a health reason (pressured, "
               "throttled, memory-remote; health_*_percent in cpuservice.toml).",
               [({"allocation": n, "reason": r}, 1) for n in names for r in strain.get(n, ())])

    def family(name: str, kind: str, text: str, key: str, per: float = 1) -> None:
        out.family(name, kind, text, [({"allocation": n}, v[key] / per)
                                      for n, v in values.items() if key in v])

    family("cpuservice_allocation_cpu_usage_seconds_total", "counter",
           "CPU time used by each allocation's cgroup (cpu.stat usage_usec).",
           "cpu-usage-usec", 1e6)
    family("cpuservice_allocation_cpu_periods_total", "counter",
           "Enforcement periods of each allocation's CPU quota (cpu.stat nr_periods).",
           "cpu-periods")
    family("cpuservice_allocation_cpu_throttled_periods_total", "counter",
           "Periods in which the quota throttled each allocation (cpu.stat nr_throttled).",
           "cpu-throttled-periods")
    family("cpuservice_allocation_cpu_throttled_seconds_total", "counter",
           "Time each allocation spent throttled by its quota (cpu.stat throttled_usec).",
           "cpu-throttled-usec", 1e6)
    out.family("cpuservice_allocation_cpu_pressure_seconds_total", "counter",
               "Time in which some (kind=some) or all (kind=full) runnable tasks of each "
               "allocation waited for a CPU (cpu.pressure total).",
               [({"allocation": n, "kind": kind}, v[f"cpu-pressure-{kind}-total-usec"] / 1e6)
                for n, v in values.items() for kind in ("some", "full")
                if f"cpu-pressure-{kind}-total-usec" in v])
    family("cpuservice_allocation_memory_remote_ratio", "gauge",
           "Share of the anonymous and file memory of each allocation with option "
           "memory-nodes that lies on other NUMA nodes (memory.numa_stat).",
           "memory-remote-percent", 100)
    if read_seconds is not None:
        out.family("cpuservice_statistics_read_seconds", "gauge",
                   "How long the last reading of every allocation's figures took.",
                   [({}, round(read_seconds, 6))])
    return "\n".join(out.lines) + "\n"


def render_host(figures: Mapping[str, Figures], guard: bool | None = None,
                starving: bool = False) -> str:
    """The shared pool's holders' pressure (cpuservice.model.starvation.HOST_CGROUPS, as the
    sampler last read them) and, with the guard enabled (``guard``: whether it is armed), the
    admission guard's state (its refusals are cpuservice_requests_total's
    result="SharedPoolStarving")."""
    out = _Text()
    out.family("cpuservice_host_cpu_pressure_seconds_total", "counter",
               "Time in which some (kind=some) or all (kind=full) runnable tasks of the shared "
               "pool's holders (cgroup: cpuservice-shared.slice, system.slice) waited for a "
               "CPU (cpu.pressure total).",
               [({"cgroup": n, "kind": kind}, v[f"cpu-pressure-{kind}-total-usec"] / 1e6)
                for n, v in ((n, f.values()) for n, f in sorted(figures.items()))
                for kind in ("some", "full") if f"cpu-pressure-{kind}-total-usec" in v])
    if guard is not None:
        out.family("cpuservice_admission_guard_available", "gauge",
                   "1 while the admission guard's PSI triggers are armed "
                   "(admission_guard_percent), 0 where they cannot be.", [({}, int(guard))])
        out.family("cpuservice_admission_guard_starving", "gauge",
                   "1 while the shared pool is starving: its holders' CPU pressure is above "
                   "admission_guard_percent, and requests that take CPUs from it are refused.",
                   [({}, int(starving))])
    return "\n".join(out.lines) + "\n"
