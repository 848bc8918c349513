from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.model.cpuset import MAX_CPU_ID, MAX_TEXT, CPUSet, CPUSetError
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.request import Request
from tests.props import examples


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


@settings(max_examples=examples(100))
@given(st.frozensets(st.integers(0, 2048)))
def test_roundtrips(ids: frozenset[int]) -> None:
    s = CPUSet(ids)
    assert CPUSet.parse(s.format()) == s
    assert CPUSet.from_mask(s.to_mask()) == s
    assert CPUSet.parse(s.format() + "\n") == s


@settings(max_examples=examples(100))
@given(st.lists(st.binary(min_size=0, max_size=40), min_size=1, max_size=30))
def test_masks_decode_the_same_from_the_cache(masks: list[bytes]) -> None:
    """from_mask keeps the sets it decoded lately (cpuset._decoded): a mask decodes to the set
    of its bits whether or not it was decoded before, trailing zero bytes or not, and a set's
    mask is the canonical one (no trailing zero byte)."""
    for mask in masks + masks:
        got = CPUSet.from_mask(mask)
        assert got == CPUSet(i * 8 + b for i, byte in enumerate(mask) for b in range(8)
                             if byte >> b & 1)
        assert got.to_mask() == mask.rstrip(b"\0")
        assert CPUSet(got.ids).to_mask() == got.to_mask()


def test_longest_canonical_list_fits_the_limit() -> None:
    """Runs of two (``1000-1001,1003-1004``) make the longest text a set of ids can have."""
    longest = CPUSet(c for c in range(MAX_CPU_ID + 1) if c % 3 != 2)
    assert 26_000 < len(longest.format()) <= MAX_TEXT - 1
    assert CPUSet.parse(longest.format() + "\n") == longest


def test_text_over_the_limit_is_rejected_at_once() -> None:
    text = ",".join(["0-8191"] * (137 * 1024 // 7))  # 137 KiB: took seconds to expand
    start = time.perf_counter()
    with pytest.raises(CPUSetError, match=f"{len(text)} characters .* {MAX_TEXT} allowed"):
        CPUSet.parse(text)
    with pytest.raises(InvalidArgument, match=f"option 'cpuset': .*{MAX_TEXT}"):
        Request.parse("8192", {"bind": True, "cpuset": text})
    assert time.perf_counter() - start < 0.05


def test_long_lists_parse_in_time_linear_in_text_and_result() -> None:
    evens = ",".join(str(c) for c in range(0, MAX_CPU_ID + 1, 2))
    repeated = ",".join(["0-8191"] * (MAX_TEXT // 7))  # each range expanded once, merged
    start = time.perf_counter()
    assert CPUSet.parse(evens) == CPUSet(range(0, MAX_CPU_ID + 1, 2))
    assert len(CPUSet.parse(repeated)) == MAX_CPU_ID + 1
    assert CPUSet.parse("5-9,0-3,2-6,12,11") == CPUSet.parse("0-9,11-12")
    assert time.perf_counter() - start < 0.25  # a few ms; seconds before


def test_mask_and_format_of_every_cpu_are_quick() -> None:
    start = time.perf_counter()
    everything = CPUSet.from_mask(b"\xff" * ((MAX_CPU_ID + 1) // 8))
    assert len(everything) == MAX_CPU_ID + 1
    assert CPUSet(range(0, MAX_CPU_ID + 1, 2)).format().count(",") == 4095
    assert len(everything.to_mask()) == 1024
    assert time.perf_counter() - start < 0.25


def test_huge_ids_are_errors_not_crashes() -> None:
    assert CPUSet.parse("0" * 5000 + "7") == CPUSet([7])
    with pytest.raises(CPUSetError, match="larger than") as info:
        CPUSet.parse("1-" + "9" * 5000)  # int() refuses that many digits
    assert len(str(info.value)) < 200
    with pytest.raises(CPUSetError, match="bad CPU id") as info:
        CPUSet.parse("x" * 10_000)
    assert len(str(info.value)) < 200
