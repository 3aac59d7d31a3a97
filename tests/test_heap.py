"""`frozen_heap`: a pipeline's run keeps the objects built before it out of the collector's full passes, and gives
them back to it after (nested runs, as the demo's two stages, unfreeze only at the outermost end)."""

from __future__ import annotations

import gc
import weakref

from baton.distributed.heap import frozen_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_heap_freezes_for_the_block_and_nested_blocks_unfreeze_at_the_outermost_end():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        outer = gc.get_freeze_count()
        assert outer > 0
        with frozen_heap():
            assert gc.get_freeze_count() >= outer
        assert gc.get_freeze_count() >= outer  # the inner end leaves the outer run's heap frozen
    assert gc.get_freeze_count() == 0


def test_a_cycle_frozen_during_the_run_is_kept_while_it_runs_and_collected_after_it():
    with frozen_heap():
        cycle = _Cycle()
        ref = weakref.ref(cycle)
        with frozen_heap():  # a nested run freezes the cycle while it is still referenced
            del cycle
            gc.collect()
            assert ref() is not None  # frozen: the collector skips it
    gc.collect()
    assert ref() is None  # unfrozen at the outermost end: found and freed
