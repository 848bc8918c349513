"""cpuservicectl export nrt: when --watch prints (Pacer, on an injected clock: at once, then
after a change no sooner than a second after the last print, and a minute after it in any
case), the YAML it writes, and its arguments."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json

import pytest

from cpuservice.cli import ctl_export
from cpuservice.cli.ctl import parse
from cpuservice.cli.ctl_export import Pacer, render, yaml
from cpuservice.cli.ctl_output import JsonMode
from cpuservice.host import dbuscall
from cpuservice.model import nrt
from cpuservice.model.fixtures import MACHINES
from cpuservice.model.pools import Ledger


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replay(changes: list[float], until: float) -> list[float]:
    """When the watch loop prints, for changes at these times (see run_follow)."""
    return [when for when, _ in run_follow(changes, until)[0]]


def test_watch_prints_at_once_and_once_a_minute_when_nothing_changes() -> None:
    assert replay([], 180) == [0, 60, 120, 180]


def test_a_change_is_printed_at_once_after_a_quiet_second() -> None:
    assert replay([5.5], 70) == [0, 5.5, 65.5]


def test_a_burst_of_changes_is_one_object_a_second() -> None:
    burst = [10 + i * 0.1 for i in range(25)]  # 25 changes in 2.4 s
    assert replay(burst, 15) == [0, 10, 11, 12, 13]


def run_follow(changes: list[float], until: float, down: tuple[float, float] = (0, 0),
               quiet: tuple[float, ...] = ()) -> tuple[list[tuple[float, int]], list[str]]:
    """The real --watch loop (ctl_export.follow) on a clock that only moves when it sleeps:
    changes at these times (seconds from the start), the daemon away during ``down``. Returns
    (time, generation) of every object printed, and what went to standard error."""
    clock = Clock()
    start = clock.now
    pacer = Pacer(clock)
    pending = sorted([*changes, *quiet])
    printed: list[tuple[float, int]] = []
    generation = 0

    async def fetch() -> dict[str, int]:
        if down[0] <= clock.now - start < down[1]:
            raise dbuscall.CallError("org.freedesktop.DBus.Error.ServiceUnknown", "not there")
        return {"generation": generation}

    async def sleep(seconds: float) -> None:
        nonlocal generation
        wake = clock.now + seconds
        if pending and start + pending[0] <= wake:
            at = pending.pop(0)
            clock.now = max(clock.now, start + at)
            generation += at not in quiet  # a quiet signal changes nothing
            pacer.changed()
        else:
            clock.now = wake

    def emit(obj: dict[str, int]) -> None:
        printed.append((round(clock.now - start, 3), obj["generation"]))

    async def main() -> None:
        while clock.now - start <= until:
            await ctl_export.follow(pacer, fetch, emit, sleep, rounds=1)

    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        asyncio.run(main())
    return printed, errors.getvalue().splitlines()


def test_the_watch_loop_paces_on_the_injected_clock() -> None:
    printed, _ = run_follow([5.5, 10, 10.2, 10.4, 10.6, 10.8, 11.0, 11.2], 80)
    assert printed == [(0, 0), (5.5, 1), (10, 2), (11, 7), (12, 8), (72, 8)]


def test_signals_that_change_nothing_print_nothing() -> None:
    """A daemon's signal after a change (a unit that became active, a property announced late)
    woke the watch a second after it printed the change, and it printed the same object again
    (the integration tier saw 3 objects for one change). An unchanged object is printed only at
    the minute's resync."""
    printed, _ = run_follow([5.5], 70, quiet=(6.0, 6.7, 30.2))
    assert printed == [(0, 0), (5.5, 1), (65.5, 1)]


def test_the_watch_loop_goes_on_while_the_daemon_restarts() -> None:
    """The resync at 90.5 s finds no daemon: one line on standard error, and the object comes
    when the daemon is back (its new name owner is a change, at 92 s)."""
    printed, errors = run_follow([30.5, 92], 130, down=(90, 92))
    assert printed == [(0, 0), (30.5, 1), (92, 2)]
    assert len(errors) == 1 and "not running" in errors[0] and errors[0].endswith("retrying")


def test_a_change_right_after_a_print_waits_for_the_second_to_pass() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    assert pacer.due() and pacer.wait() == 0
    pacer.printed()
    assert pacer.show({"generation": 0}, pacer.resync_due())
    clock.now += 0.25
    pacer.changed()
    assert not pacer.due() and pacer.wait() == pytest.approx(0.75)
    clock.now += 0.75
    assert pacer.due()
    pacer.printed()
    assert pacer.show({"generation": 1}, pacer.resync_due())
    assert not pacer.due() and pacer.wait() == pytest.approx(60)
    clock.now += 59.999
    assert not pacer.due()
    clock.now += 0.001
    assert pacer.due()


def test_yaml_is_block_style_with_quoted_strings() -> None:
    obj = {"kind": "NodeResourceTopology", "metadata": {"name": "w1"}, "topologyPolicies": [],
           "zones": [{"name": "node-0", "costs": [{"name": "node-0", "value": 10}],
                      "resources": [{"name": "cpu", "available": "8"}]}], "ok": True}
    assert yaml(obj) == """kind: "NodeResourceTopology"
metadata:
  name: "w1"
topologyPolicies: []
zones:
  - name: "node-0"
    costs:
      - name: "node-0"
        value: 10
    resources:
      - name: "cpu"
        available: "8"
ok: true"""
    assert yaml(["a", 1, {"x": "y: z"}, [], {}, [None]]) == (
        '- "a"\n- 1\n- x: "y: z"\n- []\n- {}\n- - null')


def test_render_is_yaml_unless_json_was_asked_for() -> None:
    t = MACHINES["b"].topology()
    obj = nrt.export(t, Ledger(t.online), "w1", 0)
    args = argparse.Namespace(json_mode=JsonMode.OFF)
    assert render(obj, args).startswith('---\napiVersion: "topology.node.k8s.io/v1alpha2"\n')
    args.json_mode = JsonMode.SHORT
    assert json.loads(render(obj, args)) == obj and "\n" not in render(obj, args)
    args.json_mode = JsonMode.PRETTY
    assert json.loads(render(obj, args)) == obj


def test_export_arguments() -> None:
    args = parse(["export", "nrt", "--node-name", "w1", "--watch", "-o", "yaml"])
    assert (args.command, args.kind, args.node_name, args.watch) == ("export", "nrt", "w1", True)
    assert args.json_mode is JsonMode.OFF
    assert parse(["-o", "json", "export", "nrt"]).json_mode is JsonMode.SHORT
    assert parse(["export", "nrt"]).node_name == ""
    for bad in (["list", "-o", "yaml"], ["export", "topology"], ["export"]):
        with pytest.raises(SystemExit) as exc:
            parse(bad)
        assert exc.value.code == 2
    assert ctl_export.check_output(argparse.Namespace(output="yaml", command="show"))
