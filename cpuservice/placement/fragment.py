"""The fragment's choice: which CPU a bound request's fraction takes pieces of, read from a Free
view (choose.take makes it after the whole CPUs). Pure."""


from __future__ import annotations

from collections.abc import Collection, Iterable

from cpuservice.model.errors import InsufficientCPUs
from cpuservice.model.request import NumaAlignment
from cpuservice.placement.free import Free
from cpuservice.placement.pack import pack
from cpuservice.placement.refusals import floor, refusal, shortage

STRICT_ALIGNMENT = (NumaAlignment.RESTRICTED, NumaAlignment.SINGLE_NUMA_NODE)


def take_fragment(free: Free, pieces: int, whole: Collection[int], left: int | None = None
                  ) -> tuple[int, bool]:
    """A CPU with ``pieces`` free pieces near ``whole`` (the allocation's whole CPUs), and
    whether it is fresh (no fragment uses it yet): _take_fragment, with option near only among
    the CPUs next to the devices (required), or there first (preferred, unless the whole CPUs
    are elsewhere already); never on a core kept for others' devices, or (when-full) only when
    no other CPU has room. ``left``: how many more CPUs may leave the shared pool (at 0, a
    fresh CPU only among the free isolated ones; None: as takeable)."""
    try:
        return _near_fragment(free, pieces, whole, free.locked, left)
    except InsufficientCPUs:
        if not (free.soft and free.locked):
            raise
    return _near_fragment(free, pieces, whole, frozenset(), left)


def _near_fragment(free: Free, pieces: int, whole: Collection[int], avoid: frozenset[int],
                   left: int | None) -> tuple[int, bool]:
    if free.near is None:
        return _take_fragment(free, pieces, whole, None, avoid, left)
    if free.near_required or free.near.issuperset(whole):
        try:
            return _take_fragment(free, pieces, whole, free.near, avoid, left)
        except InsufficientCPUs as exc:
            if free.near_required:
                raise InsufficientCPUs(f"{refusal(free)}: {exc}") from None
    return _take_fragment(free, pieces, whole, None, avoid, left)


def _take_fragment(free: Free, pieces: int, whole: Collection[int],
                   only: frozenset[int] | None, avoid: frozenset[int] = frozenset(),
                   left: int | None = None) -> tuple[int, bool]:
    """A CPU with ``pieces`` free pieces near ``whole``, one of ``only`` (None: any), none of
    ``avoid``; a fresh one only among the free isolated CPUs where ``left`` is 0.

    An existing fragment CPU that is an SMT sibling of, shares an L3 with or sits on the NUMA
    node of the whole CPUs comes first (fewest free pieces first); then a fresh CPU from the
    shared pool, nearest first; then any fragment CPU with room (unless NUMA alignment forbids
    it). Without whole CPUs: the fullest fragment CPU with room, else a fresh CPU.
    """
    topology = free.topology
    rooms = free.rooms if only is None else {c: r for c, r in free.rooms.items() if c in only}
    if avoid:
        rooms = {c: r for c, r in rooms.items() if c not in avoid}
    anchor = frozenset(whole)
    blocked = anchor | avoid if avoid else anchor

    def allowed(cs: Iterable[int]) -> list[int]:
        return [c for c in cs if c not in blocked and (only is None or c in only)]

    within = left is not None and left <= 0  # the budget is spent: no fresh shared CPU

    if anchor:
        core_of, l3_of, node_of = free.core_of, free.l3_of, free.node_of
        cores = {core_of[c] for c in anchor}
        l3s = {l3_of[c] for c in anchor}
        nodes = {node_of[c] for c in anchor}
        # existing fragment CPUs by rank (sibling, same L3, same node), fewest free pieces first
        for near in ([c for k in cores for c in topology.cores[k] if c in rooms],
                     [c for g in l3s for c in free.fragments_in(2, g)],
                     [c for x in nodes for c in free.fragments_in(1, x)]):
            existing = [c for c in allowed(near) if rooms[c] >= pieces]
            if existing:
                return min(existing, key=lambda c: (rooms[c], c)), False
        takeable = free.free_isolated if within else free.takeable()
        for near in ([c for k in cores for c in topology.cores[k]],
                     [c for g in l3s for c in topology.l3_groups[g]]):
            fresh = [c for c in allowed(near) if c in takeable]
            if fresh:
                return pack(topology, fresh, 1, anchor)[0], True
        fresh = allowed(c for c in takeable if node_of[c] in nodes)
        if fresh:
            return pack(topology, fresh, 1, anchor)[0], True
        if free.opts.numa_alignment not in STRICT_ALIGNMENT:
            fresh = allowed(c for c in takeable if node_of[c] not in nodes)
            if fresh:
                return pack(topology, fresh, 1, anchor)[0], True
    existing = [c for c, room in rooms.items() if room >= pieces and c not in anchor]
    if existing and (not anchor or free.opts.numa_alignment not in STRICT_ALIGNMENT):
        return min(existing, key=lambda c: (rooms[c], c)), False
    if not anchor:
        fresh = allowed(free.free_isolated if within else free.takeable())
        if fresh:
            return pack(topology, fresh, 1, anchor)[0], True
    if left is not None and within and allowed(free.takeable()):
        raise floor(free, left - 1)  # a fresh CPU was there, but not in the budget
    raise shortage(free.ledger,
                   f"no CPU has {pieces} free pieces (of {free.g}) for this fragment")
