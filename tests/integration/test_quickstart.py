"""Issue 42: the README's quick start, run as a user types it on real systemd. The commands are
read from README.md's quick-start block (tests/unit/test_docs_names.py checks the block is
there and names the tools), run one after the other in the container host's shell as root, and
each must succeed and do what the README's first screen says: an allocation appears with the
CPUs asked for, off the shared pool; cpuservice-run's allocation lives as long as its command;
status and topology show the allocation; resize changes it; release ends it."""

from __future__ import annotations

import shlex
from typing import Any

from cpuservice.model.cpuset import CPUSet
from tests.integration.service_env import ServiceHost, eventually
from tests.integration.test_service import allocations
from tests.unit.test_docs_names import quick_start


def amount(row: list[Any]) -> float:
    return float(row[1])


def check(argv: list[str], before: dict[str, list[Any]], daemon: ServiceHost,
          stdout: str) -> None:
    """What the README's comment on this command promises, by the command's verb."""
    tool, verb = argv[0], argv[1] if len(argv) > 1 else ""
    after = allocations(daemon)
    if tool == "cpuservice-run":
        assert stdout.strip(), argv  # the command ran and printed
        eventually(lambda: allocations(daemon).keys() == before.keys())  # released after it
        return
    assert tool == "cpuservicectl", argv
    words = [w for w in argv[2:] if not w.startswith("-")]
    if verb == "allocate":
        name, cpus = words[:2]
        row = after[name]
        assert amount(row) == float(cpus), row
        held = CPUSet.parse(row[3])
        if "--bind" in argv:
            assert row[2] and len(held) == float(cpus), row
            shared = CPUSet.parse(daemon.prop("SharedCPUs"))
            assert not (held & shared), (held, shared)
    elif verb == "resize":
        name, cpus = words[:2]
        assert amount(after[name]) == float(cpus), after[name]
        if after[name][2]:
            assert len(CPUSet.parse(after[name][3])) == float(cpus), after[name]
    elif verb == "release":
        assert words[0] in before and words[0] not in after, (before, after)
    elif verb in ("status", "topology"):
        for name in words[:1] or after:
            assert name in stdout, (verb, name, stdout)
    elif verb == "lend":
        assert after[words[0]], after
    else:
        raise AssertionError(f"the quick start's {verb!r} has no check here: add one")
    if verb not in ("release",):
        assert after.keys() >= before.keys(), (before, after)


def test_the_readme_quick_start_runs_as_typed(daemon: ServiceHost) -> None:
    """On fixture machine a (8 CPUs, the README's "8 CPUs or more"), as root, each line of the
    block exactly as written (its comment included) through sh."""
    typed = quick_start()
    assert not allocations(daemon)
    for line in typed:
        before = allocations(daemon)
        out = daemon.c.run(["sh", "-c", line], check=False, timeout=180)
        assert out.returncode == 0, (line, out.returncode, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr, (line, out.stderr)
        check(shlex.split(line, comments=True), before, daemon, out.stdout)
    assert not allocations(daemon), "the quick start leaves allocations behind"
