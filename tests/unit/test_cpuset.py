from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpuservice.cpuset import MAX_CPU_ID, CPUSet, CPUSetError


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
        ("", []),
        ("5\n", [5]),
        ("0-0", [0]),
        (" 1,3 ", [1, 3]),
    ],
)
def test_parse(text: str, ids: list[int]) -> None:
    assert list(CPUSet.parse(text)) == ids


@pytest.mark.parametrize(
    ("text", "named"),
    [("3-1", "3-1"), ("a", "'a'"), ("1,,2", "empty"), ("-1", "''"), ("99999", "99999"),
     ("1-", "''"), ("1.5", "1.5"), ("\u0661", "\u0661"), ("0x3", "0x3"), ("+1", "+1")],
)
def test_parse_rejects_garbage_naming_the_part(text: str, named: str) -> None:
    with pytest.raises(CPUSetError) as info:
        CPUSet.parse(text)
    assert named in str(info.value)


def test_format_collapses_ranges() -> None:
    assert CPUSet([11, 0, 1, 2, 3, 8, 10]).format() == "0-3,8,10-11"
    assert str(CPUSet()) == ""


def test_mask_matches_systemd_layout() -> None:
    assert CPUSet.parse("0-3,8").to_mask() == b"\x0f\x01"
    assert CPUSet.from_mask(b"\x0f\x01") == CPUSet.parse("0-3,8")
    assert CPUSet().to_mask() == b""
    assert CPUSet.parse("15").to_mask() == b"\x00\x80"


def test_algebra() -> None:
    a, b = CPUSet.parse("0-5"), CPUSet.parse("4-7")
    assert (a | b) == CPUSet.parse("0-7")
    assert (a & b) == CPUSet.parse("4-5")
    assert (a - b) == CPUSet.parse("0-3")
    assert CPUSet.parse("1-2") <= a and not a.isdisjoint(b)
    assert CPUSet.union_all([a, b, CPUSet([9])]) == CPUSet.parse("0-7,9")
    assert hash(CPUSet([1, 2])) == hash(CPUSet.parse("1-2"))


def test_out_of_range_ids() -> None:
    with pytest.raises(CPUSetError):
        CPUSet([MAX_CPU_ID + 1])
    with pytest.raises(CPUSetError):
        CPUSet([-1])
    with pytest.raises(CPUSetError):
        CPUSet.from_mask(b"\xff" * 2000)


@given(st.frozensets(st.integers(0, 2048)))
def test_roundtrips(ids: frozenset[int]) -> None:
    s = CPUSet(ids)
    assert CPUSet.parse(s.format()) == s
    assert CPUSet.from_mask(s.to_mask()) == s
    assert CPUSet.parse(s.format() + "\n") == s
