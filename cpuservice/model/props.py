"""A unit's properties as systemd's D-Bus API takes them (SetUnitProperties,
StartTransientUnit): name -> (D-Bus signature, value). The one home of this vocabulary: the
systemd adapter, the reconcile transaction, the unit builders and the kernel adapter share it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Props = Mapping[str, tuple[str, Any]]
