"""Standard output into a pipe whose reader quit early (``cpuservicectl topology | head``): the
tool ends quietly, as the reader has what it wanted (Python's documentation, "Note on SIGPIPE")."""

from __future__ import annotations

import os
import sys


def flush() -> None:
    """Write out what is still buffered while the caller can catch a BrokenPipeError; left to
    the interpreter's exit, a closed pipe is reported there (Python 3.13 does) after the tool's
    own handler has returned."""
    sys.stdout.flush()


def discard() -> None:
    """After a BrokenPipeError: standard output goes to /dev/null, so what is left in its buffer
    does not fail once more when the interpreter exits."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
