"""Man pages build from their scdoc sources; the bash completion parses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import unavailable

ROOT = Path(__file__).parents[2]
PAGES = ["cpuservicectl.1", "cpuservice-run.1", "cpuserviced.8", "cpuservice.toml.5"]


@pytest.mark.parametrize("page", PAGES)
def test_man_page_builds(page: str) -> None:
    if shutil.which("scdoc") is None:
        unavailable("scdoc is not installed (scripts/install-deps.sh unit)")
    source = (ROOT / f"docs/man/{page}.scd").read_text()
    out = subprocess.run(["scdoc"], input=source, capture_output=True, text=True, check=True)
    name, section = page.rsplit(".", 1)
    assert f'.TH "{name}" "{section}"' in out.stdout


def test_completion_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "scripts/completion/cpuservicectl")], check=True)
