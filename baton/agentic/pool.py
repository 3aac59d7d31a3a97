"""`EnvPool`: environments run in worker processes of their own, every call bounded in time.

Each of `num_processes` spawned processes plays one episode at a time: `reset(key, seed)` takes a free process for
the episode (waiting at most `acquire_timeout_s` for one), `close(key)` gives it back. A call (`reset`, `step`)
waits at most `timeout_s`; an environment that runs past it has its process killed and restarted, and only its
own episode is lost: that call and the episode's later ones raise `EnvError`, and the rollout drops its trajectory
(counted) while the rest of the step goes on. An environment that raises, or whose process dies, is the same.
The processes import only the environment's module (not torch), so they start fast and stay small.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from baton.config import import_object


class EnvError(RuntimeError):
    """An environment call failed: the environment raised, ran past the pool's timeout, or its process died."""


def _serve(read_fd: int, write_fd: int) -> None:
    """An environment process (`python -c`, so it imports nothing of its parent's main module): its first message
    names the environment factory and its arguments; then episodes by key, each built on reset."""
    from multiprocessing.connection import Connection

    incoming, outgoing = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    env_path, env_kwargs = incoming.recv()
    factory = import_object(env_path)
    episodes: dict[str, Any] = {}
    while True:
        try:
            op, key, arg = incoming.recv()
        except EOFError:  # the pool closed the pipe
            return
        try:
            if op == "reset":
                episodes[key] = factory(**env_kwargs)
                result = episodes[key].reset(arg)
            elif op == "step":
                result = episodes[key].step(arg)
            elif op == "close":
                result = episodes.pop(key, None) is not None
            else:  # "ping"
                result = True
            outgoing.send(("ok", result))
        except BaseException as error:  # the environment's own failure: its episode's, reported to the caller
            outgoing.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=5)}"))


_CHILD = "import sys; from baton.agentic.pool import _serve; _serve(int(sys.argv[1]), int(sys.argv[2]))"


class _Process:
    """One environment process in a session of its own (killed as a group), reached over two pipes. It finds
    modules as this process does (its sys.path as PYTHONPATH)."""

    def __init__(self, env_path: str, env_kwargs: dict, incarnation: int):
        from multiprocessing.connection import Connection

        from_parent, to_child = os.pipe()  # (read, write)
        from_child, to_parent = os.pipe()
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.process = subprocess.Popen([sys.executable, "-c", _CHILD, str(from_parent), str(to_parent)],
                                            pass_fds=(from_parent, to_parent), env=environ, start_new_session=True,
                                            stdin=subprocess.DEVNULL)
        finally:
            os.close(from_parent)
            os.close(to_parent)
        self.outgoing, self.incoming = Connection(to_child, readable=False), Connection(from_child, writable=False)
        self.outgoing.send((env_path, env_kwargs))
        self.lock = threading.Lock()
        self.incarnation = incarnation

    def send(self, message) -> None:
        self.outgoing.send(message)

    def reply(self, timeout_s: float):
        """The process's answer, or None if it gave none within `timeout_s`; EOFError if it died."""
        return self.incoming.recv() if self.incoming.poll(timeout_s) else None

    def wait_ready(self, timeout_s: float) -> None:
        """Until the process answers (its imports done), at most `timeout_s`."""
        self.send(("ping", "", None))
        try:
            answered = self.reply(timeout_s) is not None
        except (EOFError, OSError):
            answered = False
        if not answered:
            self.kill()
            raise EnvError(f"an environment process did not start within {timeout_s:g} s")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """The process and whatever it started (its session's group)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        self.outgoing.close()
        self.incoming.close()


class EnvPool:
    """See the module docstring. env: an import path "package.module:Factory" (a class or function that takes
    `env_kwargs` and returns an `Env`)."""

    def __init__(self, env: str, env_kwargs: dict | None = None, num_processes: int = 8, timeout_s: float = 10.0,
                 acquire_timeout_s: float = 600.0, start_timeout_s: float = 60.0):
        if num_processes < 1:
            raise ValueError(f"num_processes={num_processes} must be >= 1")
        if timeout_s <= 0 or acquire_timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} and acquire_timeout_s={acquire_timeout_s} must be > 0")
        try:
            import_object(env)  # here, so that a bad path fails before any process starts
        except Exception as error:
            raise ValueError(f"environment {env!r} cannot be imported: {error}") from error
        self.env, self.env_kwargs = env, dict(env_kwargs or {})
        self.timeout_s, self.acquire_timeout_s = timeout_s, acquire_timeout_s
        self._lock = threading.Lock()
        self._processes = [_Process(env, self.env_kwargs, 0) for _ in range(num_processes)]
        self._free = list(range(num_processes))
        self._owner: dict[str, tuple[int, int]] = {}  # key -> (its process, that process's incarnation at reset)
        self._threads = concurrent.futures.ThreadPoolExecutor(num_processes, thread_name_prefix="env-call")
        self.num_restarts, self.start_timeout_s = 0, start_timeout_s
        for process in self._processes:
            process.wait_ready(start_timeout_s)

    # --- calls -----------------------------------------------------------------------------------------

    async def reset(self, key: str, seed: int) -> str:
        """Take a free process for episode `key` and reset its environment with `seed`: the first observation."""
        deadline = time.monotonic() + self.acquire_timeout_s
        while True:
            with self._lock:
                if key in self._owner:
                    raise EnvError(f"episode {key!r} is already running; close it first")
                if self._free:
                    index = self._free.pop()
                    self._owner[key] = (index, self._processes[index].incarnation)
                    break
            if time.monotonic() >= deadline:
                raise EnvError(f"episode {key!r}: no environment process came free within {self.acquire_timeout_s:g} "
                               f"s (all {len(self._processes)} busy); raise num_env_processes")
            await asyncio.sleep(0.005)
        return await self._async(key, "reset", seed)

    async def step(self, key: str, action: str) -> tuple[str, float, bool, dict]:
        return await self._async(key, "step", action)

    async def close(self, key: str) -> None:
        """End episode `key` and give its process back (a second call, or one for a key never reset, does nothing)."""
        with self._lock:
            owner = self._owner.get(key)
        if owner is None:
            return
        try:
            await self._async(key, "close", None)
        except EnvError:
            pass  # lost with a restarted process: nothing to close
        with self._lock:
            self._owner.pop(key, None)
            self._free.append(owner[0])

    async def _async(self, key: str, op: str, arg):
        with self._lock:
            if key not in self._owner:
                raise EnvError(f"episode {key!r} was never reset")
            index, incarnation = self._owner[key]
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, self._call, index, op, key, arg, self.timeout_s, incarnation)

    def _call(self, index: int, op: str, key: str, arg, timeout_s: float, incarnation: int | None = None):
        """One call on process `index` (its episode's only caller), at most `timeout_s`."""
        with self._processes[index].lock:
            process = self._processes[index]
            if incarnation is not None and process.incarnation != incarnation:
                raise EnvError(f"episode {key!r} was lost: its environment process was restarted")
            try:
                process.send((op, key, arg))
                reply = process.reply(timeout_s)
                ready = reply is not None
            except (EOFError, OSError):
                ready, reply = True, None
            if reply is None:
                self._restart(index)
                what = f"ran past {timeout_s:g} s (env timeout_s)" if not ready else "died"
                raise EnvError(f"episode {key!r}: the environment {what} in {op}(); its process was restarted")
            status, value = reply
            if status == "error":
                raise EnvError(f"episode {key!r}: the environment raised in {op}(): {value}")
            return value

    def _restart(self, index: int) -> None:
        """Under the process's lock: kill it and start a fresh one in its place (its episode is lost)."""
        old = self._processes[index]
        old.kill()
        fresh = _Process(self.env, self.env_kwargs, old.incarnation + 1)
        fresh.lock = old.lock  # held by the caller
        self._processes[index] = fresh
        fresh.wait_ready(self.start_timeout_s)  # started before it takes the next episode
        with self._lock:
            self.num_restarts += 1

    @property
    def num_episodes(self) -> int:
        with self._lock:
            return len(self._owner)

    def close_pool(self) -> None:
        """Stop every process (a second call does nothing)."""
        for process in self._processes:
            if process.alive():
                process.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


__all__ = ["EnvError", "EnvPool"]
