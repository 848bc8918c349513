#!/usr/bin/env bash
# Build (or find cached) both VM lab images: Debian 12 and Debian sid (tests/envs/lab.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD /usr/bin/python3 -m tests.envs.lab build
PYTHONPATH=$PWD /usr/bin/python3 -m tests.envs.lab --sid build
