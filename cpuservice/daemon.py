"""cpuserviced: the daemon's entry point."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from dbus_fast import BusType, RequestNameReply

from . import __version__, config
from .authz import Authority
from .bus_api import BUS_NAME, Bus, Manager, capture_sender
from .checkpoint import Store
from .engine import Engine, KernelAPI, SystemdAPI
from .hotplug import CPUMonitor, Debouncer
from .irqs import Kernel
from .lifetime import Lifetime
from .service import Service
from .systemd import Systemd
from .topology import discover

log = logging.getLogger("cpuserviced")


def assemble(cfg: config.Config, systemd: SystemdAPI, store: Store,
             kernel: KernelAPI | None = None) -> Service:
    """Wire the service's parts together: the engine (state, checkpoint, reconcile), the
    lifetime=unit watcher on systemd's signals, and the use cases."""
    engine = Engine(cfg, systemd, store, discover(cfg.sysfs_root), kernel)
    lifetime = Lifetime(engine)
    service = Service(engine, lifetime)
    lifetime.release = service.release
    lifetime.serial = service.serial
    systemd.on_unit_removed = lifetime.on_unit_removed
    systemd.on_unit_new = lifetime.on_unit_new
    systemd.on_unit_state = lifetime.on_unit_state
    return service


async def serve(cfg: config.Config) -> int:
    bus = await Bus(
        bus_address=os.environ.get("CPUSERVICE_BUS_ADDRESS"), bus_type=BusType.SYSTEM
    ).connect()
    systemd = Systemd(bus)
    await systemd.setup()
    # listen for CPU hotplug before the topology is first read: a CPU that changes during
    # startup is repaired right after it (the repair waits for the service's lock)
    debouncer = Debouncer()
    try:
        monitor: CPUMonitor | None = CPUMonitor(debouncer)
    except OSError as exc:
        log.error("no CPU hotplug events (%s): call Revalidate() after CPUs change", exc)
        monitor = None
    service = assemble(cfg, systemd, Store(cfg.state_file),
                       Kernel(systemd, os.environ.get("RUNTIME_DIRECTORY", "/run/cpuservice")))
    debouncer.settled = lambda: service.revalidate(full=False)
    loop = asyncio.get_running_loop()
    if monitor is not None:
        monitor.attach(loop)
    manager = Manager(service, bus, Authority(bus))
    bus.add_message_handler(capture_sender)
    await service.start()
    manager.export_all()
    reply = await bus.request_name(BUS_NAME)
    if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
        log.error("could not own %s: %s", BUS_NAME, reply)
        return 1
    log.info("cpuserviced %s serving %d allocation(s); shared CPUs %s", __version__,
             len(service.ledger.allocations), service.ledger.shared)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    disconnected = asyncio.ensure_future(bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({disconnected, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if disconnected.done():
        log.error("lost the system bus")
        return 1
    bus.disconnect()
    return 0


SYSLOG_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
                   logging.DEBUG: 7}


class JournalFormatter(logging.Formatter):
    """Each line starts with its syslog priority as ``<N>``, which journald reads from a
    service's standard error (``journalctl -p err`` works); on a terminal it is as readable."""

    def format(self, record: logging.LogRecord) -> str:
        priority = SYSLOG_PRIORITY.get(record.levelno, 6)
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpuserviced", description="The cpuservice daemon.")
    parser.add_argument("--config", default=str(config.DEFAULT_PATH),
                        help="configuration file (default %(default)s)")
    parser.add_argument("--version", action="version", version=__version__)
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    try:
        cfg = config.load(args.config)
    except config.ConfigError as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
