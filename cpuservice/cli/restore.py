"""Foreign units (allocations with ``unit=``) get their own values back from the checkpoint
alone, without the daemon: the package's removal runs this when the daemon is down or could not
release them (debian/cpuservice.prerm). Their saved values live only in the checkpoint; the
checkpoint itself is left as it is (purge removes it).

    python3 -m cpuservice.cli.restore [STATE_FILE]
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from dbus_fast import BusType
from dbus_fast.aio import MessageBus

from cpuservice.apply import reconcile, units
from cpuservice.host.checkpoint import CheckpointError, Store, prop_in
from cpuservice.host.systemd import Systemd
from cpuservice.model import config
from cpuservice.model.errors import CPUServiceError
from cpuservice.shell.ports import SystemdAPI


async def restore(store: Store, systemd: SystemdAPI) -> list[str]:
    """Set every foreign unit of the checkpoint back to its saved values and remove the runtime
    overrides cpuservice made where it had none; the units restored."""
    try:
        payload = store.load()
    except CheckpointError as exc:
        print(f"cpuservice: {exc}: no foreign unit to restore from it", file=sys.stderr)
        return []
    done = []
    for row in (payload or {}).get("allocations", []):
        unit = str(row.get("unit", ""))
        if not unit or units.name_of_slice(unit) is not None or unit.startswith("cpuservice"):
            continue  # cpuservice's own slices are stopped, not restored
        try:
            saved = {k: (sig, prop_in(sig, v)) for k, (sig, v) in row["saved"].items()}
            fresh = tuple(str(n) for n in row.get("fresh", ()))
            await reconcile.run_op(systemd, reconcile.Op(reconcile.Kind.RESTORE, unit, saved,
                                                         forget=fresh))
        except (CPUServiceError, KeyError, TypeError, ValueError) as exc:
            print(f"cpuservice: cannot restore {unit}: {exc}", file=sys.stderr)
            continue
        done.append(unit)
    return done


async def _main(state_file: str) -> int:
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    try:
        for unit in await restore(Store(state_file), Systemd(bus)):
            print(f"cpuservice: restored {unit}")
    finally:
        bus.disconnect()
    return 0


def main(argv: Sequence[str] = ()) -> int:
    if argv:
        state_file = argv[0]
    else:
        try:
            state_file = config.load().state_file
        except config.ConfigError as exc:
            print(f"cpuservice: {exc}; using the default state file", file=sys.stderr)
            state_file = config.Config().state_file
    return asyncio.run(_main(state_file))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
