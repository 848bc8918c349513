"""The test environments read the machine they run on: the Debian archive its apt uses (the VM
lab's images come from it, whichever release the machine runs) and its cgroup layout (the
container host's leftover checks, hybrid or pure cgroup v2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.envs import lab
from tests.envs.container import _own_cgroup_dirs, cgroup_roots

BOOKWORM_SOURCES = """Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
"""
TRIXIE_SOURCES = """Types: deb deb-src
URIs: http://security.debian.org/debian-security
Suites: trixie-security
Components: main

Types: deb
URIs: https://mirror.example.org/debian/
Suites: trixie trixie-updates
Components: main non-free-firmware
"""
OTHER = """Types: deb
URIs: https://deb.nodesource.com/node_20.x
Suites: nodistro
Components: main
"""


def apt(tmp_path: Path, sources: dict[str, str]) -> Path:
    (tmp_path / "sources.list.d").mkdir()
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("sources,codename,expected", [
    ({"sources.list.d/debian.sources": BOOKWORM_SOURCES}, "bookworm",
     "http://deb.debian.org/debian"),
    # Debian 13: its own archive, not the security one listed first
    ({"sources.list.d/debian.sources": TRIXIE_SOURCES}, "trixie",
     "https://mirror.example.org/debian/"),
    ({"sources.list.d/a.sources": OTHER, "sources.list.d/debian.sources": TRIXIE_SOURCES},
     "trixie", "https://mirror.example.org/debian/"),
    # one-line sources
    ({"sources.list": "deb [arch=amd64] http://ftp.de.debian.org/debian trixie main\n"
                      "deb http://security.debian.org/debian-security trixie-security main\n"},
     "trixie", "http://ftp.de.debian.org/debian"),
    # a release the project has not heard of yet, by the machine's own codename
    ({"sources.list.d/debian.sources": TRIXIE_SOURCES.replace("trixie", "forky")}, "forky",
     "https://mirror.example.org/debian/"),
    # sid: no codename of its own in os-release
    ({"sources.list": "deb http://deb.debian.org/debian sid main\n"}, "",
     "http://deb.debian.org/debian"),
])
def test_the_lab_takes_the_debian_archive_the_machine_uses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sources: dict[str, str], codename: str,
        expected: str) -> None:
    """Debian 12 only, before: "no bookworm archive found in this machine's apt sources"."""
    monkeypatch.delenv("CPUSERVICE_MIRROR", raising=False)
    assert lab.mirror(apt(tmp_path, sources), codename) == expected


def test_no_debian_archive_is_a_named_error(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CPUSERVICE_MIRROR", raising=False)
    security = "deb http://security.debian.org/debian-security trixie-security main\n"
    with pytest.raises(lab.LabError, match=r"no Debian archive.*CPUSERVICE_MIRROR"):
        lab.mirror(apt(tmp_path, {"sources.list.d/a.sources": OTHER, "sources.list": security}),
                   "trixie")
    monkeypatch.setenv("CPUSERVICE_MIRROR", "http://local/debian")
    assert lab.mirror(tmp_path, "trixie") == "http://local/debian"


def test_guest_releases_are_explicit() -> None:
    assert (lab.BOOKWORM.suite, lab.TRIXIE.suite, lab.SID.suite) == ("bookworm", "trixie", "sid")
    assert lab.PODMAN.suite == "bookworm"


HYBRID_MOUNTINFO = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
33 31 0:28 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup \
rw,xattr,name=systemd
36 31 0:31 / /sys/fs/cgroup/cpuset rw,nosuid,nodev,noexec shared:15 - cgroup cgroup rw,cpuset
"""
HYBRID_CGROUP = """12:cpuset:/
1:name=systemd:/user.slice/session-3.scope
0::/user.slice/session-3.scope
"""
V2_MOUNTINFO = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:8 - cgroup2 cgroup2 \
rw,nsdelegate,memory_recursiveprot
"""
V2_CGROUP = "0::/system.slice/ci-runner.service\n"


def test_the_container_host_finds_its_cgroups_hybrid_or_pure_v2() -> None:
    """Before, the hybrid layout was assumed (/sys/fs/cgroup/unified and .../systemd): on a pure
    cgroup v2 host the leftover checks saw no cgroup at all, and so no leftovers."""
    assert cgroup_roots(HYBRID_MOUNTINFO) == {
        "": (Path("/sys/fs/cgroup/unified"), "/"),
        "name=systemd": (Path("/sys/fs/cgroup/systemd"), "/")}
    assert _own_cgroup_dirs(HYBRID_CGROUP, HYBRID_MOUNTINFO) == [
        Path("/sys/fs/cgroup/systemd/user.slice/session-3.scope"),
        Path("/sys/fs/cgroup/unified/user.slice/session-3.scope")]
    assert cgroup_roots(V2_MOUNTINFO) == {"": (Path("/sys/fs/cgroup"), "/")}
    assert _own_cgroup_dirs(V2_CGROUP, V2_MOUNTINFO) == [
        Path("/sys/fs/cgroup/system.slice/ci-runner.service")]


def test_a_cgroup_mounted_below_its_root_maps_paths_under_it() -> None:
    """In a container, cgroupfs may be mounted at a sub-cgroup: /proc/self/cgroup paths are
    below that one, or not visible at all."""
    mountinfo = ("40 30 0:24 /machine.slice/ct /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
                 "41 30 0:50 / /mnt/with\\040space rw - cgroup cgroup rw,name=systemd\n")
    cgroup = "1:name=systemd:/a\n0::/machine.slice/ct/payload\n"
    assert _own_cgroup_dirs(cgroup, mountinfo) == [Path("/mnt/with space/a"),
                                                   Path("/sys/fs/cgroup/payload")]
    assert _own_cgroup_dirs("0::/elsewhere\n", mountinfo) == []
