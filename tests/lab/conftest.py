"""The VM lab: availability check (a skipped tier fails under CI=true)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import unavailable
from tests.envs import lab


def lab_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the VM lab needs root (debootstrap, chroot)"
    for tool in ("qemu-system-x86_64", "debootstrap", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-deps.sh lab)"
    try:
        lab.kernel()
    except lab.LabError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def lab_ready() -> None:
    reason = lab_unavailable_reason()
    if reason:
        unavailable(reason)
