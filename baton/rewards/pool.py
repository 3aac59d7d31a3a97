"""Scoring rows concurrently in processes of their own, each row cut off after a time limit: its process is killed
and replaced, which no thread and no ProcessPoolExecutor task can be."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Sequence

from baton.rewards.routing import RewardRoutes

START_TIMEOUT_S = 300.0  # a process that has not imported the reward functions by then is broken, not slow


@dataclass
class Outcome:
    """What scoring one row gave: the function's return value, or the exception it raised, or neither when the row
    ran past the time limit (`timed_out`)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


Task = tuple[str, str, Any, Mapping[str, Any]]  # (route key in RewardRoutes.rewards, response, ground truth, fields)


class ScoringPool:
    """`num_processes` processes that score rows with the rewards of `spec` (what `RewardRoutes` takes); a row that
    runs longer than `timeout_s_per_row` (None: no limit) is cut off. The processes start on the first `score`, with
    this process's sys.path (so import paths resolve there as here), and stop on `close` or when the pool is
    collected or the interpreter exits."""

    def __init__(self, spec: str | Mapping[str, str], num_processes: int, timeout_s_per_row: float | None = None):
        if num_processes < 1:
            raise ValueError(f"a scoring pool needs num_processes >= 1, got {num_processes}")
        if timeout_s_per_row is not None and timeout_s_per_row <= 0:
            raise ValueError(f"timeout_s_per_row must be > 0 or None, got {timeout_s_per_row}")
        self.spec = spec if isinstance(spec, str) else dict(spec)
        self.num_processes, self.timeout_s_per_row = num_processes, timeout_s_per_row
        self._children: list[_Child] = []
        weakref.finalize(self, _stop_all, self._children)

    def score(self, tasks: Sequence[Task]) -> list[Outcome]:
        """One `Outcome` per task, in task order."""
        try:
            return self._score(tasks)
        except BaseException:  # rows left running would answer the next call: start afresh then
            self.close()
            raise

    def _score(self, tasks: Sequence[Task]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        running: dict[_Child, tuple[int, float]] = {}  # child -> (row, when it was sent)
        while queue or running:
            self._start_children(min(self.num_processes, len(queue) + len(running)))
            for child in [c for c in self._children if c not in running]:
                if not queue:
                    break
                row = queue.popleft()
                try:
                    child.conn.send(tasks[row])
                except OSError:  # died while idle (a broken pipe): replace it, send the row again
                    self._drop(child)
                    queue.appendleft(row)
                    continue
                running[child] = (row, time.monotonic())
            if not running:
                continue
            ready = wait([c.conn for c in running], timeout=self._time_left(running))
            for child in [c for c in running if c.conn in ready]:
                row, _ = running.pop(child)
                outcomes[row] = self._receive(child)
            if self.timeout_s_per_row is not None:
                now = time.monotonic()
                for child, (row, sent) in list(running.items()):
                    if now - sent >= self.timeout_s_per_row:
                        del running[child]
                        self._drop(child)
                        outcomes[row] = Outcome(timed_out=True)
        return outcomes

    def close(self) -> None:
        _stop_all(self._children)

    def _time_left(self, running: dict) -> float | None:
        if self.timeout_s_per_row is None:
            return None
        first_sent = min(sent for _, sent in running.values())
        return max(0.0, first_sent + self.timeout_s_per_row - time.monotonic())

    def _receive(self, child: "_Child") -> Outcome:
        try:
            kind, payload = child.conn.recv()
        except (EOFError, OSError):
            self._drop(child)
            return Outcome(error=RuntimeError(f"the scoring process exited (exit code {child.process.returncode}) "
                                              "while the reward function ran on this row"))
        except Exception as e:  # an exception whose class cannot be rebuilt from its pickle (a custom __init__)
            return Outcome(error=RuntimeError(f"the reward function raised an error that could not be read back from "
                                              f"its scoring process ({type(e).__name__}: {e})"))
        return Outcome(value=payload) if kind == "value" else Outcome(error=payload)

    def _start_children(self, wanted: int) -> None:
        new = [_Child.start(self.spec) for _ in range(wanted - len(self._children))]
        try:
            for child in new:
                child.wait_ready()
        except BaseException:
            _stop_all(new)
            raise
        self._children.extend(new)

    def _drop(self, child: "_Child") -> None:
        child.stop()
        self._children.remove(child)


class _Child:
    """One scoring process: `python -c` running `_serve` (not a multiprocessing child, which would import this
    process's __main__ again), talking over a socket pair."""

    def __init__(self, process: subprocess.Popen, conn: Connection):
        self.process, self.conn = process, conn

    @classmethod
    def start(cls, spec) -> "_Child":
        parent_end, child_end = multiprocessing.Pipe()
        fd = child_end.fileno()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # import paths as here
        process = subprocess.Popen([sys.executable, "-c", f"from baton.rewards.pool import _serve; _serve({fd})"],
                                   pass_fds=[fd], env=env, stdin=subprocess.DEVNULL)
        child_end.close()
        parent_end.send(spec)
        return cls(process, parent_end)

    def wait_ready(self) -> None:
        """Wait until the process has loaded the reward functions; RuntimeError with its error if it could not."""
        if not self.conn.poll(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"a reward scoring process did not load the reward functions within {START_TIMEOUT_S} s")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            kind, payload = "failed", f"it exited with code {self.process.wait(5)}"
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"a reward scoring process could not load the reward functions: {payload}")

    def stop(self) -> None:
        self.conn.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)


def _stop_all(children: list[_Child]) -> None:
    for child in children:
        child.stop()
    children.clear()


def _serve(fd: int) -> None:
    """A scoring process: resolve the rewards sent first, then score the rows sent until the connection closes."""
    conn = Connection(fd)
    try:
        routes = RewardRoutes(conn.recv())
    except Exception:  # reported to the parent, which raises it
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            key, response, truth, fields = conn.recv()
        except EOFError:
            return
        try:
            message = ("value", routes.rewards[key](response, truth, fields))
        except Exception as e:  # the user's function: sent back with its traceback, reported with its row
            e.add_note("".join(traceback.format_exception(e)).rstrip())
            message = ("error", e)
        try:
            conn.send(message)
        except Exception as e:  # pickling what the function returned or raised
            what = "return value" if message[0] == "value" else f"{type(message[1]).__name__} it raised"
            conn.send(("error", TypeError(f"the reward function's {what} cannot be sent back from its scoring "
                                          f"process: {type(e).__name__}: {e}")))
