"""Metrics through the real prometheus-node-exporter on the lab's VM: scraped on the loopback
address, they show the pools and follow an allocation and its release
(tests/lab/scenarios/metrics.py). In a whole lab run the scenario is part of the main boot;
run alone, this module boots just the service's installation and the scenario."""

from __future__ import annotations

import pytest

from tests.envs import lab
from tests.lab.conftest import main_scenario


@pytest.fixture(scope="module")
def metrics(lab_ready: None) -> lab.Result:
    return main_scenario("metrics")


def rows(result: lab.Result) -> dict[str, dict]:  # type: ignore[type-arg]
    return result.checks()


def test_node_exporter_shows_the_metrics_and_they_follow_an_allocation(
        metrics: lab.Result) -> None:
    assert metrics.status == 0, metrics.output
    found = rows(metrics)
    scraped, allocated, released = found["scraped"], found["allocated"], found["released"]
    print(f"\nmetrics file followed an allocation in {allocated['written_s']} s, the "
          f"exporter's scrape in {allocated['followed_s']} s")
    assert scraped["textfile_error"] == 0
    assert {"cpuservice_info", "cpuservice_pool_cpus", "cpuservice_allocations",
            "cpuservice_repairs_total", "cpuservice_repair_duration_seconds_bucket"} <= set(
        scraped["families"])
    assert allocated["written_s"] < 2
    assert allocated["shared"] == scraped["shared"] - 2 and allocated["info"]
    assert allocated["allocate_ok"] >= 1
    assert released["shared"] == scraped["shared"] and released["release_ok"] >= 1
    assert found["stopped"]["file_left"] is False
