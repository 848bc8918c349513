"""A dict whose copy costs what changed since its base, not what it holds (issue 40): the
mappings of every allocation (Ledger.allocations, State.records) are copied on every change, and
at 3,000 allocations those copies, and freeing the copies they replace, were most of what a
bound Allocate costs the daemon more than at none (726,000 more instructions per Allocate, 600,000
of them copying and freeing the two dicts). Pure.

A ``Layered`` is a base dict that no one changes, shared by every copy made from it, and the
changes made since (``_over``: a key's new value, or GONE for a key of the base deleted; ``_tail``:
the keys added after the base, in order). Each copy copies only the changes; once they are
more than ``MAX_CHANGES`` or a share of the base, the copy starts from a base of its own again.

It behaves as the dict would, order included: a key's value set again keeps its place, a key
added (or deleted and added again) goes last (tests/unit/test_layered.py checks it against dict
on any sequence). ``layered`` turns a dict into one only past ``LAYERED_FROM`` keys: below that
a dict's own copy is quicker than the extra step on every lookup."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, MutableMapping, ValuesView
from types import MappingProxyType
from typing import Any, TypeVar

V = TypeVar("V")

LAYERED_FROM = 1024  # keys: below, a dict's copy (at C speed) costs less
MAX_CHANGES = 64  # a copy with more changes than this (and than BASE_SHARE of the base) rebases
BASE_SHARE = 16


class _Gone:
    __slots__ = ()

    def __repr__(self) -> str:
        return "GONE"


GONE: Any = _Gone()
_MISSING: Any = object()


class Layered(MutableMapping[str, V]):
    """A mutable mapping with dict's behaviour whose ``copy`` is cheap (module docstring)."""

    __slots__ = ("_base", "_len", "_over", "_tail")

    def __init__(self, items: Mapping[str, V] | None = None) -> None:
        base = dict(items._items()) if isinstance(items, Layered) else dict(items or {})
        self._base: dict[str, V] = base  # never changed once it is a base
        self._over: dict[str, Any] = {}  # key -> new value, or GONE (a key of the base deleted)
        self._tail: dict[str, None] = {}  # keys added since the base, in order
        self._len = len(base)

    @classmethod
    def owning(cls, base: dict[str, V]) -> Layered[V]:
        """A Layered on ``base`` itself, which no one else may then change."""
        out: Layered[V] = cls.__new__(cls)
        out._base, out._over, out._tail, out._len = base, {}, {}, len(base)
        return out

    def copy(self) -> Layered[V]:
        """A copy to change: shares the base, copies the changes (or rebases, when they are
        many)."""
        if len(self._over) > max(MAX_CHANGES, len(self._base) // BASE_SHARE):
            return Layered.owning(dict(self._items()))
        out: Layered[V] = Layered.__new__(Layered)
        out._base, out._over, out._tail, out._len = (self._base, self._over.copy(),
                                                     self._tail.copy(), self._len)
        return out

    def __getitem__(self, key: str) -> V:
        value = self._over.get(key, _MISSING)
        if value is _MISSING:
            return self._base[key]
        if value is GONE:
            raise KeyError(key)
        return value  # type: ignore[no-any-return]

    def get(self, key: str, default: Any = None) -> Any:
        value = self._over.get(key, _MISSING)
        if value is _MISSING:
            return self._base.get(key, default)
        return default if value is GONE else value

    def __contains__(self, key: object) -> bool:
        value = self._over.get(key, _MISSING)  # type: ignore[call-overload]
        if value is _MISSING:
            return key in self._base
        return value is not GONE

    def __setitem__(self, key: str, value: V) -> None:
        was = self._over.get(key, _MISSING)
        if was is _MISSING:
            if key not in self._base:
                self._tail[key] = None
                self._len += 1
        elif was is GONE:  # a key of the base deleted and added again: it goes last
            self._tail[key] = None
            self._len += 1
        self._over[key] = value

    def __delitem__(self, key: str) -> None:
        was = self._over.get(key, _MISSING)
        if was is GONE or (was is _MISSING and key not in self._base):
            raise KeyError(key)
        self._tail.pop(key, None)
        if key in self._base:
            self._over[key] = GONE
        else:
            del self._over[key]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[str]:
        if not self._over:
            return iter(self._base)
        return self._keys()

    def _keys(self) -> Iterator[str]:
        over, tail = self._over, self._tail
        for key in self._base:
            if key not in over or (over[key] is not GONE and key not in tail):
                yield key
        yield from tail

    def items(self) -> ItemsView[str, V]:
        return _Items(self)

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def _items(self) -> Iterator[tuple[str, V]]:
        over, tail = self._over, self._tail
        if not over:
            yield from self._base.items()
            return
        for key, value in self._base.items():
            new = over.get(key, _MISSING)
            if new is _MISSING:
                yield key, value
            elif new is not GONE and key not in tail:
                yield key, new
        for key in tail:
            yield key, over[key]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return len(self) == len(other) and dict(self._items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]  # (mutable, as dict)

    def __repr__(self) -> str:
        return f"Layered({dict(self._items())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return Layered, (dict(self._items()),)


class _Items(ItemsView[str, V]):
    _mapping: Layered[V]

    def __iter__(self) -> Iterator[tuple[str, V]]:
        return self._mapping._items()


class _Values(ValuesView[V]):
    _mapping: Layered[V]

    def __iter__(self) -> Iterator[V]:
        return (value for _, value in self._mapping._items())


def layered(mapping: Mapping[str, V]) -> MutableMapping[str, V]:
    """A copy of ``mapping`` to change: a Layered's copy, a dict's own copy (dict.copy clones
    the table: dict(m) and {**m} insert every key again once one was deleted), or, past
    LAYERED_FROM keys, a Layered (from then on its copies are). A MappingProxyType copies
    what it wraps."""
    kind = type(mapping)  # exact types first: isinstance of an ABC's subclass asks ABCMeta
    if kind is MappingProxyType or kind is dict:
        out = mapping.copy()  # type: ignore[attr-defined]
    elif isinstance(mapping, Layered):
        return mapping.copy()
    else:
        out = mapping.copy() if isinstance(mapping, (dict, MappingProxyType)) else dict(mapping)
    if type(out) is dict and len(out) >= LAYERED_FROM:
        return Layered.owning(out)
    return out  # type: ignore[no-any-return]
