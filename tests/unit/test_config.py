from __future__ import annotations

from pathlib import Path

import pytest

from cpuservice import config
from cpuservice.cpuset import CPUSet


def test_defaults_when_missing(tmp_path: Path) -> None:
    cfg = config.load(tmp_path / "none.toml")
    assert cfg.sysfs_root == "/sys" and cfg.granularity == 100 and cfg.min_shared_cpus == 1
    assert cfg.state_file == "/var/lib/cpuservice/state.json" and not cfg.confine_host


def test_dropins_override_in_order(tmp_path: Path) -> None:
    main = tmp_path / "cpuservice.toml"
    main.write_text('reserved_cpus = "0"\ngranularity = 1000\n[defaults]\npolicy = "full-pcpus"\n')
    (tmp_path / "cpuservice.toml.d").mkdir()
    (tmp_path / "cpuservice.toml.d/10-a.toml").write_text('reserved_cpus = "0-1"\n')
    (tmp_path / "cpuservice.toml.d/20-b.toml").write_text('[defaults]\nbind = true\n')
    cfg = config.load(main)
    assert cfg.reserved == CPUSet.parse("0-1") and cfg.granularity == 1000
    assert cfg.default_options.policy == "full-pcpus" and cfg.default_options.bind


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("granularity = 10", "granularity"),
        ("min_shared_cpus = -1", "min_shared_cpus"),
        ("min_shared_cpus = 1.5", "min_shared_cpus"),
        ('min_shared_cpus = "2"', "min_shared_cpus"),
        ('reserved_cpus = "3-1"', "reserved_cpus"),
        ("confine_host = 1", "confine_host"),
        ("colour = 1", "colour"),
        ('[defaults]\npolicy = "fast"', "policy"),
        ('[defaults]\ncpuset = "1"', "defaults.cpuset"),
        ("granularity = ", "cpuservice.toml"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "cpuservice.toml"
    path.write_text(text + "\n")
    with pytest.raises(config.ConfigError, match=key.replace(".", r"\.")):
        config.load(path)
