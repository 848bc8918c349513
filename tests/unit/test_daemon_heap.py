"""The daemon freezes what its start made (cpuservice.daemon.settle_heap): no full collection
walks it again, so an idle daemon's rare wake-ups and an Allocate never pay for one."""

from __future__ import annotations

import gc

from cpuservice import daemon


def test_what_the_start_made_is_frozen_and_its_garbage_collected() -> None:
    gc.unfreeze()
    kept: list[object] = [object()]  # lives on, as the start's objects do
    garbage: list[object] = []
    garbage.append(garbage)  # a cycle: only a collection frees it
    garbage_id = id(garbage)
    del garbage
    assert any(o is kept for o in gc.get_objects())
    try:
        daemon.settle_heap()
        assert gc.get_freeze_count() > 0
        # frozen objects sit in the permanent generation, which collections never walk
        assert not any(o is kept for o in gc.get_objects())
        assert not any(id(o) == garbage_id and isinstance(o, list) and o and o[0] is o
                       for o in gc.get_objects())
    finally:
        gc.unfreeze()
