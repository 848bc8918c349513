"""Interrupt isolation (isolate_irqs) on the lab's real kernel, with and without irqbalance."""

from __future__ import annotations

import pytest

from tests.envs import lab


def rows(result: lab.Result) -> dict[str, dict]:  # type: ignore[type-arg]
    return result.checks()


def summary(result: lab.Result) -> dict[str, str]:
    line = next(x for x in result.output.splitlines() if x.startswith("irq_on_bound_cpus "))
    print(f"\n{line}")
    return dict(part.split("=") for part in line.split()[1:])


@pytest.mark.parametrize("scenario", ["irqs", "irqs-irqbalance"])
def test_no_movable_interrupt_reaches_bound_cpus(main_boot: lab.Run, scenario: str) -> None:
    result = main_boot.results[scenario]
    assert result.status == 0, result.output
    found = rows(result)
    line = summary(result)
    isolated = found["isolated"]
    assert line["movable"] == "0", result.output
    # an interrupt whose move the kernel deferred (reported pending) lands at most once on the
    # CPU it leaves: its next arrival, which makes the move
    landed = [r for r in result.rows() if r.get("check") == "landed"]
    assert all(r["pending"] and r["count"] <= 1 for r in landed), landed
    assert int(line["deferred"]) <= len(isolated["pending"]), result.output
    assert int(line["total_on_shared"]) > 0 and isolated["serial_fired"] > 0, result.output
    assert set(isolated["serial_affinity"]) <= set(isolated["shared"])
    assert not set(isolated["serial_affinity"]) & set(isolated["bound"])
    if scenario == "irqs-irqbalance":
        assert isolated["told_irqbalance"], result.output
    # after release the bound CPUs may receive interrupts again; isolation off: every CPU
    assert set(isolated["bound"]) <= set(found["released"]["serial_affinity"])
    assert found["off"]["serial_affinity"] == found["released"]["online"]
