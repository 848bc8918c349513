"""Command-line habits of systemctl and systemd-run users: options anywhere, -j/--json=MODE/-o,
--version, --help; cpuservice-run's optional --, refused options and exit codes."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuservice.cli import ctl, plan, run
from cpuservice.cli.ctl import allocation_name, parse, parser
from cpuservice.cli.ctl_output import JsonMode, cpu_time, dumps, json_mode, nulls, timespan
from cpuservice.cli.options import choices, options_of
from cpuservice.model import request


@pytest.mark.parametrize("argv", [["list", "--json"], ["--json", "list"], ["-j", "list"],
                                  ["list", "-j", "--no-pager"], ["list", "--json=short"],
                                  ["-o", "json", "list"], ["list", "--output=json-pretty"]])
def test_options_anywhere(argv: list[str]) -> None:
    args = parse(argv)
    assert args.json_mode is not JsonMode.OFF and args.command == "list"


def test_options_after_the_verb_keep_the_ones_before() -> None:
    args = parse(["--no-ask-password", "show", "x", "-j", "-p", "CPUs,Bound", "--value"])
    assert args.no_ask_password and args.json_mode is not JsonMode.OFF and args.name == "x"
    assert args.property == ["CPUs,Bound"] and args.value
    assert parse(["status"]).json_mode is JsonMode.OFF
    assert parse(["status", "web", "-q", "--no-legend"]).name == "web"


def test_json_modes() -> None:
    assert json_mode("auto", None, terminal=True) is JsonMode.PRETTY
    assert json_mode("auto", None, terminal=False) is JsonMode.SHORT
    assert json_mode("off", None, terminal=True) is JsonMode.OFF
    assert json_mode(None, "json-pretty", terminal=False) is JsonMode.PRETTY
    assert dumps({"b": 1, "a": [2]}, JsonMode.SHORT) == '{"a":[2],"b":1}'
    with pytest.raises(SystemExit):
        parser().parse_args(["--json=loud", "list"])


def test_sentinels_are_null_in_json() -> None:
    assert nulls({"CPUQuotaPerSecUSec": 2**64 - 1, "CPUWeight": 100}) == {
        "CPUQuotaPerSecUSec": None, "CPUWeight": 100}
    assert nulls([{"cpu-quota-per-sec-usec": 150000, "fragment-cpu": -1}]) == [
        {"cpu-quota-per-sec-usec": 150000, "fragment-cpu": None}]
    assert nulls({"capacity": 2**32 - 1}) == {"capacity": None}


def test_timespans_as_systemd_prints_them() -> None:
    assert timespan(2**64 - 1) == "infinity"
    assert timespan(1_500_000) == "1s 500ms"
    assert timespan(200_000) == "200ms"
    assert timespan(0) == "0"
    assert cpu_time(796_231) == "796ms" and cpu_time(1_796_231) == "1.796s"
    assert cpu_time(123_500_000) == "2min 3.5s" and cpu_time(2_000_000) == "2s"


def test_one_vocabulary_with_the_service() -> None:
    p = parser()
    allocate = p._subparsers._group_actions[0].choices["allocate"]  # type: ignore[union-attr]
    by_dest = {a.dest: a for a in allocate._actions}
    assert tuple(by_dest["policy"].choices) == choices(request.Policy)
    assert set(choices(request.NumaAlignment)) == {"none", "best-effort", "restricted",
                                                   "single-numa-node"}
    assert tuple(by_dest["lifetime"].choices) == choices(request.Lifetime)


def test_allocation_names_from_paths() -> None:
    assert allocation_name("/org/cpuservice1/allocation/db_2dbatch") == "db-batch"
    assert allocation_name("/org/cpuservice1") is None


@pytest.mark.parametrize("tool", ["ctl", "run"])
def test_help_and_version(tool: str) -> None:
    for flag in ("--help", "--version"):
        out = subprocess.run([sys.executable, "-m", f"cpuservice.{tool}", flag],
                             capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout, (tool, flag, out.stderr)


def test_a_closed_pipe_ends_quietly() -> None:
    code = ("import sys; sys.argv = ['cpuservicectl', 'status']\n"
            "import cpuservice.cli.ctl as ctl\n"
            "async def run(args): raise BrokenPipeError\n"
            "ctl._run = run\n"
            "sys.exit(ctl.main(['status']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == ""


def test_plan_into_head_ends_quietly() -> None:
    """`cpuservice-plan --export nrt | head -1` printed a BrokenPipeError traceback."""
    out = subprocess.run(f"{sys.executable} -m cpuservice.cli.plan --machine e --export nrt "
                         "| head -c 10", shell=True, capture_output=True, text=True)
    assert out.stdout and out.stderr == "", out.stderr


@contextlib.contextmanager
def closed_stdout() -> Iterator[None]:
    """sys.stdout writes to a pipe whose reader has gone (`TOOL | head -1` after head ended).
    On leaving, it is flushed as the interpreter does at exit: nothing may be left to fail."""
    read, write = os.pipe()
    os.close(read)
    stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(write, "w")))
    real, sys.stdout = sys.stdout, stream
    try:
        yield
    finally:
        sys.stdout = real
    try:
        stream.flush()
    finally:
        with contextlib.suppress(BrokenPipeError):
            stream.close()


def test_plan_flushes_into_a_closed_pipe_itself() -> None:
    """Python 3.13 reported the closed pipe at exit ("Exception ignored on flushing sys.stdout"),
    after main() had returned: a short output was still in the buffer. main() flushes it and
    ends quietly; what is left goes to /dev/null."""
    with closed_stdout():
        assert plan.main(["--machine", "e"]) == 0


def test_ctl_flushes_into_a_closed_pipe_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    async def status(args: object) -> int:
        print("a short answer, well inside the buffer")
        return 0

    monkeypatch.setattr(ctl, "_run", status)
    with closed_stdout():
        assert ctl.main(["status"]) == 0


# ---- cpuservice-run ----

@pytest.mark.parametrize("argv,ours,passthrough,command", [
    (["--cpus", "2", "--", "sh", "-c", "x"], ["--cpus", "2"], [], ["sh", "-c", "x"]),
    (["--cpus", "2", "sh", "-c", "x"], ["--cpus", "2"], [], ["sh", "-c", "x"]),
    (["--bind", "-p", "CPUWeight=5", "-qP", "--service", "make", "-j4"],
     ["--bind", "--service"], ["-p", "CPUWeight=5", "-q", "-P"], ["make", "-j4"]),
    (["--unit=job", "-E", "A=1", "--uid", "alice", "top"], [],
     ["--unit", "job", "-E", "A=1", "--uid", "alice"], ["top"]),
    (["-pMemoryMax=1G", "--name", "n", "--", "--weird-command"], ["--name", "n"],
     ["-p", "MemoryMax=1G"], ["--weird-command"]),
    (["--borrow", "-q", "make"], ["--borrow"], ["-q"], ["make"]),
])
def test_run_command_line(argv: list[str], ours: list[str], passthrough: list[str],
                          command: list[str]) -> None:
    line = run.scan(argv)
    assert (line.ours, line.passthrough, line.command) == (ours, passthrough, command)


def test_run_lends_and_borrows() -> None:
    """cpuservice-run sends --lend and --borrow to Allocate, as cpuservicectl allocate does."""
    for flag in ("lend", "borrow"):
        args = run.parser().parse_args(run.scan(["--bind", f"--{flag}", "true"]).ours)
        assert options_of(args) == {"bind": True, flag: True}


@pytest.mark.parametrize("argv,named", [
    (["--slice=x", "true"], "--slice"), (["--slice", "x", "true"], "--slice"),
    (["--user", "true"], "--user"), (["-H", "h", "true"], "-H/--host"),
    (["-qM", "c", "true"], "-M/--machine"), (["-p", "Slice=x", "true"], "Slice="),
    (["--property=Slice=x", "true"], "Slice="), (["--on-calendar", "daily", "true"],
                                                  "--on-calendar"),
    (["--slice-inherit", "true"], "--slice-inherit"), (["--frobnicate", "true"], "--frob"),
])
def test_run_refuses_what_would_leave_the_allocation(argv: list[str], named: str) -> None:
    with pytest.raises(run.Usage, match=named):
        run.scan(argv)


@pytest.mark.parametrize("argv,code,text", [
    (["--slice=x", "true"], 125, "not allowed"),
    (["--cpus"], 125, "needs a value"),
    (["--policy", "tight", "true"], 125, "invalid choice"),
    (["--cpus", "1"], 125, "no command"),
    (["no-such-command-anywhere"], 127, "command not found"),
    (["{tmp}/plain.txt"], 126, "cannot run it"),
    (["{tmp}"], 126, "cannot run it"),
    (["--bus-address", "unix:path=/nonexistent", "true"], 125, "cannot reach the bus"),
])
def test_run_exit_codes_of_its_own(argv: list[str], code: int, text: str,
                                   tmp_path: Path) -> None:
    (tmp_path / "plain.txt").write_text("not a program\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = subprocess.run([sys.executable, "-m", "cpuservice.cli.run", *argv], capture_output=True,
                         text=True)
    assert out.returncode == code and text in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("env,utf8", [({}, True), ({"LANG": "C"}, False),
                                      ({"LANG": "en_US.UTF-8"}, True),
                                      ({"LC_ALL": "C", "LANG": "en_US.UTF-8"}, False),
                                      ({"LC_CTYPE": "de_DE.utf8"}, True),
                                      ({"LANG": "de_DE.ISO-8859-1"}, False)])
def test_line_drawing_follows_the_locale(env: dict[str, str], utf8: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from cpuservice.cli.ctl_output import unicode_wanted

    for var in ("LC_ALL", "LC_CTYPE", "LANG"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    assert unicode_wanted(stream) is utf8
    assert not unicode_wanted(io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
