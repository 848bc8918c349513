"""The refusals the choice code (choose.py, fragment.py) raises: one home for their words.
Pure."""


from __future__ import annotations

from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.pools import Ledger
from cpuservice.model.request import Policy
from cpuservice.placement.free import Free


def refusal(free: Free) -> str:
    """What near-policy required keeps to, naming the devices and their nodes."""
    where = ", ".join(f"{d.name} (NUMA node {d.node})" for d in free.devices
                      if d.node is not None and d.node >= 0)
    return f"near-policy required: only the CPUs next to {where}"


def floor(free: Free, left: int) -> InsufficientCPUs:
    """The refusal of a choice that takes more from the shared pool than its budget."""
    return InsufficientCPUs(
        f"this would leave fewer than min_shared_cpus={free.min_shared} CPUs in the shared "
        f"pool ({free.shared} now, {free.shared - free.min_shared - left} needed from it)")


def too_few(n: int, available: int, policy: str) -> str:
    """The shortage message; counts CPUs, never cores."""
    where = "on whole free cores " if policy == Policy.FULL_PCPUS else ""
    return f"{n} CPUs requested but only {available} CPUs {where}are available"


def shortage(ledger: Ledger, message: str) -> InsufficientCPUs:
    """InsufficientCPUs with ``message``, saying so where the shared pool is at its minimum."""
    if not ledger.shared_budget:
        message += (
            f"; the shared pool is at its minimum (min_shared_cpus={ledger.min_shared_cpus})"
        )
    return InsufficientCPUs(message)
