"""polkit on a terminal, in the VM lab: alice (a login session on a pseudo-terminal, as over
SSH) runs cpuservicectl and cpuservice-run; the polkit text agent they start asks for her
password, she answers and gets her allocation (tests/lab/scenarios/agent.sh and agent.py)."""

from __future__ import annotations

import pytest

from tests.envs import lab
from tests.lab import plan
from tests.lab.conftest import _boot
from tests.lab.test_lab_access import sections

AGENT = lab.Scenario("bash /payload/tests/lab/scenarios/agent.sh", 480, ("install",))


@pytest.fixture(scope="module")
def agent(request: pytest.FixtureRequest, lab_ready: None) -> dict[str, str]:
    """The scenario's sections: from the main boot when tests/lab/plan.py runs it there (as
    "agent", after "install"), else from a boot of its own."""
    if "agent" in plan.MAIN:
        run = request.getfixturevalue("main_boot")
    else:
        run = _boot("agent", {"install": lab.Scenario(plan.INSTALL, 300), "agent": AGENT})
    assert run.results["install"].status == 0, run.results["install"].output
    result = run.results["agent"]
    print(result.output)
    assert result.status == 0, result.output
    return sections(result.output)


def test_alice_is_prompted_answers_and_gets_her_allocation(agent: dict[str, str]) -> None:
    text = agent["prompted"]
    assert "Password:" in text and "AUTHENTICATING FOR org.cpuservice1.allocate" in text, text
    assert "status 0 prompts 1" in text and "agentalloc: 1 CPU(s) bound to" in text, text
    assert "owner u 1000" in text


def test_a_wrong_password_gets_nothing(agent: dict[str, str]) -> None:
    text = agent["wrong password"]
    assert "status 13" in text and "owner none" in text, text


def test_no_ask_password_and_no_terminal_do_not_prompt(agent: dict[str, str]) -> None:
    for case in ("no-ask-password", "not a terminal"):
        text = agent[case]
        assert "prompts 0" in text and "status 13" in text, text
        assert "Traceback" not in text and "cpuservice-group.rules" in text, text


def test_alice_releases_her_own_after_answering(agent: dict[str, str]) -> None:
    text = agent["release own"]
    assert "status 0 prompts 1" in text and "owner none" in text, text


def test_cpuservice_run_prompts_then_runs_the_command(agent: dict[str, str]) -> None:
    text = agent["cpuservice-run"]
    assert "Cpus_allowed_list:" in text and "status 0" in text, text


def test_status_shows_what_systemd_counts(agent: dict[str, str]) -> None:
    import json

    on_terminal, piped = agent["status"], agent["status piped"]
    assert "PAGED:st - 0.5 CPU(s), bound, active" in on_terminal, on_terminal
    assert "PAGED:" not in piped, piped
    assert "Unit: cpuservice-bound-st.slice: active (active)" in piped, piped
    assert "Tasks: 1" in piped and "CPU: " in piped and "Throttled: " in piped, piped
    status = json.loads(piped.splitlines()[-1])
    unit, figures = status["UnitState"], status["Statistics"]
    assert unit["TasksCurrent"] == 1 and unit["CPUUsageNSec"] > 5 * 10**8, unit
    # the kernel's figures, read by the daemon (GetStatistics, issue 39): a real cgroup v2
    assert figures["cpu-throttled-periods"] > 0, figures  # 0.5 CPU: a busy loop is throttled
    assert figures["cpu-usage-usec"] > 5 * 10**5 and figures["unreadable"] == [], figures
    assert "cpu-pressure-some-avg10" in figures and "Pressure: some " in piped, figures
