#!/usr/bin/env bash
# The development venv: Debian's Python 3.11 with the newest allowed dbus-fast and pydantic 2 from
# PyPI, plus the test and lint tools. (The Debian versions are tested with /usr/bin/python3.)
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
[ -f "$stamp" ] && exit 0
rm -rf .venv
/usr/bin/python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e ".[test,dev]"
touch "$stamp"
