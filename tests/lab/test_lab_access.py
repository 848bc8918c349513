"""polkit with a real unprivileged user (alice) against cpuserviced in the VM lab, via busctl."""

from __future__ import annotations

import pytest

from tests.envs import lab


def sections(output: str) -> dict[str, str]:
    out: dict[str, str] = {}
    key = "setup"
    for line in output.splitlines():
        if line.startswith("== "):
            key = line[3:]
        else:
            out[key] = out.get(key, "") + line + "\n"
    return out


@pytest.fixture(scope="module")
def access(main_boot: lab.Run) -> dict[str, str]:
    result = main_boot.results["access"]
    assert result.status == 0, result.output
    return sections(result.output)


def test_reads_work_for_alice(access: dict[str, str]) -> None:
    assert access["reads"].count("status 0") == 2 and '"rootalloc"' in access["reads"]


def test_allocate_is_denied_by_default(access: dict[str, str]) -> None:
    text = access["denied"]
    assert "status 0" not in text
    assert "Access denied" in text or "Interactive authentication required" in text


def test_a_polkit_rule_grants_alice_her_own(access: dict[str, str]) -> None:
    text = access["granted"]
    assert text.count("status 0") == 2 and "u 1000" in text


def test_alice_cannot_touch_roots_allocation(access: dict[str, str]) -> None:
    text = access["not root's"]
    assert "status 0" not in text and text.count("status 1") == 2


def test_root_releases_alices(access: dict[str, str]) -> None:
    text = access["root releases alice's"]
    assert "status 0" in text and "alicealloc" not in text and "rootalloc" in text


def test_alice_attaches_her_own_sessions_process(access: dict[str, str]) -> None:
    text = access["alice attaches her own session's process"]
    assert "user-1000.slice/session-" in text and "status 0" in text, text
    assert "cpuservice-alicealloc-" in text


def test_alice_may_not_move_a_system_services_process(access: dict[str, str]) -> None:
    text = access["alice may not move her process out of a system service"]
    assert "status 0" not in text and ("Access denied" in text or "not authorized" in text
                                       or "authentication" in text), text


def test_hardening_exposure(main_boot: lab.Run) -> None:
    result = main_boot.results["hardening"]
    line = next(x for x in result.output.splitlines() if "Overall exposure level" in x)
    exposure = float(line.split(":")[1].split()[0])
    print(f"\nsystemd-analyze security cpuservice.service (VM lab): {exposure}")
    assert exposure <= 1.3, result.output


def test_a_full_state_disk_loses_nothing_acknowledged(main_boot: lab.Run) -> None:
    result = main_boot.results["fulldisk"]
    assert result.status == 0 and "done" in result.output, result.output
    refused = [x for x in result.output.splitlines() if x.startswith("refused")]
    assert refused and all("cannot write" in x for x in refused), result.output
    assert "active active" in result.output
