"""The audit trail's sink: events (cpuservice.apply.audit) go to journald over its native
protocol, or to the log where there is no journal."""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Mapping

from cpuservice.apply.audit import CALLER as CALLER
from cpuservice.apply.audit import IDENTIFIER as IDENTIFIER
from cpuservice.apply.audit import MESSAGE_IDS as MESSAGE_IDS
from cpuservice.apply.audit import WARNING
from cpuservice.apply.audit import Audit as Audit
from cpuservice.apply.audit import Event as Event
from cpuservice.apply.audit import Kind as Kind
from cpuservice.apply.audit import Recorder as Recorder
from cpuservice.apply.audit import event as event

log = logging.getLogger("cpuserviced")
JOURNAL_SOCKET = "/run/systemd/journal/socket"


def encode(fields: Mapping[str, str]) -> bytes:
    """One datagram of the journal's native protocol: ``KEY=value\\n`` per field, or, for a value
    with a newline, ``KEY\\n`` + its length as 64-bit little endian + the value + ``\\n``."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode()
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class Journal:
    """Sends events to journald over its native socket, or logs them when there is no journal.

    Why the socket and not python3-systemd's ``journal.send``: that module is not among the
    package's dependencies (nor in the test virtualenv), and the protocol it would wrap is one
    datagram of ``KEY=value`` lines (systemd's "Native Journal Protocol", stable since 2012),
    which the unit's RestrictAddressFamilies=AF_UNIX allows. Structured fields cannot travel
    through standard error, so that stays for plain log lines.

    The journal is used when standard error is connected to it (``$JOURNAL_STREAM`` names its
    device and inode, as systemd sets it for a service) and its socket exists; otherwise (a
    terminal, a test, a container without journald) every event is one log line on standard
    error instead. A send that fails (journald gone, an entry too large for a datagram) logs
    the event the same way; so does one that would block (journald's queue is full)."""

    def __init__(self, native: bool | None = None, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self.native = stderr_is_journal() and os.path.exists(path) if native is None else native
        self._sock: socket.socket | None = None

    def send(self, event: Event) -> None:
        if self.native:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)  # a stalled journald must not stop the loop
                self._sock.sendto(encode(event.fields()), self.path)
                return
            except OSError as exc:
                log.warning("cannot write to the journal (%s): logging the event instead", exc)
        log.log(logging.WARNING if event.priority <= WARNING else logging.INFO, "%s",
                event.message)


def stderr_is_journal() -> bool:
    """Whether standard error is the journal's stream (``$JOURNAL_STREAM`` = its dev:inode)."""
    try:
        dev, ino = (int(x) for x in os.environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(2)
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)
