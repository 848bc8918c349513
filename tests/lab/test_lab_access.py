"""polkit with a real unprivileged user (alice) against cpuserviced in the VM lab, via busctl."""

from __future__ import annotations

import pytest

from tests.envs import lab

RULE = """polkit.addRule(function(action, subject) {
    if (action.id == "org.cpuservice1.allocate" && subject.user == "alice") {
        return polkit.Result.YES;
    }
});"""
SCENARIO = f"""
bash /payload/scripts/install.sh >/dev/null
M="org.cpuservice1 /org/cpuservice1 org.cpuservice1.Manager"
as_alice() {{ runuser -u alice -- busctl "$@"; echo "status $?"; }}
busctl call $M Allocate 'ssa{{sv}}' rootalloc 1 1 bind b true
echo "== reads"
as_alice get-property $M SharedCPUs
as_alice call $M ListAllocations
echo "== denied"
as_alice call $M Allocate 'ssa{{sv}}' alicealloc 1 1 bind b true
echo "== granted"
printf '%s\\n' '{RULE}' > /etc/polkit-1/rules.d/50-alice.rules
systemctl restart polkit
as_alice call $M Allocate 'ssa{{sv}}' alicealloc 1 1 bind b true
as_alice get-property org.cpuservice1 /org/cpuservice1/allocation/alicealloc \\
    org.cpuservice1.Allocation Owner
echo "== not root's"
as_alice call $M Release s rootalloc
as_alice call $M Resize ss rootalloc 2
echo "== root releases alice's"
busctl call $M Release s alicealloc; echo "status $?"
busctl call $M ListAllocations
"""


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
def access(lab_ready: None) -> dict[str, str]:
    result = lab.run({"access": SCENARIO}).results["access"]
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
