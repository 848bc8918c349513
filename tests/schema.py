"""A JSON Schema validator for the subset docs/nrt/*.schema.json uses (Debian 12's
python3-jsonschema is not needed): $ref to #/$defs, type, const, enum, properties, required,
additionalProperties, items, pattern, minLength, maxLength, minimum, maximum. A keyword outside
that subset is an error, so the schema cannot say more than is checked. Shared by the unit tests
and the integration test of a live daemon."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

NRT_SCHEMA = Path(__file__).parents[1] / "docs/nrt/noderesourcetopology-v1alpha2.schema.json"
CHECKED = {"$ref", "type", "const", "enum", "properties", "required", "additionalProperties",
           "items", "pattern", "minLength", "maxLength", "minimum", "maximum"}
NOTES = {"$schema", "$id", "$defs", "title", "description"}
TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,),
                                      "integer": (int,), "number": (int, float),
                                      "boolean": (bool,), "null": (type(None),)}


def load(path: Path = NRT_SCHEMA) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def _is(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, TYPES[kind])


def errors(value: Any, schema: dict[str, Any], root: dict[str, Any] | None = None,
           where: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema``, each with its JSON path (empty: valid)."""
    root = schema if root is None else root
    unknown = set(schema) - CHECKED - NOTES
    if unknown:
        return [f"{where}: schema keyword(s) {sorted(unknown)} not supported by this validator"]
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            return [f"{where}: only #/$defs/ references are supported, not {ref}"]
        return errors(value, root["$defs"][ref.split("/")[-1]], root, where)
    out: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return [f"{where}: {type(value).__name__} {json.dumps(value)[:60]} is not "
                    f"{' or '.join(kinds)}"]
    if "const" in schema and value != schema["const"]:
        out.append(f"{where}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{where}: {value!r} does not match {schema['pattern']}")
        if len(value) < schema.get("minLength", 0):
            out.append(f"{where}: {value!r} is shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{where}: {value!r} is longer than {schema['maxLength']}")
    if _is(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{where}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{where}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: {key!r} is required" for key in schema.get("required", ())
                if key not in value]
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                out += errors(item, props[key], root, f"{where}.{key}")
            elif extra is False:
                out.append(f"{where}: {key!r} is not a field of this type")
            elif isinstance(extra, dict):
                out += errors(item, extra, root, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += errors(item, schema["items"], root, f"{where}[{i}]")
    return out


def nrt_errors(obj: Any) -> list[str]:
    """What is wrong with an exported NodeResourceTopology: the schema, and what the schema
    cannot say (zone names unique, costs and parents naming Node zones)."""
    out = errors(obj, load())
    if out:
        return out
    zones = {z["name"]: z for z in obj["zones"]}
    if len(zones) != len(obj["zones"]):
        out.append("$.zones: zone names repeat")
    nodes = {n for n, z in zones.items() if z["type"] == "Node"}
    for z in obj["zones"]:
        if z["type"] == "Node" and not re.fullmatch(r"node-[0-9]+", z["name"]):
            out.append(f"zone {z['name']}: a Node zone is named node-<N>")
        if z.get("parent") and z["parent"] not in nodes:
            out.append(f"zone {z['name']}: parent {z['parent']} is no Node zone")
        if {c["name"] for c in z.get("costs", [])} - nodes:
            out.append(f"zone {z['name']}: a cost names no Node zone")
    return out
