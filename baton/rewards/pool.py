"""Scoring rows concurrently in processes of their own, each row cut off after a time limit: its process is killed
and replaced, which no thread and no ProcessPoolExecutor task can be. What a process sends back is plain data (JSON):
the parent unpickles nothing a reward function made."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Sequence

from baton.rewards.routing import RewardRoutes
from baton.rewards.values import check_value

START_TIMEOUT_S = 300.0  # a process that has not imported the reward functions by then is broken, not slow
# A slow reward's (`register_reward(..., slow=True)`) limit per row when the config sets none: far above a real
# answer's parse (milliseconds), far below what a pathological one takes (`\\boxed{9^{9^{9^{9}}}}`: minutes).
DEFAULT_TIMEOUT_S_PER_ROW = 5.0
MAX_MESSAGE_BYTES = 64 * 2**20  # one row's result from a scoring process, at most
_MAX_ERROR_CHARS = 8000  # of an error's message and of its traceback
# Starts every scoring process. A child's parent-death signal fires when the *thread* that started it ends, and the
# rollout system scores from a thread per group: this one lives as long as the interpreter.
_STARTER = ThreadPoolExecutor(1, thread_name_prefix="baton-scoring-start")


class ScoringProcessError(Exception):
    """An exception a reward function raised in a scoring process, sent back as text: `type_name` (its class's
    name), its message, and its traceback as a note."""

    def __init__(self, type_name: str, message: str, traceback_text: str = ""):
        super().__init__(message)
        self.type_name = type_name
        if traceback_text:
            self.add_note(traceback_text)


@dataclass
class Outcome:
    """What scoring one row gave: the function's return value (from a scoring process: as plain data, checked
    there, or `invalid`), or the exception it raised (from a scoring process: a `ScoringProcessError`), or neither
    when the row ran past the time limit (`timed_out`)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    invalid: str | None = None  # from a scoring process: why the value is not a reward (see `values.check_value`)


Task = tuple[str, str, Any, Mapping[str, Any]]  # (route key in RewardRoutes.rewards, response, ground truth, fields)


class ScoringPool:
    """`num_processes` processes that score rows with the rewards of `spec` and their settings `kwargs` (what
    `RewardRoutes` takes); a row that runs longer than `timeout_s_per_row` (None: no limit) is cut off. The processes
    start on the first `score`, with this process's sys.path (so import paths resolve there as here), and stop on
    `close` or when the pool is collected or the interpreter exits.

    on_timeout: what `score_rows` does with a row past the limit: None, as its on_error says; "zero", score it 0
    and count it (a limit baton chose, not the config: see `scoring_pool`)."""

    def __init__(self, spec: str | Mapping[str, str], num_processes: int, timeout_s_per_row: float | None = None,
                 *, kwargs: Mapping[str, Any] | None = None, on_timeout: str | None = None):
        if num_processes < 1:
            raise ValueError(f"a scoring pool needs num_processes >= 1, got {num_processes}")
        if timeout_s_per_row is not None and timeout_s_per_row <= 0:
            raise ValueError(f"timeout_s_per_row must be > 0 or None, got {timeout_s_per_row}")
        if on_timeout not in (None, "zero"):
            raise ValueError(f"on_timeout must be None or 'zero', got {on_timeout!r}")
        self.spec = spec if isinstance(spec, str) else dict(spec)
        self.kwargs = dict(kwargs or {})
        self.num_processes, self.timeout_s_per_row, self.on_timeout = num_processes, timeout_s_per_row, on_timeout
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
            message = _read(child.conn)
        except (EOFError, OSError):
            self._drop(child)
            return Outcome(error=RuntimeError(f"the scoring process exited (exit code {child.process.returncode}) "
                                              "while the reward function ran on this row"))
        except ValueError as e:  # not the JSON `_serve` writes: the process is not to be trusted with more rows
            self._drop(child)
            return Outcome(error=RuntimeError(f"the scoring process sent back something that is not a result ({e})"))
        if "value" in message:
            return Outcome(value=message["value"])
        if "invalid" in message:
            return Outcome(invalid=str(message["invalid"]))
        error = message.get("error") or {}
        return Outcome(error=ScoringProcessError(str(error.get("type", "Exception")), str(error.get("message", "")),
                                                 str(error.get("traceback", ""))))

    def _start_children(self, wanted: int) -> None:
        new = [_Child.start(self.spec, self.kwargs) for _ in range(wanted - len(self._children))]
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


def scoring_pool(routes: RewardRoutes, num_processes: int = 0, timeout_s_per_row: float | None = None, *,
                 fallback_timeout_s: float | None = None) -> ScoringPool | None:
    """Where `routes` score: None (in the caller's process, one row after another) or a pool of processes.

    num_processes / timeout_s_per_row: the config's (`reward.num_processes_per_worker`, `reward.timeout_s_per_row`);
    a row past that limit is handled by reward_on_error. Where the config sets no limit, baton sets one: for a slow
    reward (`register_reward(..., slow=True)`: math_verify) DEFAULT_TIMEOUT_S_PER_ROW, else `fallback_timeout_s`
    (the rollout system's whole-group limit), and then scores in processes (at least one), and a row past it scores
    0 and is counted (reward/num_errors, reward/num_timeouts) whatever reward_on_error says: model output that makes
    a parser run for minutes is the response's fault, not a bug in the function, and must not stop the run."""
    on_timeout = None
    if timeout_s_per_row is None:
        timeout_s_per_row = DEFAULT_TIMEOUT_S_PER_ROW if routes.slow else fallback_timeout_s
        on_timeout = "zero"
    if timeout_s_per_row is None and not num_processes:
        return None
    return ScoringPool(routes.spec, max(num_processes, 1), timeout_s_per_row, kwargs=routes.kwargs,
                       on_timeout=on_timeout)


class _Child:
    """One scoring process: `python -c` running `_serve` (not a multiprocessing child, which would import this
    process's __main__ again), talking over a socket pair. It leads a session of its own, so that stopping it kills
    whatever the reward function started too (the group), and it is killed when this process dies."""

    def __init__(self, process: subprocess.Popen, conn: Connection):
        self.process, self.conn = process, conn

    @classmethod
    def start(cls, spec, kwargs) -> "_Child":
        parent_end, child_end = multiprocessing.Pipe()
        fd = child_end.fileno()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # import paths as here
        command = [sys.executable, "-c", f"from baton.rewards.pool import _serve; _serve({fd}, {os.getpid()})"]
        process = _STARTER.submit(subprocess.Popen, command, pass_fds=[fd], env=env, stdin=subprocess.DEVNULL,
                                  start_new_session=True).result()
        child_end.close()
        parent_end.send((spec, kwargs))
        return cls(process, parent_end)

    def wait_ready(self) -> None:
        """Wait until the process has loaded the reward functions; RuntimeError with its error if it could not."""
        if not self.conn.poll(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"a reward scoring process did not load the reward functions within {START_TIMEOUT_S} s")
        try:
            message = _read(self.conn)
        except (EOFError, OSError):
            message = {"failed": f"it exited with code {self.process.wait(5)}"}
        except ValueError as e:
            message = {"failed": f"it sent back something else than its readiness ({e})"}
        if "ready" not in message:
            self.stop()
            raise RuntimeError(f"a reward scoring process could not load the reward functions: {message.get('failed')}"
                               "\n(a reward registered at run time, outside a module, is unknown there: register it in "
                               "a module and name it by import path 'package.module:function')")

    def stop(self) -> None:
        self.conn.close()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the process and what it started, even after it exited
        except (ProcessLookupError, PermissionError):  # the group is gone (or its pid reused outside it)
            pass
        self.process.wait(5)


def _stop_all(children: list[_Child]) -> None:
    for child in children:
        child.stop()
    children.clear()


def _read(conn: Connection) -> dict[str, Any]:
    """One message of `_serve`'s: a JSON object, parsed (never unpickled); ValueError when it is not one."""
    try:
        message = json.loads(conn.recv_bytes(MAX_MESSAGE_BYTES))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(message, dict):
        raise ValueError(f"a JSON {type(message).__name__}, not an object")
    return message


def _write(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message, allow_nan=False).encode())


def _error_message(e: BaseException) -> dict[str, Any]:
    """The exception as text: its class's name, its message and its traceback, each cut to a bounded length."""
    try:
        text, trace = str(e), "".join(traceback.format_exception(e)).rstrip()
    except Exception:  # a __str__ that raises: the class's name still says what it was
        text, trace = f"<the message of a {type(e).__name__} could not be read>", ""
    return {"error": {"type": type(e).__name__, "message": _cut(text), "traceback": _cut(trace)}}


def _cut(text: str) -> str:
    half = _MAX_ERROR_CHARS // 2
    return text if len(text) <= _MAX_ERROR_CHARS else f"{text[:half]} [...] {text[-half:]}"


def _serve(fd: int, parent_pid: int) -> None:
    """A scoring process: resolve the rewards sent first, then score the rows sent until the connection closes. Each
    row's result goes back as JSON: {"value": a number or a dict of numbers (and "pred")}, {"invalid": why the
    returned value is not a reward}, or {"error": the exception as text}. Killed when `parent_pid` dies, even while
    a row holds the interpreter."""
    from baton.rewards.sandbox_kernel import set_parent_death_signal

    set_parent_death_signal()
    if os.getppid() != parent_pid:  # it died before the signal was set
        return
    conn = Connection(fd)
    try:
        spec, kwargs = conn.recv()
        routes = RewardRoutes(spec, kwargs)
    except Exception:  # reported to the parent, which raises it
        _write(conn, {"failed": _cut(traceback.format_exc())})
        return
    _write(conn, {"ready": True})
    while True:
        try:
            key, response, truth, fields = conn.recv()
        except EOFError:
            return
        try:
            value = routes.rewards[key](response, truth, fields)
        except Exception as e:  # the user's function: sent back as text, reported with its row
            _write(conn, _error_message(e))
            continue
        try:
            message = {"value": check_value(value)}
        except ValueError as e:  # not a reward: a bug in the function, which score_rows reports as such
            message = {"invalid": str(e)}
        _write(conn, message)
