"""How each allocation fares (issue 39), the shell's part: which cgroup is an allocation's, and
reading the figures of many of them (cpuservice.host.figures) without holding the loop.

An allocation's own slice has the cgroup systemd's naming rule gives it (model.figures.
slice_cgroup: no call to systemd); a foreign unit's (option unit) is asked of systemd once and
asked again when it cannot be read (the unit may have been made again). The figures themselves
are read from the kernel every time: nothing here keeps one. Reading yields to the loop every
few milliseconds, so a long read (3,000 allocations) delays a change or a lending sample by
one slice at most; ``Sampler`` reads all of them every so often for the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

from cpuservice import placement
from cpuservice.apply import units
from cpuservice.host import figures as reader
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.figures import Figures, slice_cgroup
from cpuservice.shell.engine import Engine
from cpuservice.shell.ports import cgroup_iface

log = logging.getLogger(__name__)
SLICE = 0.002  # seconds of reading before the loop runs what else is ready


class Statistics:
    """Reads the figures of the engine's allocations (``root``: the cgroup hierarchy)."""

    def __init__(self, engine: Engine, root: Path = reader.CGROUP_ROOT) -> None:
        self.engine = engine
        self.root = root
        self.clock: Callable[[], int] = reader.monotonic_usec
        self._foreign: dict[str, str] = {}  # foreign unit -> its ControlGroup
        self._nodes: tuple[object, dict[str, CPUSet | None]] = (None, {})  # (state, nodes)

    async def cgroup(self, unit: str) -> str | None:
        """The cgroup of ``unit``: by systemd's rule for cpuservice's own slices, asked of
        systemd (once) for a foreign unit; None when it cannot be told."""
        if units.is_own(unit):
            return slice_cgroup(unit)
        group = self._foreign.get(unit)
        if group is None:
            try:
                found = (await self.engine.systemd.get(unit, cgroup_iface(unit),
                                                       ["ControlGroup"])).get("ControlGroup")
            except Exception as exc:  # unknown, until it can be told
                log.debug("no cgroup for %s: %s", unit, exc)
                return None
            if not found:
                return None
            group = self._foreign[unit] = str(found)
        return group

    def memory_nodes(self, name: str) -> CPUSet | None:
        """The nodes an allocation with option memory-nodes keeps its memory on (None: the
        option is off, its memory is not measured for locality). Worked out once per state
        (a state is replaced, never changed)."""
        state = self.engine.state
        if self._nodes[0] is not state:
            self._nodes = (state, {})
        known = self._nodes[1]
        if name not in known:
            a = state.ledger.allocations.get(name)
            known[name] = None if a is None or not a.request.options.memory_nodes else \
                placement.describe(self.engine.topology, state.ledger, a).memory_nodes
        return known[name]

    async def read(self, names: Iterable[str]) -> dict[str, Figures]:
        """The figures of each of ``names`` that is an allocation, read now (the others are
        left out)."""
        out: dict[str, Figures] = {}
        since = time.monotonic()
        for name in names:
            state = self.engine.state  # (it may change while the loop runs something else)
            record = state.records.get(name)
            if name in out or record is None or name not in state.ledger.allocations:
                continue
            own = units.is_own(record.unit)
            group = slice_cgroup(record.unit) if own else \
                await self.cgroup(record.unit) if record.unit else None
            found = reader.read(group, self.memory_nodes(name), self.root, self.clock)
            if group is not None and not own and found.cpu is None:
                self._foreign.pop(record.unit, None)  # ask again next time
            out[name] = found
            if time.monotonic() - since > SLICE:
                await asyncio.sleep(0)
                since = time.monotonic()
        for unit in set(self._foreign) - {r.unit for r in self.engine.state.records.values()}:
            del self._foreign[unit]
        return out


class Sampler:
    """Reads every allocation's figures every ``interval`` seconds while it runs and keeps the
    last reading (``latest``) for the metrics file, which is written from it: the kernel is
    read at most once per interval, however often the file is written for other changes.
    ``on_sample`` is told after each reading."""

    def __init__(self, statistics: Statistics, interval: float,
                 on_sample: Callable[[], None] = lambda: None) -> None:
        self.statistics = statistics
        self.interval = interval
        self.on_sample = on_sample
        self.latest: Mapping[str, Figures] = {}
        self.host: Mapping[str, Figures] = {}  # the shared pool's holders' (the daemon's)
        self.took: float | None = None  # seconds the last reading took
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> None:
        names = sorted(self.statistics.engine.state.ledger.allocations)
        start = time.monotonic()
        self.latest = await self.statistics.read(names) if names else {}
        self.took = time.monotonic() - start if names else None
        self.on_sample()

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception:  # one failed reading never stops the next
                log.exception("statistics: a reading failed")
            await self.sleep(self.interval)

    def start(self) -> None:
        if self._task is None and self.interval > 0:
            self._task = asyncio.create_task(self._run())

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
