"""One typed vocabulary for the placement options: StrEnums the parser validates against (the
same on pydantic 1.10 and 2.x), that the CLI and the docs can import."""

from __future__ import annotations

import ast
import inspect
from enum import StrEnum

import pytest

from cpuservice.model import compat
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.request import (
    OPTION_KEYS,
    Exclusive,
    Lifetime,
    NumaAlignment,
    NumaStrategy,
    Options,
    Partition,
    Policy,
    parse_options,
)
from cpuservice.placement import repair

VOCABULARY: dict[str, type[StrEnum]] = {
    "policy": Policy, "exclusive": Exclusive, "numa-strategy": NumaStrategy,
    "numa-alignment": NumaAlignment, "lifetime": Lifetime, "partition": Partition,
}


def test_every_choice_option_has_its_enum() -> None:
    assert set(VOCABULARY) <= set(OPTION_KEYS)
    assert [p.value for p in Policy] == ["packed", "full-pcpus", "spread-pcpus"]
    assert [p.value for p in Partition] == ["none", "root", "isolated"]
    defaults = compat.dump(Options())
    assert defaults["partition"] == Partition.NONE == "none"
    assert defaults["policy"] == "packed" and defaults["lifetime"] == "persistent"


@pytest.mark.parametrize("key", sorted(VOCABULARY))
def test_values_parse_into_the_enum_and_bad_ones_list_the_allowed(key: str) -> None:
    enum = VOCABULARY[key]
    for member in enum:
        value = getattr(parse_options({key: member.value}), OPTION_KEYS[key])
        assert value is member and isinstance(value, str) and value == member.value
    with pytest.raises(InvalidArgument) as exc:
        parse_options({key: "bogus"})
    message = str(exc.value)
    assert message.startswith(f"bad option {OPTION_KEYS[key]}") or key in message
    for member in enum:
        assert f"'{member.value}'" in message, message


def test_wrong_types_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="partition"):
        parse_options({"partition": 1})


def test_repair_uses_only_public_placement_functions() -> None:
    tree = ast.parse(inspect.getsource(repair))
    names = [alias.name for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.module == "cpuservice.placement"
             for alias in node.names]
    assert names and not [n for n in names if n.startswith("_")]
