"""The audit trail (cpuservice.host.journal): the native protocol's encoding, the fields of each
event, the socket adapter against a real datagram socket, and one event per committed change of
the real service code (tests.unit.fake_systemd), none for a change that failed."""

from __future__ import annotations

import logging
import re
import socket
import struct
from pathlib import Path

import pytest

from cpuservice.daemon import assemble
from cpuservice.host import journal
from cpuservice.host.checkpoint import Store
from cpuservice.host.journal import Event, Kind
from cpuservice.model.errors import CPUServiceError
from cpuservice.shell.service import Service
from tests.unit.fake_systemd import Unit
from tests.unit.test_service_fake import BIND, Host, run


def decode(data: bytes) -> dict[str, str]:
    """The native protocol read back (what journald does)."""
    out: dict[str, str] = {}
    while data:
        line, sep, rest = data.partition(b"\n")
        assert sep, data
        if b"=" in line:
            key, _, value = line.partition(b"=")
            out[key.decode()] = value.decode()
            data = rest
        else:
            (size,) = struct.unpack("<Q", rest[:8])
            out[line.decode()] = rest[8:8 + size].decode()
            assert rest[8 + size:9 + size] == b"\n"
            data = rest[9 + size:]
    return out


SAMPLE = Event(Kind.ALLOCATED, "web", 1000, "4-5", "2", True, "cpuservice-bound-web.slice")


def test_message_ids_are_distinct_128_bit_ids() -> None:
    ids = [journal.MESSAGE_IDS[k] for k in Kind]
    assert len(set(ids)) == len(Kind)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_fields_name_who_took_which_cpus() -> None:
    f = SAMPLE.fields()
    assert f["MESSAGE_ID"] == journal.MESSAGE_IDS[Kind.ALLOCATED]
    assert f["SYSLOG_IDENTIFIER"] == "cpuserviced" and f["PRIORITY"] == "5"
    assert (f["CPUSERVICE_ALLOCATION"], f["CPUSERVICE_UID"], f["CPUSERVICE_CPUS"]) == (
        "web", "1000", "4-5")
    assert f["CPUSERVICE_UNIT"] == f["OBJECT_SYSTEMD_UNIT"] == "cpuservice-bound-web.slice"
    assert f["MESSAGE"] == ("allocation web allocated: uid 1000, 2 bound CPUs on CPUs 4-5, unit "
                            "cpuservice-bound-web.slice")
    assert "CPUSERVICE_REASON" not in f
    degraded = Event(Kind.REPAIRED, "web", 0, "4", "2", True, "u.slice", "degraded", "lost 5",
                     (("LOST", "5"), ("GAINED", "")))
    g = degraded.fields()
    assert g["PRIORITY"] == "4" and g["CPUSERVICE_LOST"] == "5" and g["CPUSERVICE_REASON"] == (
        "lost 5")
    assert g["MESSAGE"].endswith(", degraded (lost 5)")


def test_encoding_is_binary_safe() -> None:
    fields = {"MESSAGE": "two\nlines", "CPUSERVICE_CPUS": "0-3", "EMPTY": ""}
    data = journal.encode(fields)
    assert b"MESSAGE\n" + struct.pack("<Q", 9) + b"two\nlines\n" in data
    assert b"CPUSERVICE_CPUS=0-3\n" in data
    assert decode(data) == fields


def test_journal_sends_one_datagram_to_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(5)
        sink = journal.Journal(native=True, path=path)
        sink.send(SAMPLE)
        assert decode(server.recv(65536)) == SAMPLE.fields()


def test_without_a_journal_an_event_is_a_log_line(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cpuserviced")
    journal.Journal(native=False).send(SAMPLE)
    # a socket that is gone: the event is logged instead, not lost
    journal.Journal(native=True, path=str(tmp_path / "nothing")).send(SAMPLE)
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count(SAMPLE.message) == 2


def test_journal_only_when_stderr_is_the_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    assert not journal.stderr_is_journal()
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    assert not journal.stderr_is_journal()


async def audited(host: Host) -> tuple[Service, journal.Recorder]:
    """A service whose events are recorded from its start (recovery included)."""
    svc = assemble(host.cfg, host.fake, Store(host.cfg.state_file), host.kernel)
    recorder = journal.Recorder()
    svc.engine.audit = recorder
    await svc.start()
    return svc, recorder


def kinds(recorder: journal.Recorder) -> list[tuple[Kind, str]]:
    return [(e.kind, e.allocation) for e in recorder.events]


def test_each_change_is_one_event(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc, rec = await audited(host)
        assert rec.events == []
        await svc.allocate("u1", "1", {}, 1000)
        await svc.allocate("b1", "2", BIND, 1001)
        allocated = rec.events[-1]
        assert allocated.uid == 1001 and allocated.bound and allocated.amount == "2"
        assert allocated.cpus == svc.ledger.allocations["b1"].held.format()
        assert allocated.unit == "cpuservice-bound-b1.slice"
        await svc.resize("b1", "3")
        assert rec.events[-1].cpus == svc.ledger.allocations["b1"].held.format()
        assert rec.events[-1].reason == "from 2 CPUs"
        assert rec.events[-1].message.startswith("allocation b1 resized: uid 1001, 3 bound CPUs")
        scope = await svc.attach("b1", [4242])
        assert dict(rec.events[-1].extra) == {"SCOPE": scope, "PIDS": "4242"}
        await svc.attach("b1", [4243])  # no commit (already populated), still a change
        held = svc.ledger.allocations["b1"].held.format()
        await svc.release("b1")
        assert rec.events[-1].cpus == held and rec.events[-1].reason == "released"
        assert kinds(rec) == [(Kind.ALLOCATED, "u1"), (Kind.ALLOCATED, "b1"),
                              (Kind.RESIZED, "b1"), (Kind.ATTACHED, "b1"),
                              (Kind.ATTACHED, "b1"), (Kind.RELEASED, "b1")]
    run(body)


def test_a_failed_change_is_not_logged(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc, rec = await audited(host)
        await svc.allocate("b1", "2", BIND, 0)
        host.fake.fail_at(1)
        with pytest.raises(CPUServiceError):
            await svc.resize("b1", "4")
        with pytest.raises(CPUServiceError):
            await svc.allocate("b1", "1", {}, 0)  # exists
        assert kinds(rec) == [(Kind.ALLOCATED, "b1")]
    run(body)


def test_repair_restore_and_vanished_units(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        host.fake.units["app.service"] = Unit("app.service", {"CPUWeight": 300})
        svc, rec = await audited(host)
        await svc.allocate("keep", "2", BIND, 1000)
        await svc.allocate("app", "1", {"bind": True, "unit": "app.service"}, 0)
        lost = svc.ledger.allocations["keep"].whole
        host.offline(set(lost))
        await svc.revalidate(full=False)
        repaired = rec.events[-1]
        assert (repaired.kind, repaired.allocation) == (Kind.REPAIRED, "keep")
        assert dict(repaired.extra)["LOST"] == lost.format() and repaired.reason
        del host.fake.units["app.service"]
        await svc.revalidate()
        assert (rec.events[-1].kind, rec.events[-1].reason) == (Kind.RELEASED,
                                                                 "its unit is gone")
        # a restart: every allocation it keeps is restored, once
        again, rec2 = await audited(host)
        assert kinds(rec2) == [(Kind.RESTORED, "keep")]
        assert dict(rec2.events[0].extra) == {"SOURCE": "checkpoint"}
        assert rec2.events[0].cpus == again.ledger.allocations["keep"].held.format()
    run(body)


def test_the_man_page_lists_every_message_id() -> None:
    page = (Path(__file__).parents[2] / "docs/man/cpuserviced.8.scd").read_text()
    for kind, message_id in journal.MESSAGE_IDS.items():
        assert re.search(rf"^\*{kind}\* {message_id}\n\t", page, re.M), kind


def test_the_caller_is_named_when_it_is_not_the_owner(tmp_path: Path) -> None:
    async def body() -> None:
        host = Host(tmp_path)
        svc, rec = await audited(host)
        await svc.allocate("a", "1", BIND, 1000)  # no D-Bus caller (as for a hotplug repair)
        assert "CALLER_UID" not in dict(rec.events[-1].extra)
        journal.CALLER.set(1000)
        await svc.resize("a", "2")
        assert dict(rec.events[-1].extra)["CALLER_UID"] == "1000"
        assert ", by uid" not in rec.events[-1].message
        journal.CALLER.set(0)  # root releases alice's allocation
        await svc.release("a")
        assert rec.events[-1].fields()["CPUSERVICE_CALLER_UID"] == "0"
        assert rec.events[-1].message.endswith("unit cpuservice-bound-a.slice, by uid 0 "
                                               "(released)")
    run(body)


def test_the_catalog_explains_every_message_id() -> None:
    text = (Path(__file__).parents[2] / "systemd/cpuservice.catalog").read_text()
    ids = re.findall(r"^-- ([0-9a-f]{32})$", text, re.M)
    assert ids == list(journal.MESSAGE_IDS.values())
    assert "Subject:" in text and text.count("Defined-By: cpuservice") == len(ids)
