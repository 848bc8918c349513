#!/usr/bin/env bash
# The development venv: Debian's Python (3.11 on Debian 12, 3.13 on 13) with the newest allowed
# dbus-fast and pydantic 2 from PyPI, plus the test and lint tools. (The Debian versions are
# tested with /usr/bin/python3.) hypothesis is the distribution's own release (python3-hypothesis),
# so both unit tiers draw the same examples (tests/props.py).
set -euo pipefail
cd "$(dirname "$0")/.."
hypothesis=$(/usr/bin/python3 -c 'import hypothesis; print(hypothesis.__version__)' 2>/dev/null \
             || true)
stamp=.venv/.installed-$( (cat pyproject.toml; echo "$hypothesis") | sha256sum | cut -c1-16)
[ -f "$stamp" ] && exit 0
rm -rf .venv
/usr/bin/python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e ".[test,dev]" \
    ${hypothesis:+"hypothesis==$hypothesis"}
touch "$stamp"
