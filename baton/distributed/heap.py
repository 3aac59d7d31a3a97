"""The Python heap a long-running process built before its loop, kept out of the garbage collector's full passes.

A driver or worker holds hundreds of thousands of Python objects once torch, transformers, Ray and a model are
loaded; each full (oldest-generation) collection walks all of them, and a rollout step's allocations trigger one
every step or two: 0.24 s each in the rollout bench's driver, a third of its CPU. `gc.freeze()` moves the objects
alive at that point into a permanent generation that collections skip; objects made later are collected as before.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

_depth = 0


def freeze_heap() -> None:
    """Collect what is garbage now, then freeze the rest for the life of the process (a worker, after its setup)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap for the block (a pipeline's run) and unfreeze it after the outermost such block, so that
    what the run left behind in reference cycles is collected once it ends. Nested blocks freeze what was made
    since."""
    global _depth
    freeze_heap()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()
