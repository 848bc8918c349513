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
    Movable,
    NumaAlignment,
    NumaStrategy,
    Options,
    Partition,
    Policy,
    Request,
    parse_options,
)
from cpuservice.placement import repair

VOCABULARY: dict[str, type[StrEnum]] = {
    "policy": Policy, "exclusive": Exclusive, "numa-strategy": NumaStrategy,
    "numa-alignment": NumaAlignment, "lifetime": Lifetime, "partition": Partition,
    "movable": Movable,
}


def test_every_choice_option_has_its_enum() -> None:
    assert set(VOCABULARY) <= set(OPTION_KEYS)
    assert [p.value for p in Policy] == ["packed", "full-pcpus", "spread-pcpus"]
    assert [p.value for p in Partition] == ["none", "root", "isolated"]
    defaults = compat.dump(Options())
    assert defaults["partition"] == Partition.NONE == "none"
    assert defaults["policy"] == "packed" and defaults["lifetime"] == "persistent"
    assert defaults["movable"] == Movable.NO == "no"


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


@pytest.mark.parametrize(("options", "why"), [
    ({"movable": "node"}, "unbound allocation holds no CPUs"),
    ({"movable": "anywhere", "bind": True, "cpuset": "0-1"}, "explicit CPUs"),
    ({"movable": "node", "bind": True, "partition": "isolated"}, "cpuset partition"),
])
def test_movable_is_refused_where_nothing_could_be_moved(options: dict[str, object],
                                                         why: str) -> None:
    """An unbound allocation holds no CPUs, and explicit CPUs and partitions are never moved:
    asking for movable there is an error rather than an option silently ignored."""
    with pytest.raises(InvalidArgument, match=f"option 'movable' .*{why}"):
        Request.parse("2", options)
    assert Request.parse("2", {**options, "movable": "no"}).options.movable == Movable.NO


def test_a_movable_default_that_cannot_apply_is_no() -> None:
    """[defaults] movable = "node" makes bound allocations movable and leaves the others (an
    unbound one, explicit CPUs, a partition) unmovable, as a default partition that cannot
    apply is none; asked for explicitly on such a request, it is refused."""
    defaults = {"movable": "node"}
    assert Request.parse("2", {"bind": True}, defaults).options.movable == Movable.NODE
    for options in ({}, {"bind": True, "cpuset": "0-1"}, {"bind": True, "partition": "root"}):
        assert Request.parse("2", options, defaults).options.movable == Movable.NO
    with pytest.raises(InvalidArgument, match="movable"):
        Request.parse("2", {"movable": "node"}, {"bind": True, "partition": "root"})


def test_an_option_map_validated_before_is_validated_by_its_types_too() -> None:
    """parse_options keeps what it validated: ``bind: 1`` is still refused after ``bind: true``
    was accepted (1 == True in Python), and a default that changed is a different map."""
    assert parse_options({"bind": True}).bind is True
    with pytest.raises(InvalidArgument, match="bind"):
        parse_options({"bind": 1})
    assert parse_options({}, {"policy": "full-pcpus"}).policy == "full-pcpus"
    assert parse_options({}, {"policy": "packed"}).policy == "packed"
