from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from cpuservice.model import config
from cpuservice.model.cpuset import CPUSet


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


def layered(tmp_path: Path) -> list[Path]:
    """The four directories of config.DIRS under tmp_path, highest priority first."""
    dirs = [tmp_path / d for d in ("etc", "run", "usr-local-lib", "usr-lib")]
    for d in dirs:
        (d / "cpuservice.toml.d").mkdir(parents=True)
    return dirs


def test_the_main_file_of_the_highest_directory_masks_the_others(tmp_path: Path) -> None:
    etc, run, _, lib = layered(tmp_path)
    (lib / "cpuservice.toml").write_text("granularity = 1000\nmin_shared_cpus = 2\n")
    assert config.load(dirs=[etc, run, lib]).min_shared_cpus == 2
    (run / "cpuservice.toml").write_text("min_shared_cpus = 3\n")
    cfg = config.load(dirs=[etc, run, lib])
    assert (cfg.min_shared_cpus, cfg.granularity) == (3, 100)  # /usr/lib's file is not read
    (etc / "cpuservice.toml").write_text("")
    assert config.load(dirs=[etc, run, lib]).min_shared_cpus == 1


def test_dropins_sort_by_name_across_directories(tmp_path: Path) -> None:
    etc, run, local, lib = layered(tmp_path)
    (lib / "cpuservice.toml.d/10-vendor.toml").write_text(
        'reserved_cpus = "0"\ngranularity = 1000\n')
    (etc / "cpuservice.toml.d/20-local.conf").write_text('reserved_cpus = "0-1"\n')
    (run / "cpuservice.toml.d/30-run.toml").write_text("min_shared_cpus = 4\n")
    (local / "cpuservice.toml.d/05-early.toml").write_text("min_shared_cpus = 9\n")
    (etc / "cpuservice.toml.d/README").write_text("not a drop-in")
    cfg = config.load(dirs=[etc, run, local, lib])
    assert cfg.reserved == CPUSet.parse("0-1") and cfg.granularity == 1000
    assert cfg.min_shared_cpus == 4  # 30-run.toml sorts after 05-early.toml
    assert [p.name for p in config.sources(dirs=[etc, run, local, lib])] == [
        "05-early.toml", "10-vendor.toml", "20-local.conf", "30-run.toml"]


def test_a_same_named_dropin_masks_the_lower_one(tmp_path: Path) -> None:
    etc, run, _, lib = layered(tmp_path)
    (lib / "cpuservice.toml.d/50-x.toml").write_text("min_shared_cpus = 5\n")
    (run / "cpuservice.toml.d/50-x.toml").write_text("min_shared_cpus = 6\n")
    assert config.load(dirs=[etc, run, lib]).min_shared_cpus == 6
    (etc / "cpuservice.toml.d/50-x.toml").symlink_to("/dev/null")  # masked: nothing
    assert config.load(dirs=[etc, run, lib]).min_shared_cpus == 1
    assert config.sources(dirs=[etc, run, lib]) == [etc / "cpuservice.toml.d/50-x.toml"]


def test_an_explicit_path_reads_just_it(tmp_path: Path) -> None:
    etc, run, _, lib = layered(tmp_path)
    (etc / "cpuservice.toml.d/50-x.toml").write_text("min_shared_cpus = 5\n")
    own = tmp_path / "own.toml"
    own.write_text("min_shared_cpus = 2\n")
    assert config.load(own, dirs=[etc, run, lib]).min_shared_cpus == 2


def test_a_dropin_error_names_the_dropin(tmp_path: Path) -> None:
    etc, run, _, lib = layered(tmp_path)
    (etc / "cpuservice.toml").write_text("min_shared_cpus = 2\n")
    bad = lib / "cpuservice.toml.d/40-bad.toml"
    bad.write_text("granularity = 7\n")
    with pytest.raises(config.ConfigError, match=rf"^{bad}: granularity"):
        config.load(dirs=[etc, run, lib])
    bad.write_text("granularity = \n")
    with pytest.raises(config.ConfigError, match=rf"^{bad}: "):
        config.load(dirs=[etc, run, lib])


@pytest.mark.parametrize("value", ["cpuservice.prom", "/var/lib/x/cpuservice.txt", 1])
def test_metrics_file_must_be_a_prom_path(tmp_path: Path, value: object) -> None:
    with pytest.raises(config.ConfigError, match="metrics_file"):
        config.validate({"metrics_file": value})


HARMFUL = ["/etc/cron.d/cpuservice", "/usr/lib/cpuservice/x", "/boot/x", "/proc/sys/x",
           "/sys/kernel/x", "/dev/x", "/sbin/x", "/lib/x"]


@pytest.mark.parametrize("place", HARMFUL)
@pytest.mark.parametrize("key", ["metrics_file", "state_file"])
def test_a_path_where_a_write_harms_the_host_is_refused(key: str, place: str) -> None:
    """Issue 37: metrics_file could point into /etc/cron.d and the daemon wrote it; so could
    state_file (and the files it keeps beside it). Refused under the system's directories,
    in one line naming the key, the directory and a path that works."""
    value = f"{place}.prom" if key == "metrics_file" else place
    with pytest.raises(config.ConfigError) as caught:
        config.validate({key: value})
    text = str(caught.value)
    top = "/" + place.split("/")[1]
    assert text == (f"config: {key}: {value!r} is under {top}, where a file the daemon writes "
                    f"can harm the host; use a path under /var/lib (e.g. "
                    f"{getattr(config.Config(), key)})")
    assert Path(top) in config.SYSTEM_DIRS and "\n" not in text


@pytest.mark.parametrize("key", ["metrics_file", "state_file"])
def test_a_link_into_the_system_is_refused_too(tmp_path: Path, key: str) -> None:
    (tmp_path / "lib").symlink_to("/etc")
    value = str(tmp_path / "lib" / "cron.d" / "cpuservice.prom")
    with pytest.raises(config.ConfigError, match=rf"^config: {key}: .* is under /etc \(its "
                       r"links lead to /etc/cron.d/cpuservice.prom\), where a file"):
        config.validate({key: value})
    with pytest.raises(config.ConfigError, match=r"metrics_file: .* \(without \.\.\)"):
        config.validate({"metrics_file": "/var/lib/../../etc/cron.d/x.prom"})
    assert config.validate({key: str(tmp_path / "var" / "cpuservice.prom")})


def test_metrics_file_can_be_turned_off() -> None:
    assert config.validate({"metrics_file": ""}).metrics_file == ""
    assert config.validate({}).metrics_file.endswith("/node-exporter/cpuservice.prom")


def test_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cpuservice import daemon

    path = tmp_path / "cpuservice.toml"
    path.write_text("min_shared_cpus = 2\n")
    assert daemon.main(["--config", str(path), "--check-config"]) == 0
    assert str(path) in capsys.readouterr().out
    (tmp_path / "cpuservice.toml.d").mkdir()
    bad = tmp_path / "cpuservice.toml.d/10-bad.conf"
    bad.write_text("colour = 1\n")
    assert daemon.main(["--config", str(path), "--check-config"]) == daemon.EXIT_CONFIG == 78
    assert f"{bad}: colour" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "says"), [
    ("state.json", "not an absolute path"),
    ("/var/lib/../tmp/state.json", "not an absolute path"),
    ("/tmp/cpuservice/state.json", "temporary directory"),
    ("/var/tmp/state.json", "temporary directory"),
    ("/dev/shm/state.json", "temporary directory"),
])
def test_a_state_file_that_cannot_work_is_refused(monkeypatch: pytest.MonkeyPatch, value: str,
                                                  says: str) -> None:
    """Issue 25 item 12: --check-config passed a relative state_file, one under /tmp (private
    to the unit and cleaned: the allocations are forgotten at the next restart) and a
    directory; each fails or surprises at run time."""
    monkeypatch.setattr(config, "VOLATILE_DIRS", (Path("/tmp"), Path("/var/tmp"),
                                                  Path("/dev/shm")))
    with pytest.raises(config.ConfigError, match=says):
        config.validate({"state_file": value})


def test_a_state_file_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="is a directory"):
        config.validate({"state_file": str(tmp_path)})
    (tmp_path / "file").write_text("")
    with pytest.raises(config.ConfigError, match="not a directory"):
        config.validate({"state_file": str(tmp_path / "file" / "state.json")})
    assert config.validate({"state_file": str(tmp_path / "state.json")})


@pytest.mark.parametrize("zero", ["0", "0.0", "0.000", "0%", "0.0%", 0])
def test_every_spelling_of_zero_cpus_per_user_means_no_limit(zero: object) -> None:
    """Issue 25 item 12: "0" meant no limit while "0.0" meant zero CPUs."""
    assert config.validate({"max_cpus_per_user": zero}).cpu_limit(16) is None


def test_cpus_per_user_limits_that_cannot_work_are_refused() -> None:
    with pytest.raises(config.ConfigError, match="more than every online CPU"):
        config.validate({"max_cpus_per_user": "150%"})
    assert config.validate({"max_cpus_per_user": "100%"}).cpu_limit(16) == 16
    assert config.validate({"max_cpus_per_user": "2.5"}).cpu_limit(16) == Decimal("2.5")
