"""Per-user limits (max_allocations_per_user, max_cpus_per_user): what an allocation costs the
host, counted on the ledger as it would be after a change. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal

from cpuservice.model.config import Config
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import LimitExceeded
from cpuservice.model.pools import Ledger
from cpuservice.model.state import Record


def check(cfg: Config, records: Mapping[str, Record], owner: int, name: str,
          ledger: Ledger) -> None:
    """LimitExceeded when ``owner``'s allocations on ``ledger`` (in which ``name`` is the
    owner's) exceed a limit. What an allocation costs is what it takes from the host: a bound
    one the CPUs it takes out of the shared pool (its whole CPUs and its fragment CPU: 0.51
    costs a CPU), an unbound one its amount (its CPUQuota and CPUWeight follow it). A CPU
    several of the owner's allocations share counts once."""
    mine = [a for n, a in ledger.allocations.items()
            if n == name or (n in records and records[n].owner == owner)]
    if cfg.max_allocations_per_user and len(mine) > cfg.max_allocations_per_user:
        raise LimitExceeded(f"user {owner} has {len(mine) - 1} allocations; the limit is "
                            f"max_allocations_per_user={cfg.max_allocations_per_user}")
    limit = cfg.cpu_limit(len(ledger.online))
    if limit is None:
        return
    bound = len(CPUSet.union_all(a.held for a in mine if a.bound))
    unbound = sum((a.request.cpus for a in mine if not a.bound), Decimal(0))
    if bound + unbound > limit:
        raise LimitExceeded(
            f"user {owner} would hold {bound} CPUs taken from the shared pool and "
            f"{unbound.normalize()} unbound; the limit is "
            f"max_cpus_per_user={cfg.max_cpus_per_user} ({limit.normalize()} CPUs)")
