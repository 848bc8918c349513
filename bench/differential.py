"""Differential harness for the placement engine: the outcome of every call of a seeded trace of
allocate, release, resize, place, capacity, repack and repair on many topologies, written one
line per call, so that two versions of the engine can be compared call by call (a speed-up
must not change a single placement, error message or count).

    bench/differential.py [--ops N] [--out FILE]      write the outcomes (default: a digest)
    bench/differential.py --against /path/to/tree      run the other tree's engine on the same
                                                       trace (this file, its PYTHONPATH) and
                                                       print the calls compared and the first
                                                       differences

Prints ``differential calls=<n> differences=<n>`` with --against. The trace depends only on the
seeds, never on what the engine returned (a release names an allocation whether or not it
exists; the outcome records the error).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

from cpuservice import placement
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import CPUServiceError
from cpuservice.model.fixtures import MACHINES, SHAPES, Machine
from cpuservice.model.pools import Ledger, check_invariants
from cpuservice.model.request import Request
from cpuservice.model.topology import Topology
from cpuservice.placement.repack import repack
from cpuservice.placement.repair import repair

EXTRA: dict[str, Machine] = {
    "smt4": Machine(1, 8, 4, nodes=2),
    "iso-c": Machine(2, 16, 2, nodes=4, l3_cores=4, isolated=frozenset(range(24, 32))),
    "flat64": Machine(2, 32, 1, nodes=2, l3_cores=8),
    "offline-c": Machine(2, 16, 2, nodes=2, l3_cores=8, offline=frozenset({3, 40, 41, 63})),
    "hybrid2": Machine(2, 10, 2, nodes=2, small_cores=4, adjacent_siblings=True),
}
SKIP = {"e"}  # 1,024 CPUs: the bench's own lines cover it; here it would dominate the time

POLICIES = ("packed", "packed", "full-pcpus", "spread-pcpus")
# capacity of these shapes every SWEEP calls, on the ledger of the moment (not drawn: the trace
# stays as it was): capacity's walks per cell (one CPU, a CPU and a piece, a core and a thread)
SWEEP = 50
SWEEP_SHAPES: tuple[tuple[str, dict[str, object]], ...] = (
    ("1", {}), ("1.001", {}), ("1.01", {}), ("1.5", {}), ("2", {}), ("2.01", {}), ("3", {}),
    ("5", {}),
    ("1", {"numa-alignment": "none"}), ("3", {"numa-alignment": "single-numa-node"}),
    ("1", {"exclusive": "pcpu"}), ("2", {"numa-strategy": "least-allocated"}),
)


def machines() -> dict[str, Machine]:
    return {k: m for k, m in {**MACHINES, **SHAPES, **EXTRA}.items() if k not in SKIP}


def _options(rng: random.Random) -> dict[str, object]:
    opts: dict[str, object] = {"bind": rng.random() < 0.9, "policy": rng.choice(POLICIES)}
    r = rng.random()
    if r < 0.08:
        opts["exclusive"] = "pcpu"
    elif r < 0.12:
        opts["exclusive"] = "numa"
    r = rng.random()
    if r < 0.1:
        opts["numa-alignment"] = rng.choice(("none", "restricted", "single-numa-node"))
    if rng.random() < 0.1:
        opts["numa-strategy"] = rng.choice(("least-allocated", "distribute-evenly"))
    if rng.random() < 0.3:
        opts["movable"] = rng.choice(("node", "anywhere"))
    return opts


def _amount(rng: random.Random, cpus: int, granularity: int) -> str:
    whole = rng.choice((0, 1, 1, 2, 2, 3, 4, 4, 6, 8, max(1, cpus // 4), max(1, cpus // 2)))
    r = rng.random()
    if r < 0.15:
        return f"{whole}.{rng.randint(1, 9)}"
    if r < 0.2 and granularity == 1000:
        return f"{whole}.{rng.randint(1, 999):03d}"
    return str(max(1, whole))


def _outcome(ledger: Ledger, name: str) -> str:
    a = ledger.allocations[name]
    return f"{a.whole}|{a.fragment.cpu if a.fragment else '-'}:" \
           f"{a.fragment.pieces if a.fragment else 0}"


def trace(key: str, machine: Machine, seed: int, ops: int) -> Iterator[str]:
    """One topology's calls and their outcomes."""
    rng = random.Random(f"{key}-{seed}")
    topology: Topology = machine.topology()
    online = topology.online
    reserved = CPUSet(topology.cores[next(iter(topology.cores))]) if rng.random() < 0.5 else \
        CPUSet()
    granularity = rng.choice((100, 1000))
    ledger = Ledger(online, reserved=reserved & online, isolated=topology.isolated & online,
                    granularity=granularity, min_shared_cpus=rng.choice((1, 2)))
    names: list[str] = []
    n = len(online)
    for i in range(ops):
        r = rng.random()
        amount = _amount(rng, n, granularity)
        opts = _options(rng)
        try:
            request = Request.parse(amount, opts)
        except CPUServiceError as exc:
            yield f"{i} parse {type(exc).__name__}"
            continue
        head = f"{i} {amount} {sorted(opts.items())}"
        try:
            if r < 0.45 or not names:
                name = f"a{i}"
                try:
                    ledger, _ = placement.allocate(topology, ledger, name, request)
                    names.append(name)
                    yield f"{head} allocate {_outcome(ledger, name)}"
                except CPUServiceError as exc:
                    yield f"{head} allocate {type(exc).__name__}: {exc}"
                    if request.options.movable != "no":
                        found = repack(topology, ledger, name, request)
                        if found is None:
                            yield f"{head} repack none"
                        else:
                            ledger, _, moves = found
                            names.append(name)
                            yield (f"{head} repack {_outcome(ledger, name)} " + " ".join(
                                f"{m.old.name}:{m.old.whole}>{m.new.whole}" for m in moves))
            elif r < 0.75:
                name = names.pop(rng.randrange(len(names)))
                ledger = placement.release(ledger, name)
                yield f"{i} release {name}"
            elif r < 0.82:
                name = rng.choice(names)
                ledger, _ = placement.resize(topology, ledger, name, Decimal(amount))
                yield f"{i} resize {name} {amount} {_outcome(ledger, name)}"
            elif r < 0.9:
                p = placement.place(topology, ledger, request)
                yield f"{head} place {p.cpus} {p.whole} {p.fragment}"
            elif r < 0.99:
                yield f"{head} capacity {placement.capacity(topology, ledger, request)}"
            else:  # a CPU goes offline (or comes back): repair
                flip = rng.choice(sorted(topology.online | CPUSet(topology.cpus)))
                now = (topology.online - CPUSet((flip,)) if flip in topology.online
                       else topology.online | CPUSet((flip,)))
                if now:
                    topology = topology.with_online(now)
                    ledger, changes = repair(topology, ledger)
                    yield f"{i} repair {flip} " + " ".join(map(str, changes))
        except CPUServiceError as exc:
            yield f"{head} error {type(exc).__name__}: {exc}"
        check_invariants(ledger)
        if i % SWEEP == SWEEP - 1:
            for amount, extra in SWEEP_SHAPES:
                try:
                    count = placement.capacity(topology, ledger,
                                               Request.parse(amount, {"bind": True, **extra}))
                    yield f"{i} sweep {amount} {sorted(extra.items())} capacity {count}"
                except CPUServiceError as exc:
                    yield f"{i} sweep {amount} {sorted(extra.items())} {type(exc).__name__}: {exc}"


def outcomes(ops: int, seeds: int) -> Iterator[str]:
    for key, machine in machines().items():
        for seed in range(seeds):
            for line in trace(key, machine, seed, ops):
                yield f"{key}/{seed} {line}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1500, help="calls per topology and seed")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per topology")
    parser.add_argument("--out", help="write the outcomes here, one line per call")
    parser.add_argument("--against", help="another source tree: compare its outcomes")
    args = parser.parse_args(argv)
    if args.against:
        env = {**os.environ, "PYTHONPATH": str(Path(args.against).resolve())}
        other = subprocess.run(
            [sys.executable, "-c",
             "import runpy,sys; sys.argv=['d','--out','/dev/stdout','--ops',"
             f"'{args.ops}','--seeds','{args.seeds}']; "
             f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"],
            env=env, cwd=str(Path(args.against).resolve()), capture_output=True, text=True,
            check=True).stdout.splitlines()
        mine = list(outcomes(args.ops, args.seeds))
        differences = [(a, b) for a, b in zip(mine, other, strict=False) if a != b]
        differences += [("<missing>", "<extra>")] * abs(len(mine) - len(other))
        for a, b in differences[:10]:
            print(f"- {b}\n+ {a}")
        print(f"differential calls={len(mine)} differences={len(differences)}")
        return 1 if differences else 0
    digest = hashlib.sha256()
    count = 0
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out:
        for line in outcomes(args.ops, args.seeds):
            out.write(line + "\n")
            digest.update(line.encode())
            count += 1
    if not args.out or args.out != "/dev/stdout":
        print(f"differential calls={count} sha256={digest.hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
