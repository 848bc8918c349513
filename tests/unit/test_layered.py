"""cpuservice.model.layered: a Layered behaves as a dict (content and order) on any sequence of
sets, deletes and copies, every copy keeps what it had when the next one changes, and its copy
costs the changes, not the keys."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuservice.model import layered as layered_mod
from cpuservice.model.layered import Layered, layered
from tests.props import examples

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), KEYS, st.integers(0, 99)),
    st.tuples(st.just("del"), KEYS, st.just(0)),
    st.tuples(st.just("copy"), st.just(""), st.just(0)),  # go on with a copy, keep the old one
), max_size=80)


@contextmanager
def rebasing_after(changes: int) -> Iterator[None]:
    """Copies rebase after so many changes (small, so that sequences cross it often)."""
    was = layered_mod.MAX_CHANGES
    layered_mod.MAX_CHANGES = changes
    try:
        yield
    finally:
        layered_mod.MAX_CHANGES = was


def _same(m: Layered[int], d: dict[str, int]) -> None:
    assert list(m.items()) == list(d.items())
    assert list(m) == list(d) and list(m.values()) == list(d.values())
    assert len(m) == len(d) and m == d and d == m
    for k in (f"k{i}" for i in range(12)):
        assert (k in m) == (k in d) and m.get(k, -1) == d.get(k, -1)


@settings(max_examples=examples(300))
@given(start=st.dictionaries(KEYS, st.integers(0, 99), max_size=8), ops=OPS,
       changes=st.integers(0, 4))
def test_a_layered_behaves_as_a_dict_and_copies_keep_their_content(
        start: dict[str, int], ops: list[tuple[str, str, int]], changes: int) -> None:
    with rebasing_after(changes):
        m, d = Layered(start), dict(start)
        kept: list[tuple[Layered[int], list[tuple[str, int]]]] = []
        for op, key, value in ops:
            if op == "set":
                m[key] = value
                d[key] = value
            elif op == "del":
                if key in d:
                    del m[key]
                    del d[key]
                else:
                    with pytest.raises(KeyError):
                        del m[key]
                    with pytest.raises(KeyError):
                        m[key]
            else:
                kept.append((m, list(d.items())))
                m = m.copy()
            _same(m, d)
        for old, items in kept:  # later changes went to copies only
            assert list(old.items()) == items


def test_a_key_of_the_base_deleted_and_added_again_goes_last() -> None:
    m = Layered({"a": 1, "b": 2, "c": 3})
    del m["a"]
    m["a"] = 4
    m["b"] = 5
    assert list(m.items()) == [("b", 5), ("c", 3), ("a", 4)]
    n = m.copy()
    del n["a"]
    assert list(n.items()) == [("b", 5), ("c", 3)] and list(m) == ["b", "c", "a"]


def test_a_copy_costs_the_changes_not_the_keys() -> None:
    base = {f"k{i}": i for i in range(5000)}
    m = Layered.owning(base)
    for i in range(10):
        m = m.copy()
        m[f"n{i}"] = i
        del m[f"k{i}"]
    assert m._base is base and len(m._over) == 20  # shared, 20 changes carried
    with rebasing_after(4):
        # past the changes allowed (and a sixteenth of the base), a copy has a base of its own
        small = Layered({f"k{i}": i for i in range(32)})
        for i in range(5):
            small[f"n{i}"] = i
        assert small.copy()._base is not small._base and not small.copy()._over


def test_layered_copies_dicts_and_proxies_and_turns_big_ones_into_layered() -> None:
    small = {"a": 1}
    copy = layered(small)
    assert copy == small and copy is not small and type(copy) is dict
    big = {f"k{i}": i for i in range(layered_mod.LAYERED_FROM)}
    proxied = layered(MappingProxyType(big))
    assert isinstance(proxied, Layered) and proxied == big and proxied._base is not big
    proxied["x"] = 1
    assert "x" not in big
    again = layered(MappingProxyType(proxied))  # a proxy of a Layered: its cheap copy
    assert isinstance(again, Layered) and again._base is proxied._base


def test_a_layered_pickles_and_prints_as_its_content() -> None:
    m = Layered({"a": 1})
    m["b"] = 2
    assert pickle.loads(pickle.dumps(m)) == {"a": 1, "b": 2}
    assert repr(m) == "Layered({'a': 1, 'b': 2})"
    with pytest.raises(TypeError):
        hash(m)
