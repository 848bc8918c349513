"""Command-line habits of systemctl users: options anywhere, -j, --version, --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cpuservice.ctl import parser


@pytest.mark.parametrize("argv", [["list", "--json"], ["--json", "list"], ["-j", "list"],
                                  ["list", "-j", "--no-pager"]])
def test_options_anywhere(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    assert args.json and args.command == "list"


def test_options_after_the_verb_keep_the_ones_before() -> None:
    args = parser().parse_args(["--no-ask-password", "show", "x", "-j"])
    assert args.no_ask_password and args.json and args.name == "x"
    assert not parser().parse_args(["status"]).json


@pytest.mark.parametrize("tool", ["ctl", "run"])
def test_help_and_version(tool: str) -> None:
    for flag in ("--help", "--version"):
        out = subprocess.run([sys.executable, "-m", f"cpuservice.{tool}", flag],
                             capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout, (tool, flag, out.stderr)


def test_a_closed_pipe_ends_quietly() -> None:
    code = ("import sys; sys.argv = ['cpuservicectl', 'status']\n"
            "import cpuservice.ctl as ctl\n"
            "async def run(args): raise BrokenPipeError\n"
            "ctl._run = run\n"
            "sys.exit(ctl.main(['status']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == ""
