"""`LoopThread`: an event loop running in a thread of its own, so that synchronous code (a worker's methods, a
strategy's batch calls) can hand an engine coroutines while the engine's scheduler keeps running between calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread. `run(coro, timeout_s)` waits for a result (at most `timeout_s`, then
    TimeoutError: no wait is unbounded); `submit(coro)` returns a `concurrent.futures.Future` at once; `call_soon(fn,
    *args)` runs a plain function there."""

    def __init__(self, name: str = "engine-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future:
        if self.loop.is_closed():
            raise RuntimeError("the event loop thread was closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., object], *args) -> None:
        """`fn(*args)` on the loop's thread, soon; returns at once (a plain call, no future: `fn` reports itself)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop thread was closed")
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Awaitable[T], timeout_s: float | None = 600.0) -> T:
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError
                raise
            future.cancel()
            raise TimeoutError(f"a call on the event loop thread did not return within {timeout_s:g} s") from None

    def close(self) -> None:
        """Stop the loop and its thread (what still runs on it is dropped); a second call does nothing."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
