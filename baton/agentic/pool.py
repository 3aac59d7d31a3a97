"""`EnvPool`: environments run in worker processes of their own, every call bounded in time.

`num_processes` processes (each started with `python -c` in a session of its own, so it imports only the
environment's module, not its parent's main module or torch) hold up to `episodes_per_process` episodes each; a
process serves its episodes' calls in threads, so a slow episode does not hold the others. `reset(key, seed)`
puts the episode on the process with the fewest (waiting at most `acquire_timeout_s` for room), `close(key)` ends
it. Every call waits at most `timeout_s`:

- an environment that raises costs its own episode: that call raises `EnvError`;
- one that runs past `timeout_s` costs its own episode too: the call raises `EnvError` and the episode is lost;
  its process takes no new episode, and once its other episodes have closed it is killed (with whatever it
  started: its session's process group) and replaced, so the hung call is stopped without cutting the others
  short;
- a process that dies (a memory bomb, a crash) costs the episodes it held: their calls raise `EnvError`, and a
  fresh process takes its place.

The rollout drops the trajectories whose calls raised (counted) while the rest of the step goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from baton.agentic.env import ENVIRONMENTS
from baton.config import ConfigError, import_object


class EnvError(RuntimeError):
    """An environment call failed: the environment raised, ran past the pool's timeout, or its process died."""


def _serve(read_fd: int, write_fd: int) -> None:
    """An environment process: its first message names the environment factory and its arguments; then calls
    (call id, op, key, arg), each served in a thread, answered (call id, "ok" | "error", value)."""
    from multiprocessing.connection import Connection

    incoming, outgoing = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    env_path, env_kwargs, max_threads = incoming.recv()
    factory = import_object(env_path)
    episodes: dict[str, Any] = {}
    send_lock = threading.Lock()
    threads = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="env")

    def run(call_id: int, op: str, key: str, arg) -> None:
        try:
            if op == "reset":  # arg: (seed, the episode's saved state or None)
                seed, state = arg
                episodes[key] = factory(**env_kwargs)
                result = episodes[key].reset(seed)
                if state is not None:
                    episodes[key].load_state_dict(state)
            elif op == "step":
                result = episodes[key].step(arg)
            elif op == "run":  # an agent program's whole episode (`baton.agentic.agent.AgentProgram`)
                result = episodes[key].run(*arg)
            elif op == "state":
                save = getattr(episodes[key], "state_dict", None)
                result = None if save is None else save()
                json.dumps(result)  # it rides in a sample's metadata into checkpoints: JSON only
            elif op == "close":
                result = episodes.pop(key, None) is not None
            else:  # "ping"
                result = True
            reply = (call_id, "ok", result)
        except BaseException as error:  # the environment's own failure: its episode's, reported to the caller
            reply = (call_id, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=5)}")
        with send_lock:
            outgoing.send(reply)

    while True:
        try:
            message = incoming.recv()
        except EOFError:  # the pool closed the pipe
            os._exit(0)  # without waiting for a hung environment's thread
        threads.submit(run, *message)


_CHILD = "import sys; from baton.agentic.pool import _serve; _serve(int(sys.argv[1]), int(sys.argv[2]))"


class _Process:
    """One environment process, reached over two pipes; a reader thread settles each call's future with its
    answer, and fails them all with EnvError if the process dies. It finds modules as this process does (its
    sys.path as PYTHONPATH)."""

    def __init__(self, env_path: str, env_kwargs: dict, max_threads: int):
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
        self.outgoing.send((env_path, env_kwargs, max_threads))
        self.lock = threading.Lock()  # sending, and the table of calls
        self.calls: dict[int, concurrent.futures.Future] = {}
        self.episodes: set[str] = set()  # held here, lost ones included until closed
        self.retiring = False  # a call ran past its timeout: no new episode; replaced once its episodes closed
        self.dead = False
        self.replacing = False  # claimed by the pool's replacement of it
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="env-reader", daemon=True)
        self._reader.start()

    def call(self, op: str, key: str, arg) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.dead:
                future.set_exception(EnvError("its environment process died"))
                return future
            call_id = next(self._ids)
            self.calls[call_id] = future
            try:
                self.outgoing.send((call_id, op, key, arg))
            except OSError:
                self.calls.pop(call_id)
                future.set_exception(EnvError("its environment process died"))
        return future

    def _read(self) -> None:
        while True:
            try:
                call_id, status, value = self.incoming.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                future = self.calls.pop(call_id, None)
            if future is None:
                continue
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # its caller gave up on it
                if status == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(EnvError(f"the environment raised: {value}"))
        with self.lock:
            self.dead = True
            pending, self.calls = list(self.calls.values()), {}
        for future in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(EnvError("its environment process died"))

    def alive(self) -> bool:
        return not self.dead and self.process.poll() is None

    def kill(self) -> None:
        """The process and whatever it started (its session's process group)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        self.outgoing.close()
        self._reader.join(5)
        self.incoming.close()


def _importable_path(factory, env: str) -> str:
    """The import path by which a fresh process finds `factory` (it runs none of this process's registrations)."""
    path = f"{factory.__module__}:{factory.__qualname__}"
    try:
        found = None if factory.__module__ == "__main__" else import_object(path)
    except ConfigError:
        found = None
    if found is not factory:
        raise ValueError(f"environment {env!r} is {path!r}, which an environment process cannot import; define it at "
                         "the top level of a module")
    return path


class EnvPool:
    """See the module docstring. env: a name in `ENVIRONMENTS`, or an import path "package.module:Factory" (a class or
    function that takes `env_kwargs` and returns an `Env`)."""

    def __init__(self, env: str, env_kwargs: dict | None = None, num_processes: int = 2,
                 episodes_per_process: int = 64, timeout_s: float = 10.0, acquire_timeout_s: float = 600.0,
                 start_timeout_s: float = 60.0):
        if num_processes < 1 or episodes_per_process < 1:
            raise ValueError(f"num_processes={num_processes} and episodes_per_process={episodes_per_process} must "
                             "be >= 1")
        if timeout_s <= 0 or acquire_timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} and acquire_timeout_s={acquire_timeout_s} must be > 0")
        self.env_path = _importable_path(ENVIRONMENTS.get(env), env)  # a bad name fails before any process starts
        self.env, self.env_kwargs, self.episodes_per_process = env, dict(env_kwargs or {}), episodes_per_process
        self.timeout_s, self.acquire_timeout_s, self.start_timeout_s = timeout_s, acquire_timeout_s, start_timeout_s
        self._lock = threading.Lock()
        self._processes = [self._start() for _ in range(num_processes)]
        self._owner: dict[str, _Process] = {}
        self._lost: set[str] = set()
        self.num_restarts = 0

    def _start(self) -> _Process:
        """A fresh process, once it answers (its imports done)."""
        process = _Process(self.env_path, self.env_kwargs, self.episodes_per_process + 4)
        try:
            process.call("ping", "", None).result(self.start_timeout_s)
        except (concurrent.futures.TimeoutError, EnvError):
            process.kill()
            raise EnvError(f"an environment process for {self.env!r} did not start within "
                           f"{self.start_timeout_s:g} s") from None
        return process

    # --- calls -----------------------------------------------------------------------------------------

    async def reset(self, key: str, seed: int, state: dict | None = None) -> str:
        """Put episode `key` on the process with the fewest and reset its environment with `seed` (then load `state`,
        an episode saved by `state`, into it): the first observation."""
        deadline = time.monotonic() + self.acquire_timeout_s
        while True:
            with self._lock:
                if key in self._owner:
                    raise EnvError(f"episode {key!r} is already running; close it first")
                room = [p for p in self._processes if p.alive() and not p.retiring
                        and len(p.episodes) < self.episodes_per_process]
                if room:
                    process = min(room, key=lambda p: len(p.episodes))
                    process.episodes.add(key)
                    self._owner[key] = process
                    break
            if time.monotonic() >= deadline:
                raise EnvError(f"episode {key!r}: no environment process had room within {self.acquire_timeout_s:g} s "
                               f"({len(self._processes)} × {self.episodes_per_process} episodes); raise "
                               "num_env_processes")
            await self._replace_finished()  # a dead or retired one may be what is missing
            await asyncio.sleep(0.005)
        return await self._call(key, "reset", (seed, state))

    async def state(self, key: str) -> dict | None:
        """Episode `key`'s environment state (its `state_dict()`, JSON-safe), None if it has no `state_dict`."""
        return await self._call(key, "state", None)

    async def step(self, key: str, action: str) -> tuple[str, float, bool, dict]:
        return await self._call(key, "step", action)

    async def run(self, key: str, args: tuple, timeout_s: float):
        """Episode `key`'s `run(*args)` (an agent program's whole episode), bounded by `timeout_s` instead of the
        pool's per-call timeout."""
        return await self._call(key, "run", args, timeout_s)

    async def close(self, key: str) -> None:
        """End episode `key` (a second call, or one for a key never reset, does nothing)."""
        with self._lock:
            process = self._owner.get(key)
            lost = key in self._lost
        if process is None:
            return
        if not lost:
            with contextlib.suppress(EnvError):
                await self._call(key, "close", None)
        with self._lock:
            self._owner.pop(key, None)
            self._lost.discard(key)
            process.episodes.discard(key)
        await self._replace_finished()

    async def _call(self, key: str, op: str, arg, timeout_s: float | None = None):
        with self._lock:
            process = self._owner.get(key)
            if process is None:
                raise EnvError(f"episode {key!r} was never reset")
            if key in self._lost:
                raise EnvError(f"episode {key!r} was lost earlier (its environment hung or died)")
        future = process.call(op, key, arg)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            with self._lock:
                self._lost.add(key)
                process.retiring = True  # the hung call is stopped when its process is replaced
            raise EnvError(f"episode {key!r}: the environment ran past {timeout_s:g} s in {op}()") from None
        except EnvError as error:
            with self._lock:
                self._lost.add(key)
            raise EnvError(f"episode {key!r}: {op}() failed: {error}") from None

    async def _replace_finished(self) -> None:
        """Replace each process that died, or that retired and holds no episode any more (off the event loop)."""
        with self._lock:
            finished = [i for i, p in enumerate(self._processes) if not p.replacing
                        and (not p.alive() or p.retiring) and not (p.alive() and p.episodes)]
            for index in finished:
                self._processes[index].replacing = True  # claimed: replaced once, below
                self._processes[index].dead = True  # takes no call meanwhile
        for index in finished:
            old = self._processes[index]
            fresh = await asyncio.get_running_loop().run_in_executor(None, self._start)
            old.kill()
            with self._lock:
                self._processes[index] = fresh
                self.num_restarts += 1
                for key in [k for k, p in self._owner.items() if p is old]:  # a dead one's: lost, not waited for
                    self._lost.add(key)

    @property
    def num_episodes(self) -> int:
        with self._lock:
            return len(self._owner)

    def close_pool(self) -> None:
        """Stop every process (a second call does nothing)."""
        for process in self._processes:
            if process.process.poll() is None:
                process.kill()


__all__ = ["EnvError", "EnvPool"]
