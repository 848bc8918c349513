"""An immutable set of CPU (or NUMA node) ids.

Speaks the Linux cpu-list format (``"0-3,8,10-11"``) and systemd's ``AllowedCPUs`` byte mask
(byte ``c // 8``, bit ``c % 8``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Final

MAX_CPU_ID = 8191  # the kernel's largest NR_CPUS

MAX_TEXT = 32768
"""Longest cpu-list string parse() accepts, in characters (whitespace included). The longest
canonical list of ids 0..MAX_CPU_ID (what format() and the kernel write; pairs such as
``1000-1001,1003-1004``) has 26,568 characters, so every list either writes parses, while a
caller's string costs at most this much work (parsing is linear in the text plus the result)."""


class CPUSetError(ValueError):
    """A cpu-list string or mask that cannot be parsed; the message names the bad part."""


def _show(text: str, limit: int = 40) -> str:
    """repr() of a piece of a caller's text, shortened so that errors stay readable."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def _parse_id(text: str, part: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise CPUSetError(f"bad CPU id {_show(text)} in {_show(part)}")
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(MAX_CPU_ID)):  # and int() refuses thousands of digits
        raise CPUSetError(f"CPU id {_show(text)} in {_show(part)} is larger than {MAX_CPU_ID}")
    value = int(digits)
    if value > MAX_CPU_ID:
        raise CPUSetError(f"CPU id {value} in {_show(part)} is larger than {MAX_CPU_ID}")
    return value


# the bits set in each byte value: masks are decoded a byte at a time
_BITS: tuple[tuple[int, ...], ...] = tuple(tuple(b for b in range(8) if v >> b & 1)
                                           for v in range(256))
# masks decoded lately (systemd's and the plans' masks repeat: every change compares the
# shared pool's holders' masks), at most _DECODED_MAX
_decoded: dict[bytes, CPUSet] = {}
_DECODED_MAX = 512


class CPUSet:
    """Sorted, hashable, immutable set of non-negative ids with set algebra."""

    __slots__ = ("_mask", "_sorted", "_text", "ids")
    # the ids as a frozenset: a slot rather than a property (read on every change, a call each);
    # Final, so that mypy refuses any assignment but the two below
    ids: Final[frozenset[int]]

    def __init__(self, ids: Iterable[int] = ()) -> None:
        frozen = frozenset(ids)
        for cpu in frozen:
            if not isinstance(cpu, int) or cpu < 0 or cpu > MAX_CPU_ID:
                raise CPUSetError(f"CPU id {cpu!r} is out of range 0..{MAX_CPU_ID}")
        self.ids = frozen
        self._sorted: tuple[int, ...] | None = None
        self._text: str | None = None
        self._mask: bytes | None = None

    @classmethod
    def _trusted(cls, ids: frozenset[int]) -> CPUSet:
        """Wrap ids that are already known to be valid (results of set algebra)."""
        new = cls.__new__(cls)
        new.ids = ids  # type: ignore[misc]  # a new object's only assignment (Final)
        new._sorted = None
        new._text = None
        new._mask = None
        return new

    @classmethod
    def parse(cls, text: str) -> CPUSet:
        """Parse the Linux cpu-list format; ``""`` and a trailing newline are accepted.

        At most MAX_TEXT characters. The ranges are merged before they are expanded, so the
        cost is linear in the text plus the result (``0-8191`` repeated expands once).
        """
        if len(text) > MAX_TEXT:
            raise CPUSetError(
                f"cpu list of {len(text)} characters is longer than the {MAX_TEXT} allowed "
                "(write runs of CPUs as ranges: 0-7,16-23)"
            )
        body = text.strip()
        if not body:
            return EMPTY
        ranges: list[tuple[int, int]] = []
        for part in body.split(","):
            if not part:
                raise CPUSetError(f"empty element in cpu list {_show(body)}")
            first, sep, last = part.partition("-")
            low = _parse_id(first, part)
            high = _parse_id(last, part) if sep else low
            if high < low:
                raise CPUSetError(f"descending range {_show(part)}")
            ranges.append((low, high))
        ranges.sort()
        merged: list[tuple[int, int]] = []
        for low, high in ranges:
            if merged and low <= merged[-1][1] + 1:
                if high > merged[-1][1]:
                    merged[-1] = (merged[-1][0], high)
            else:
                merged.append((low, high))
        return cls._trusted(frozenset(chain.from_iterable(range(lo, hi + 1) for lo, hi in merged)))

    @classmethod
    def from_mask(cls, mask: bytes) -> CPUSet:
        """Decode systemd's little-endian byte mask."""
        if len(mask) > (MAX_CPU_ID + 1) // 8:
            raise CPUSetError(f"mask of {len(mask)} bytes is larger than {MAX_CPU_ID + 1} CPUs")
        key = bytes(mask)
        out = _decoded.get(key)
        if out is None:
            bits = _BITS
            out = cls._trusted(frozenset([i * 8 + bit for i, byte in enumerate(key) if byte
                                          for bit in bits[byte]]))
            if len(_decoded) >= _DECODED_MAX:
                _decoded.clear()
            _decoded[key] = out
            out._mask = key.rstrip(b"\0")
        return out

    def to_mask(self) -> bytes:
        """Encode as systemd's little-endian byte mask (empty set -> empty bytes; computed
        once)."""
        if self._mask is None:
            out = bytearray(max(self.ids) // 8 + 1 if self.ids else 0)
            for cpu in self.ids:
                out[cpu // 8] |= 1 << (cpu % 8)
            self._mask = bytes(out)
        return self._mask

    def format(self) -> str:
        """The canonical cpu-list string, ranges collapsed (computed once)."""
        if self._text is None:
            self._text = self._format()
        return self._text

    def _format(self) -> str:
        parts: list[str] = []
        ids = self.sorted()
        i = 0
        while i < len(ids):
            j = i
            while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                j += 1
            parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
            i = j + 1
        return ",".join(parts)

    def sorted(self) -> tuple[int, ...]:
        if self._sorted is None:
            self._sorted = tuple(sorted(self.ids))
        return self._sorted

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"CPUSet({self.format()!r})"

    def __iter__(self) -> Iterator[int]:
        return iter(self.sorted())

    def __len__(self) -> int:
        return len(self.ids)

    def __bool__(self) -> bool:
        return bool(self.ids)

    def __contains__(self, cpu: object) -> bool:
        return cpu in self.ids

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CPUSet) and self.ids == other.ids

    def __hash__(self) -> int:
        return hash(self.ids)

    def __or__(self, other: CPUSet) -> CPUSet:
        return CPUSet._trusted(self.ids | other.ids)

    def __and__(self, other: CPUSet) -> CPUSet:
        return CPUSet._trusted(self.ids & other.ids)

    def __sub__(self, other: CPUSet) -> CPUSet:
        return CPUSet._trusted(self.ids - other.ids)

    def __le__(self, other: CPUSet) -> bool:
        return self.ids <= other.ids

    def __ge__(self, other: CPUSet) -> bool:
        return self.ids >= other.ids

    def isdisjoint(self, other: CPUSet) -> bool:
        return self.ids.isdisjoint(other.ids)

    @staticmethod
    def union_all(sets: Iterable[CPUSet]) -> CPUSet:
        """Union of any number of sets."""
        return CPUSet._trusted(frozenset().union(*(s.ids for s in sets)))

    def first(self) -> int:
        """The smallest id; the set must not be empty."""
        return self.sorted()[0]


EMPTY = CPUSet._trusted(frozenset())
