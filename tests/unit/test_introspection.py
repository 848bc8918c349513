"""The shipped introspection data (dbus/org.cpuservice1.xml) names exactly the members the bus
classes have, without a bus: the unit tier's copy of the container host's live check, so that a
new method or property cannot ship undescribed."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from dbus_fast import introspection as intr
from dbus_fast.service import ServiceInterface

from cpuservice.bus.api import Manager
from cpuservice.bus.objects import Allocation

XML = Path(__file__).parents[2] / "dbus/org.cpuservice1.xml"


def members(xml: str) -> dict[str, set[tuple[str, str, str]]]:
    out: dict[str, set[tuple[str, str, str]]] = {}
    for iface in ET.fromstring(xml).iter("interface"):
        name = iface.get("name", "")
        if not name.startswith("org.cpuservice1"):
            continue
        found = out.setdefault(name, set())
        for kind in ("method", "signal", "property"):
            for m in iface.iter(kind):
                sig = m.get("type") or "".join(
                    f"{a.get('direction', 'out')[0]}{a.get('type')}" for a in m.iter("arg"))
                found.add((kind, m.get("name", ""), sig))
    return out


def test_the_shipped_xml_names_every_member() -> None:
    manager = Manager.__new__(Manager)  # no service, no bus: only the class's members
    ServiceInterface.__init__(manager, "org.cpuservice1.Manager")
    allocation = Allocation(None, "x")  # type: ignore[arg-type]
    node = intr.Node("/org/cpuservice1", interfaces=[manager.introspect(),
                                                      allocation.introspect()])
    assert members(node.tostring()) == members(XML.read_text())
    assert ("method", "ExportNodeResourceTopology", "isos") in members(XML.read_text())[
        "org.cpuservice1.Manager"]
