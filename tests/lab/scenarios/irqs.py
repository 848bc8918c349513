"""VM lab scenario: interrupt isolation (isolate_irqs) on a real kernel. Turns isolation on,
allocates bound CPUs, makes a movable interrupt fire (the first serial port, written to) and
counts from /proc/interrupts where the interrupts landed. Prints lines starting with ``RESULT ``
(JSON) and the summary line

    irq_on_bound_cpus movable=<n> deferred=<n> unmovable=<n> total_on_shared=<n> irqbalance=<yes|no>

(deferred: arrivals of interrupts whose move the kernel put off to their next arrival, at most
one per such interrupt; movable: every other confined interrupt, must be 0)

    python3 irqs.py check yes|no     isolation with (or without) irqbalance running
    python3 irqs.py bench ROUNDS     irq_follow_ms: Allocate until the last affinity is written
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dbus_fast import BusType, Variant
from dbus_fast.aio import MessageBus

sys.path.insert(0, str(Path(__file__).parent))
from hotplug import Client, parse

DROPIN = Path("/etc/cpuservice/cpuservice.toml.d/50-irqs.toml")
SERIAL = "/dev/ttyS0"  # the console; its output goes to a log file on the host


def result(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def interrupts() -> dict[int, list[int]]:
    """IRQ number -> count per CPU, from /proc/interrupts (numbered lines only)."""
    lines = Path("/proc/interrupts").read_text().splitlines()
    ncpu = len(lines[0].split())
    out = {}
    for line in lines[1:]:
        head, _, rest = line.partition(":")
        if head.strip().isdigit():
            counts = rest.split()[:ncpu]
            out[int(head)] = [int(x) for x in counts if x.isdigit()] + [0] * (ncpu - len(counts))
    return out


def fire(seconds: float = 3.0) -> None:
    """Write to the serial port for a while: each FIFO's worth raises an interrupt."""
    end = time.monotonic() + seconds
    with open(SERIAL, "wb", buffering=0) as tty:
        while time.monotonic() < end:
            tty.write(b"irq isolation test: " + b"." * 200 + b"\r\n")


def affinity(irq: int) -> set[int]:
    return parse(Path(f"/proc/irq/{irq}/smp_affinity_list").read_text().strip())


def irq_name(irq: int) -> str:
    for line in Path("/proc/interrupts").read_text().splitlines():
        if line.split(":")[0].strip() == str(irq):
            return " ".join(x for x in line.split()[1:] if not x.isdigit())
    return "?"


def effective(irq: int) -> str:
    try:
        return Path(f"/proc/irq/{irq}/effective_affinity_list").read_text().strip()
    except OSError:
        return "?"


def serial_irq() -> int:
    for line in Path("/proc/interrupts").read_text().splitlines():
        if line.rstrip().endswith("ttyS0"):
            return int(line.split(":")[0])
    return 4  # the first serial port's ISA line


def irqbalance_banned() -> set[int] | None:
    """The banned CPUs irqbalance works with now (its socket's ``setup`` answer)."""
    for path in Path("/run/irqbalance").glob("irqbalance*.sock"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(40)
            s.connect(str(path))
            s.sendall(b"setup")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        words = data.decode(errors="replace").split()
        if "BANNED" in words:
            value = int(words[words.index("BANNED") + 1].replace(",", ""), 16)
            return {i for i in range(value.bit_length()) if value >> i & 1}
    return None


def await_irqbalance(banned: set[int], seconds: float = 60) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if irqbalance_banned() == banned:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"FAILED STEP: irqbalance did not take the ban {sorted(banned)}")


def configure(on: bool) -> None:
    if on:
        DROPIN.parent.mkdir(parents=True, exist_ok=True)
        DROPIN.write_text("isolate_irqs = true\nisolate_workqueues = true\n")
    else:
        DROPIN.unlink(missing_ok=True)
    subprocess.run(["systemctl", "restart", "cpuservice"], check=True)


async def connect() -> Client:
    return Client(await MessageBus(bus_type=BusType.SYSTEM).connect())


async def check(irqbalance: bool) -> None:
    if irqbalance:
        subprocess.run(["systemctl", "start", "irqbalance"], check=True)
        time.sleep(2)
    else:
        subprocess.run(["systemctl", "stop", "irqbalance"], check=False)
    configure(True)
    c = await connect()
    await c.call("Allocate", "ssa{sv}", ["irqjob", "4", {"bind": Variant("b", True)}])
    bound = parse((await c.allocations())["irqjob"][3])
    iso = {k: v.value for k, v in (await c.prop("IRQIsolation")).items()}  # type: ignore[attr-defined]
    online = parse(Path("/sys/devices/system/cpu/online").read_text().strip())
    possible = parse(Path("/sys/devices/system/cpu/possible").read_text().strip())
    shared = parse(str(await c.prop("SharedCPUs")))  # other scenarios' allocations may remain
    if irqbalance:  # irqbalance 1.9.2 takes a new ban at its next rescan, up to 30 s later
        took = await_irqbalance(possible - shared)
        result(check="irqbalance", banned_after_s=took)
    with open(SERIAL, "wb", buffering=0):  # opening the port requests its interrupt
        irq = serial_irq()
        # x86 without interrupt remapping moves an interrupt when it is next acknowledged: the
        # first one after a change of affinity may still land on the old CPU
        fire(0.3)
        before = interrupts()
        fire()
        after = interrupts()
    movable = set(iso["confined"]) - set(iso["unmovable"])
    # a move the kernel deferred to the interrupt's next arrival: that arrival may still land
    # on the CPU it leaves (x86 IO-APIC without interrupt remapping), once
    pending = set(iso["pending"])
    on_bound = {"movable": 0, "deferred": 0, "unmovable": 0}
    total_on_shared = 0
    for n, counts in after.items():
        delta = [a - b for a, b in zip(counts, before.get(n, [0] * len(counts)), strict=False)]
        for cpu, d in enumerate(delta):
            if cpu in bound:
                kind = ("unmovable" if n in iso["unmovable"] and n not in movable else
                        "deferred" if n in pending else "movable")
                on_bound[kind] += d
                if d and kind != "unmovable":  # which one, and what the kernel says of it
                    result(check="landed", irq=n, cpu=cpu, count=d, name=irq_name(n),
                           affinity=sorted(affinity(n)), effective=effective(n),
                           confined=n in iso["confined"], pending=n in pending)
            else:
                total_on_shared += d
    fired = sum(after[irq]) - sum(before.get(irq, [0]))
    result(check="isolated", irqbalance=irqbalance, bound=sorted(bound), serial_irq=irq,
           serial_fired=fired, serial_affinity=sorted(affinity(irq)),
           default=Path("/proc/irq/default_smp_affinity").read_text().strip(),
           workqueues=Path("/sys/devices/virtual/workqueue/cpumask").read_text().strip(),
           unmovable=iso["unmovable"], pending=iso["pending"], told_irqbalance=iso["irqbalance"],
           shared=sorted(shared))
    print(f"irq_on_bound_cpus movable={on_bound['movable']} deferred={on_bound['deferred']} "
          f"unmovable={on_bound['unmovable']} "
          f"total_on_shared={total_on_shared} irqbalance={'yes' if irqbalance else 'no'}",
          flush=True)
    await c.call("Release", "s", ["irqjob"])
    # the interrupts get released CPUs back shortly after Release answers (coalesced writes)
    start = time.monotonic()
    while not bound <= affinity(irq) and time.monotonic() - start < 10:
        await asyncio.sleep(0.05)
    result(check="released", serial_affinity=sorted(affinity(irq)), online=sorted(online),
           given_back_s=round(time.monotonic() - start, 2))
    configure(False)
    result(check="off", serial_affinity=sorted(affinity(irq)),
           default=Path("/proc/irq/default_smp_affinity").read_text().strip())
    if irqbalance:
        subprocess.run(["systemctl", "stop", "irqbalance"], check=False)


async def bench(rounds: int) -> None:
    configure(True)
    c = await connect()
    times = []
    with open(SERIAL, "wb", buffering=0):
        irq = serial_irq()
        for i in range(rounds):
            start = time.perf_counter()
            await c.call("Allocate", "ssa{sv}", [f"b{i}", "2", {"bind": Variant("b", True)}])
            held = parse((await c.allocations())[f"b{i}"][3])
            while affinity(irq) & held:  # the write is done before Allocate answers
                await asyncio.sleep(0.001)
            times.append((time.perf_counter() - start) * 1000)
            await c.call("Release", "s", [f"b{i}"])
    configure(False)
    result(check="bench", p50=statistics.median(times), max=max(times), rounds=rounds)
    print(f"irq_follow_ms p50 {statistics.median(times):.1f}", flush=True)


def main(argv: list[str]) -> int:
    if argv[0] == "check":
        asyncio.run(check(argv[1] == "yes"))
    else:
        asyncio.run(bench(int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
