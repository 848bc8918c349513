"""Hypothesis settings for every property test: a fixed, derandomized profile for the gate, a
random one for exploration.

- ``gate`` (the default; the README's test command and ``.ci/run``): ``derandomize=True`` and no
  example database, so every run on every machine draws the same examples. Both unit tiers run
  the same hypothesis release, the distribution's (python3-hypothesis: 6.67.1 on Debian 12,
  6.130.5 on Debian 13; ``scripts/setup-venv.sh`` pins the venv to it), so they draw the same
  examples too. A red gate is a real defect, never a new draw.
- ``explore`` (``make test-explore``, ``CPUSERVICE_HYPOTHESIS=explore``): a fresh seed per run
  (``--hypothesis-seed``, printed by the target), ``CPUSERVICE_EXPLORE_SCALE`` times the
  examples (default 20), no database either. Whatever it finds becomes an explicit, named
  regression test (an ``@example`` or a plain test) before the fix lands; see tests/README.md.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("CPUSERVICE_HYPOTHESIS", "gate")
SCALE = int(os.environ.get("CPUSERVICE_EXPLORE_SCALE", "20")) if PROFILE == "explore" else 1

_COMMON = {
    "database": None,
    "deadline": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
settings.register_profile("gate", derandomize=True, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("explore", derandomize=False, **_COMMON)  # type: ignore[arg-type]
if PROFILE not in ("gate", "explore"):
    raise SystemExit(f"CPUSERVICE_HYPOTHESIS={PROFILE!r}: use gate or explore")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A property test's number of examples: ``n`` in the gate, SCALE times more exploring."""
    return n * SCALE
