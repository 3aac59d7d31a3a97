"""Ctrl-C during training: the first one stops the run after its step, with a checkpoint; a second stops it at once."""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training after a step; `checkpoint` holds that step."""

    def __init__(self, checkpoint: str):
        super().__init__(f"interrupted; the last finished step is saved in {checkpoint}")
        self.checkpoint = checkpoint


@contextmanager
def deferred_interrupt():
    """Within: a first Ctrl-C only sets the yielded event, so the caller can stop at a safe point; a second
    one raises KeyboardInterrupt at once. (Signals reach only the main thread; elsewhere this does nothing.)"""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def handler(signum, frame):
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at once, unsaved)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)
