"""The Prometheus alert rules shipped with the package (prometheus/cpuservice.rules.yml): valid,
tested with promtool against their own test file, and written against metric names the daemon
really writes (cpuservice.host.metrics.render)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cpuservice.host import figure_metrics, metrics
from cpuservice.model.fixtures import MACHINES
from cpuservice.model.pools import Ledger
from cpuservice.model.state import State
from tests.conftest import unavailable

ROOT = Path(__file__).parents[2]
RULES = ROOT / "prometheus/cpuservice.rules.yml"
TESTS = ROOT / "prometheus/cpuservice.rules.test.yml"
# series the rules read from Prometheus and the node exporter, not from cpuserviced
OTHERS = {"up", "node_systemd_unit_state"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # CI=true makes this a failure: install-deps.sh unit installs it
        unavailable("promtool is not installed (Debian's prometheus package; "
                    "scripts/install-deps.sh unit installs it)")
    assert path
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def test_the_rules_are_valid() -> None:
    out = run("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_test_rules_passes() -> None:
    out = run("test", "rules", str(TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_wrong_rule_fails_the_rule_tests(tmp_path: Path) -> None:
    """The rule tests are strict enough to catch any changed threshold or a wrong metric."""
    rules = RULES.read_text()
    wrongs = [rules[:i] + "> 1" + rules[i + 3:]
              for i in (m.start() for m in re.finditer(r"> 0$", rules, re.M))]
    wrongs += [rules.replace("== 1\n", "== 0\n", 1),
               rules.replace("cpuservice_shared_min_cpus", "cpuservice_min_cpus"),
               rules.replace('state="degraded"', 'state="active"')]
    assert len(wrongs) == 6  # every "> 0" threshold, one "== 1", a name, a label
    shutil.copy(TESTS, tmp_path / TESTS.name)
    for wrong in wrongs:
        assert wrong != rules
        (tmp_path / RULES.name).write_text(wrong)
        out = run("test", "rules", str(tmp_path / TESTS.name))
        assert out.returncode != 0, out.stdout


def test_the_rules_read_what_the_daemon_writes() -> None:
    t = MACHINES["b"].topology()
    counters = metrics.Counters()
    text = metrics.render(t, State(Ledger(t.online), {}), counters, "0.1.0", (True, 1))
    text += figure_metrics.render({}, [])  # each allocation's figures and health (issue 39)
    text += figure_metrics.render_host({}, True)  # the shared pool's, the admission guard
    written = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    expressions = re.findall(r"^\s+expr: (.*)$", RULES.read_text(), re.M)
    read = {name for e in expressions for name in re.findall(r"\b([a-z_]+)\{", e)
            } | {name for e in expressions for name in re.findall(r"\b(cpuservice_\w+)", e)}
    assert read - OTHERS <= written, sorted(read - OTHERS - written)
    assert {"cpuservice_repair_failures_total", "cpuservice_checkpoint_write_failing",
            "cpuservice_shared_min_cpus", "cpuservice_info"} <= read
    # counters are there from the start, so that increase() sees the first failure
    assert 'cpuservice_repair_failures_total{trigger="hotplug"} 0' in text
    assert "cpuservice_checkpoint_write_failures_total 1" in text


def test_the_package_ships_the_rules() -> None:
    install = (ROOT / "debian/cpuservice.install").read_text()
    assert "prometheus/cpuservice.rules.yml usr/share/cpuservice/prometheus/" in install
    assert "prometheus" in (ROOT / "scripts/install-deps.sh").read_text().split("[unit]=")[1] \
        .split("\n")[0]


@pytest.mark.parametrize("trigger", metrics.REPAIRS)
def test_a_failed_repair_is_counted(trigger: str) -> None:
    counters = metrics.Counters()
    seen: list[int] = []
    counters.listeners.append(lambda: seen.append(1))
    counters.repair_failed(trigger)
    t = MACHINES["a"].topology()
    text = metrics.render(t, State(Ledger(t.online), {}), counters, "0.1.0")
    assert f'cpuservice_repair_failures_total{{trigger="{trigger}"}} 1' in text and seen
