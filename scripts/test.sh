#!/usr/bin/env bash
# The README's test command: set up everything on a fresh Debian 12 (as root) and run all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh all
bash scripts/setup-venv.sh
exec make test
