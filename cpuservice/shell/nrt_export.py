"""The machine as a NodeResourceTopology object (cpuservice.model.nrt), kept until the state, the
topology or the name asked for changes: ExportNodeResourceTopology is an unauthenticated read and
must stay cheap when asked again and again."""

from __future__ import annotations

import socket
from typing import Any

from cpuservice.model import nrt
from cpuservice.model.request import Options
from cpuservice.shell.engine import Snapshot


class NrtExport:
    def __init__(self, defaults: Options) -> None:
        self.defaults = defaults
        self.roots: dict[str, str] = {}  # PCI address -> PCIe root (the service's start)
        self._last: tuple[tuple[object, ...], dict[str, Any]] | None = None

    def __call__(self, snap: Snapshot, node_name: str = "") -> dict[str, Any]:
        """``snap`` exported as ``node_name`` (empty: this host's name); InvalidArgument for a
        bad name."""
        name = node_name or nrt.default_node_name(socket.gethostname())
        last = self._last
        if (last is not None and last[0][:2] == (name, snap.generation)
                and last[0][2] is snap.state and last[0][3] is snap.topology):
            return last[1]
        out = nrt.export(snap.topology, snap.state.ledger, name, snap.generation, self.defaults,
                         snap.capabilities.devices, self.roots)
        self._last = ((name, snap.generation, snap.state, snap.topology), out)
        return out
