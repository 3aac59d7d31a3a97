"""Liveness of a cluster's worker processes on Ray: a heartbeat watched from a driver thread.

Every worker answers `heartbeat()` from a thread of its own (a Ray concurrency group beside the
one that runs calls, which stays single-threaded so calls run in order). A busy worker, inside a
long torch op or a pure-Python loop, still answers within milliseconds; a worker that leaves its
heartbeat unanswered for `heartbeat_timeout_s` is frozen: its process is stopped (SIGSTOP), stuck
in the kernel or swapping, or holds the GIL in native code. A pending call on a dead or frozen
worker fails within that bound, and nothing of the driver's call path waits on the monitor.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from baton.distributed.errors import WorkerDiedError, WorkerFrozenError


@dataclass(frozen=True)
class Lost:
    """A worker the monitor lost: dead (its process is gone) or frozen (heartbeat unanswered too long)."""

    rank: int
    frozen: bool
    reason: str

    def error(self, cluster: str, method: str, note: str) -> WorkerDiedError:
        """The error for a call of `method` that was pending on this worker; `note` says what became of the cluster."""
        cls = WorkerFrozenError if self.frozen else WorkerDiedError
        return cls(cluster, self.rank, method, f"{self.reason}; {note}")


def died_reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"worker process died: {text.splitlines()[0] if text else type(exc).__name__}"


class HealthMonitor:
    """Watches one start of a cluster's Ray actors; a restart gets a new monitor.

    `check()` is what a pending call asks between polls: the first worker found dead or frozen, or
    None. `halt(reason)` kills every process of this start (Ray cannot interrupt a running call)
    and makes `stopped_reason` say why, so results still pending on these processes fail at once.
    With `interval_s=0` no heartbeat is sent (only `halt` works): dead workers then surface when
    a call on them fails, and frozen ones at the call timeout.
    """

    def __init__(self, actors: Sequence, kill: Callable[[Any], None], *, interval_s: float,
                 heartbeat_timeout_s: float):
        self._actors = list(actors)
        self._kill = kill
        self._interval_s = interval_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._lost: Lost | None = None
        self._lock = threading.Lock()
        self.stopped_reason: str | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="baton-health", daemon=True)
            self._thread.start()

    def check(self) -> Lost | None:
        return self._lost

    @property
    def death_bound_s(self) -> float:
        """How long after a worker process dies this monitor may take to report it (0: it sends no heartbeat)."""
        return 2 * self._interval_s + 0.5 if self._thread is not None else 0.0

    def halt(self, reason: str) -> None:
        """Kill this start's processes (once; later calls keep the first reason). Does not wait for them to exit."""
        with self._lock:
            if self.stopped_reason is not None:
                return
            self.stopped_reason = reason
        self._closed.set()
        for actor in self._actors:
            self._kill(actor)

    def close(self) -> None:
        """Stop the heartbeat thread and wait for it (so no Ray call follows a `ray.shutdown()`)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval_s + 1.0)

    def _run(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        last_answer_s = [time.monotonic()] * len(self._actors)
        outstanding: dict = {}  # heartbeat ref -> rank; at most one per worker
        while not self._closed.is_set() and ray.is_initialized():
            round_start_s = time.monotonic()
            waiting = set(outstanding.values())
            for rank, actor in enumerate(self._actors):
                if rank not in waiting:
                    outstanding[actor.heartbeat.remote()] = rank
            ready, _ = ray.wait(list(outstanding), num_returns=len(outstanding), timeout=self._interval_s)
            now_s = time.monotonic()
            for ref in ready:
                rank = outstanding.pop(ref)
                try:
                    ray.get(ref, timeout=0)
                except RayActorError as exc:
                    self._lost = Lost(rank, frozen=False, reason=died_reason(exc))
                    return
                last_answer_s[rank] = now_s
            silences = [(now_s - last_answer_s[rank], rank) for rank in outstanding.values()]
            if silences and max(silences)[0] > self._heartbeat_timeout_s:
                silence_s, rank = max(silences)
                self._lost = Lost(rank, frozen=True, reason=(
                    f"no heartbeat answered for {silence_s:.1f} s (heartbeat_timeout_s={self._heartbeat_timeout_s:g}): "
                    "its process is stopped (SIGSTOP), stuck in the kernel or swapping, or holds the GIL in native code"
                ))
                return
            self._closed.wait(max(0.0, self._interval_s - (time.monotonic() - round_start_s)))
