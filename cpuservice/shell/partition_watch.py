"""Partitions the kernel reports invalid: announced (degraded) and set again, once per report,
at startup and every PARTITION_CHECK_SECONDS (something outside cpuservice can make a
partition invalid: a foreign partition on the same CPUs, every CPU of it offline)."""

from __future__ import annotations

import asyncio
import logging

from cpuservice.apply import partitions
from cpuservice.apply.change import effects
from cpuservice.apply.reconcile import Kind as OpKind
from cpuservice.apply.reconcile import Op
from cpuservice.apply.targets import partition_mode, partition_of
from cpuservice.model.pools import Allocation
from cpuservice.shell.engine import Engine

log = logging.getLogger(__name__)
PARTITION_CHECK_SECONDS = 5.0


class PartitionHealer:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._reset: dict[str, partitions.State | None] = {}  # partitions set again, and why

    def _allocation(self, name: str) -> Allocation:
        return self.engine.ledger.allocations[name]

    async def watch(self) -> None:
        """Something outside cpuservice can make a partition invalid (a foreign partition on
        the same CPUs, every CPU of it offline): look again every PARTITION_CHECK_SECONDS."""
        while True:
            await asyncio.sleep(PARTITION_CHECK_SECONDS)
            await self.heal_quietly()

    async def heal_quietly(self) -> None:
        """heal(), whose failure is logged, never raised: neither startup nor the
        watch stops on one failed look."""
        try:
            await self.heal()
        except Exception:
            log.exception("checking partitions failed")

    async def heal(self) -> None:
        """Announce partitions the kernel reports invalid (degraded), and set each such slice's
        partition again (member, then what it asked for), so the kernel checks it anew; what
        stays invalid stays degraded, with the kernel's reason, until the next look."""
        if not any(partition_of(a) != partitions.NONE
                   for a in self.engine.ledger.allocations.values()):
            return
        async with self.engine.lock:
            wrote = False
            for name in await self.engine.check_partitions():
                a, unit = self._allocation(name), self.engine.state.records[name].unit
                report = self.engine.partition_report(name)
                # once per report: a partition that stays invalid for the same reason is not
                # set again every few seconds (each set rebuilds the scheduler's domains)
                if not a.held or self._reset.get(name) == report:
                    continue
                self._reset[name] = report
                wanted = partition_mode(a, self.engine.ledger)
                # a member, then what it asked for again (undone: what it asked for)
                asked = {partitions.PROPERTY: ("s", str(wanted))}
                await self.engine.apply(effects(
                    Op(OpKind.RESTORE, unit, {partitions.PROPERTY: ("s", partitions.MEMBER)},
                       asked),
                    Op(OpKind.RESTORE, unit, asked)))
                wrote = True
                log.info("allocation %s: set the partition of %s again", name, unit)
            ledger = self.engine.ledger
            for name in [n for n in self._reset if n not in ledger.allocations
                         or not partitions.degraded(partition_mode(self._allocation(n), ledger),
                                                    self.engine.partition_report(n))]:
                del self._reset[name]
            if wrote:
                await self.engine.check_partitions("partition repaired")
