"""cpuserviced: the daemon's entry point. It wires the parts (assemble), serves on the system
bus, and keeps systemd and the administrator informed: READY=1, STATUS= and the watchdog
(notify), the journal's audit trail of every change (journal), the metrics file (metrics).

Exit status: 0 after SIGTERM/SIGINT, 1 when the bus is lost or the name cannot be owned,
EXIT_CONFIG (78, EX_CONFIG of sysexits.h) for a configuration error, which the unit's
RestartPreventExitStatus= keeps from being restarted in a loop."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

from dbus_fast import BusType, RequestNameReply
from dbus_fast.aio import MessageBus

from cpuservice import __version__
from cpuservice.bus.api import BUS_NAME, Bus, Manager, capture_sender
from cpuservice.host import figure_metrics, journal, metrics, notify
from cpuservice.host.authz import Authority
from cpuservice.host.checkpoint import Store
from cpuservice.host.devices import Resolver
from cpuservice.host.hotplug import CPUMonitor, Debouncer
from cpuservice.host.irqs import Kernel
from cpuservice.host.sysfs import discover
from cpuservice.host.systemd import Systemd
from cpuservice.model import config, keep
from cpuservice.model.topology import Topology
from cpuservice.shell.engine import Engine
from cpuservice.shell.health import HealthMonitor
from cpuservice.shell.lifetime import Lifetime
from cpuservice.shell.ports import KernelAPI, SystemdAPI
from cpuservice.shell.service import Service
from cpuservice.shell.statistics import Sampler

log = logging.getLogger("cpuserviced")
EXIT_CONFIG = 78
DRAIN_SECONDS = 10.0  # at a stop, for writes still owed to the kernel


def assemble(cfg: config.Config, systemd: SystemdAPI, store: Store,
             kernel: KernelAPI | None = None) -> Service:
    """Wire the service's parts together: the engine (state, checkpoint, reconcile), the
    lifetime=unit watcher on systemd's signals, and the use cases."""
    topology = discover(cfg.sysfs_root)
    engine = Engine(cfg, systemd, store, topology, kernel, kept_cores(cfg, topology))
    lifetime = Lifetime(engine)
    service = Service(engine, lifetime)
    lifetime.release = service.release
    lifetime.serial = service.serial
    systemd.on_unit_removed = lifetime.on_unit_removed
    systemd.on_unit_new = lifetime.on_unit_new
    systemd.on_unit_state = lifetime.on_unit_state
    return service


def kept_cores(cfg: config.Config, topology: Topology) -> keep.Keep:
    """The cores kept next to the devices the configuration's [[keep_near]] rules match."""
    rules = cfg.keep_rules
    if not rules:
        return keep.Keep((), cfg.keep_near_others)
    inventory = Resolver(cfg.sysfs_root, cfg.procfs_root).inventory()
    found = keep.plan(topology, cfg.reserved, rules, inventory, cfg.keep_near_others)
    for line in keep.describe(found) or ["no device matches keep_near: no core is kept"]:
        log.info("keep_near (others: %s): %s", found.others, line)
    return found


def metrics_file(cfg: config.Config, service: Service,
                 sampler: Sampler | None = None) -> metrics.Textfile | None:
    """The metrics file; with ``sampler``, each allocation's figures as it last read them."""
    if not cfg.metrics_file:
        return None
    store = service.engine.store

    def render() -> str:
        text = metrics.render(service.topology, service.state, service.engine.counters,
                              __version__, (store.write_error is not None, store.write_failures))
        host = service.host
        text += figure_metrics.render_host(
            sampler.host if sampler is not None else {},
            host.available if host.guard.enabled else None, host.starving())
        if sampler is None or not sampler.interval:
            return text
        return text + figure_metrics.render(sampler.latest, service.ledger.allocations,
                                            sampler.took, service.engine.strain)
    return metrics.Textfile(cfg.metrics_file, render)


async def serve(cfg: config.Config, notifier: notify.Notifier | None = None) -> int:
    notifier = notifier or notify.Notifier()
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
    kernel = Kernel(systemd, os.environ.get("RUNTIME_DIRECTORY", "/run/cpuservice"))
    service = assemble(cfg, systemd, Store(cfg.state_file), kernel)
    debouncer.settled = lambda: service.revalidate(full=False)
    # after a daemon-reload, what cpuservice set is asserted again (a persistent drop-in of an
    # administrator, e.g. set-property system.slice AllowedCPUs=, may have masked it)
    reloads = Debouncer(lambda: service.revalidate(full=True), delay=0.5)
    systemd.on_reloaded = reloads.notify
    service.engine.audit = journal.Journal()
    loop = asyncio.get_running_loop()
    if monitor is not None:
        monitor.attach(loop)
    manager = Manager(service, bus, Authority(bus))
    service.lending.rate = manager.rate  # lending counts against the owners' change rate
    # every allocation's figures, read every statistics_seconds: its health, the metrics
    sampler = Sampler(service.statistics, cfg.statistics_seconds)
    health_monitor = HealthMonitor(service.engine, cfg.health_limits)
    textfile = metrics_file(cfg, service, sampler)

    def sampled() -> None:
        sampler.host = service.host.read()  # (two cgroups: the shared pool's holders)
        health_monitor.observe(sampler.latest)
        if textfile is not None:
            textfile.changed()

    sampler.on_sample = sampled

    def status() -> str:
        text = notify.status_text(service.ledger)
        if service.engine.store.write_error:
            text += f"; READ-ONLY, changes refused: {service.engine.store.write_error}"
        return text

    def changed() -> None:
        notifier.status(status())
        if textfile is not None:
            textfile.changed()

    service.on_committed(changed)
    if textfile is not None:
        service.engine.counters.listeners.append(textfile.changed)
        service.host.on_change = textfile.changed  # the guard's episodes
    bus.add_message_handler(capture_sender)
    await service.start()
    manager.export_all()
    reply = await bus.request_name(BUS_NAME)
    if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
        log.error("could not own %s: %s", BUS_NAME, reply)
        return 1
    log.info("cpuserviced %s serving %d allocation(s); shared CPUs %s", __version__,
             len(service.ledger.allocations), service.ledger.shared)
    notifier.ready(status())
    notifier.start_watchdog()
    if textfile is not None:
        textfile.write()
    sampler.start()
    settle_heap()
    async def drain() -> None:
        try:  # nothing stays lent that no one watches (a restart lends again when idle)
            await service.lending.shutdown()
        except Exception as exc:  # the next start derives it from the checkpoint
            log.warning("stopping with CPUs still lent: %s", exc)
        await kernel.settle()

    try:
        return await until_stopped(bus, loop, notifier, drain)
    finally:
        await sampler.shutdown()
        service.host.disarm()
        notifier.stop_watchdog()
        if textfile is not None:
            textfile.remove()


async def until_stopped(bus: MessageBus, loop: asyncio.AbstractEventLoop,
                        notifier: notify.Notifier,
                        drain: Callable[[], Awaitable[None]] | None = None) -> int:
    """Serve until SIGTERM/SIGINT or the bus is lost; on a stop, ``drain`` (lent CPUs to
    withdraw, the kernel holders' give-back still to write) gets a few seconds while the bus is
    still there."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    disconnected = asyncio.ensure_future(bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({disconnected, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if disconnected.done():
        log.error("lost the system bus")
        notifier.send(status="lost the system bus")
        return 1
    notifier.stopping()
    if drain is not None:
        try:
            await asyncio.wait_for(drain(), DRAIN_SECONDS)
        except Exception as exc:  # stopping anyway: startup writes what is missing
            log.warning("stopping before every CPU was given back: %s", exc)
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


def settle_heap() -> None:
    """What the start made (modules, the topology, the bus's interfaces: some 40,000 objects)
    lives as long as the daemon: collected once, then frozen, so that no full collection walks
    it again. A full collection of it took 9-15 ms of CPU on a 2-core host and about five
    times that under the lab's emulated CPU, whenever one fell due: in an idle minute (the
    guard's idle check saw 12 ms one run, 56 ms the next, both in two wake-ups) or in the
    middle of an Allocate."""
    gc.collect()
    gc.freeze()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpuserviced", description="The cpuservice daemon.")
    parser.add_argument("--config", metavar="PATH",
                        help="read just PATH and PATH.d/ (default: cpuservice.toml and "
                        "cpuservice.toml.d/ of " + ", ".join(str(d) for d in config.DIRS) + ")")
    parser.add_argument("--check-config", action="store_true",
                        help=f"check the configuration and exit: 0 valid, {EXIT_CONFIG} not")
    parser.add_argument("--version", action="version", version=__version__)
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    try:
        cfg = config.load(args.config)
    except config.ConfigError as exc:
        if args.check_config:
            print(f"cpuserviced: {exc}", file=sys.stderr)
        else:
            log.error("%s", exc)
            notify.Notifier().send(status=f"configuration error: {exc}")
        return EXIT_CONFIG
    if args.check_config:
        files = config.sources(args.config)
        print("configuration is valid: " + (" + ".join(str(f) for f in files)
                                            or "no file, the built-in defaults"))
        return 0
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
