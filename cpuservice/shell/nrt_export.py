"""The machine as a NodeResourceTopology object (cpuservice.model.nrt), kept until the state, the
topology or the name asked for changes: ExportNodeResourceTopology is an unauthenticated read and
must stay cheap when asked again and again."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from cpuservice.model import nrt
from cpuservice.model.near import Device
from cpuservice.model.request import Options
from cpuservice.shell.engine import Snapshot


class NrtExport:
    def __init__(self, defaults: Options,
                 find_roots: Callable[[tuple[Device, ...]], dict[str, str]] | None = None
                 ) -> None:
        self.defaults = defaults
        # PCI address -> PCIe root of the devices found at startup (Resolver.roots), read once
        self.find_roots = find_roots
        self._roots: tuple[tuple[Device, ...], dict[str, str]] = ((), {})
        self._last: tuple[tuple[object, ...], dict[str, Any]] | None = None

    def __call__(self, snap: Snapshot, node_name: str = "") -> dict[str, Any]:
        """``snap`` exported as ``node_name`` (empty: this host's name); InvalidArgument for a
        bad name."""
        name = node_name or nrt.default_node_name(socket.gethostname())
        last = self._last
        if (last is not None and last[0][:2] == (name, snap.generation)
                and last[0][2] is snap.state and last[0][3] is snap.topology):
            return last[1]
        devices = snap.capabilities.devices
        if devices is not self._roots[0] and self.find_roots is not None:
            self._roots = (devices, self.find_roots(devices))
        out = nrt.export(snap.topology, snap.state.ledger, name, snap.generation, self.defaults,
                         devices, self._roots[1])
        self._last = ((name, snap.generation, snap.state, snap.topology), out)
        return out
