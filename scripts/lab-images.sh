#!/usr/bin/env bash
# Build (or find cached) every VM lab image: Debian 12, Debian 12 with podman, Debian 13 and
# Debian sid (tests/envs/lab.py); and the chroot of each Debian release this machine does not
# run, where the lab builds that guest's package (scripts/test-release.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
for release in bookworm trixie podman sid; do
  PYTHONPATH=$PWD /usr/bin/python3 -m tests.envs.lab "--$release" build
done
codename=$(PYTHONPATH=$PWD /usr/bin/python3 -c 'from tests.envs import lab; print(lab.host_codename())')
for suite in bookworm trixie; do
  [ "$suite" = "$codename" ] || bash scripts/test-release.sh "$suite" --root
done
