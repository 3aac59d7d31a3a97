"""The two ways a cluster's workers run: Ray actors, or objects in the driver's process.

Both offer the same four operations (create a host, submit a method call, wait for results, kill),
so dispatch, collection and errors are written once. Every wait has a timeout; a failure becomes
a `WorkerError` naming the cluster, rank, method and the remote traceback.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from baton.distributed.errors import CallTimeoutError, LayoutError, WorkerDiedError, WorkerError
from baton.distributed.host import WorkerHost


@dataclass(frozen=True)
class Source:
    """Who produces a result: named in every error about it."""

    cluster: str
    rank: int
    method: str

    def __str__(self) -> str:
        return f"{self.cluster}[rank {self.rank}].{self.method}"


DeadCheck = Callable[[], "tuple[int, str] | None"]


# --- local -----------------------------------------------------------------------------------


class LocalRef:
    """A finished local call: its value, or the exception it raised."""

    __slots__ = ("value", "error", "remote_traceback")

    def __init__(self, value=None, error: BaseException | None = None, remote_traceback: str = ""):
        self.value, self.error, self.remote_traceback = value, error, remote_traceback


class LocalBackend:
    """Runs every call at once, in the driver's thread, so `breakpoint()` in a worker method works.

    Timeouts cannot interrupt a call in the caller's own thread; they are accepted and unused.
    """

    name = "local"

    def create_host(self, name: str, options: dict) -> WorkerHost:
        return WorkerHost(sets_environment=False)

    def submit(self, host: WorkerHost, method: str, *args, num_returns: int = 1):
        try:
            value = getattr(host, method)(*args)
        except Exception as exc:
            ref = LocalRef(error=exc, remote_traceback=traceback.format_exc())
            return (ref,) * num_returns if num_returns > 1 else ref
        if num_returns > 1:
            return tuple(LocalRef(v) for v in value)
        return LocalRef(value)

    def get(self, refs: Sequence[LocalRef], sources: Sequence[Source], timeout_s: float, dead_check: DeadCheck | None = None) -> list:
        for ref, source in zip(refs, sources):
            if ref.error is not None:
                raise WorkerError(source.cluster, source.rank, source.method, ref.remote_traceback) from ref.error
        return [ref.value for ref in refs]

    def wait_started(self, hosts, sources, timeout_s: float) -> None:
        pass

    def kill(self, host: WorkerHost) -> None:
        pass


# --- ray -------------------------------------------------------------------------------------

_RAY_HOST_CLASS = None


def _ray_host_class():
    """The Ray actor class around `WorkerHost` (made on first use, so importing baton does not import Ray)."""
    global _RAY_HOST_CLASS
    if _RAY_HOST_CLASS is None:
        import ray

        _RAY_HOST_CLASS = ray.remote(WorkerHost)
    return _RAY_HOST_CLASS


class RayBackend:
    name = "ray"
    poll_s = 0.5  # how often a pending wait looks for failed or dead workers

    def create_host(self, name: str, options: dict):
        return _ray_host_class().options(name=name, **options).remote(sets_environment=True)

    def submit(self, actor, method: str, *args, num_returns: int = 1):
        remote_method = getattr(actor, method)
        if num_returns != 1:
            remote_method = remote_method.options(num_returns=num_returns)
        return remote_method.remote(*args)

    def get(self, refs: Sequence, sources: Sequence[Source], timeout_s: float, dead_check: DeadCheck | None = None) -> list:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        refs = list(refs)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                return ray.get(refs, timeout=max(0.0, min(self.poll_s, remaining)))
            except GetTimeoutError:
                pass
            except RayError:
                pass  # find out which worker failed, below
            self._raise_first_failure(refs, sources)
            if dead_check is not None and (dead := dead_check()) is not None:
                rank, reason = dead
                pending = [s for r, s in zip(refs, sources) if s.rank == rank] or list(sources)
                raise WorkerDiedError(pending[0].cluster, rank, pending[0].method, reason)
            if time.monotonic() >= deadline:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                done = set(ready)
                waiting = [str(s) for r, s in zip(refs, sources) if r not in done]
                raise CallTimeoutError(
                    f"{len(waiting)} call(s) still running after {timeout_s:.0f} s: {', '.join(waiting[:8])}; "
                    "raise the cluster's call_timeout_s if this step is expected to take longer"
                )

    def _raise_first_failure(self, refs: list, sources: Sequence[Source]) -> None:
        import ray
        from ray.exceptions import RayActorError, RayError, RayTaskError

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_set = set(ready)
        for ref, source in zip(refs, sources):
            if ref not in ready_set:
                continue
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                raise WorkerDiedError(source.cluster, source.rank, source.method, _died_reason(exc)) from None
            except RayTaskError as exc:
                raise WorkerError(source.cluster, source.rank, source.method, str(exc)) from exc.cause
            except RayError as exc:
                raise WorkerError(source.cluster, source.rank, source.method, repr(exc)) from exc

    def wait_started(self, actors: Sequence, sources: Sequence[Source], timeout_s: float) -> None:
        """Wait until every actor is scheduled and its process is up; say why if one can't be placed."""
        import ray

        from ray.exceptions import ActorUnschedulableError

        refs = [actor.ping.remote() for actor in actors]
        advice = ("Reserve fewer device slots (ResourceManager num_devices_per_node) or ask for fewer CPUs per worker.")
        try:
            self.get(refs, sources, timeout_s)
        except WorkerError as exc:
            if isinstance(exc.__cause__, ActorUnschedulableError):
                raise LayoutError(
                    f"cluster {exc.cluster!r}: rank {exc.rank} cannot be placed on this Ray cluster: {exc.__cause__}. "
                    f"Free resources: {ray.available_resources()}. {advice}"
                ) from None
            raise
        except CallTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            stuck = [str(s.rank) for r, s in zip(refs, sources) if r not in set(ready)]
            raise CallTimeoutError(
                f"cluster {sources[0].cluster!r}: rank(s) {', '.join(stuck)} not started after {timeout_s:.0f} s. "
                f"Ray could not place them; free resources: {ray.available_resources()}. {advice}"
            ) from None

    def kill(self, actor) -> None:
        import ray

        ray.kill(actor, no_restart=True)


def _died_reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"worker process died: {text.splitlines()[0] if text else type(exc).__name__}"


class HealthMonitor:
    """Pings a cluster's actors in a background thread and remembers the first one that died.

    A pending call asks `check()` between polls, so a killed worker surfaces within seconds even
    while the driver is waiting on it. Each actor has at most one ping outstanding: a busy actor's
    ping waits its turn behind the running call (it is not taken for dead), while a dead actor's
    ping fails as soon as Ray learns the process is gone.
    """

    def __init__(self, actors: Sequence, interval_s: float):
        self._actors = list(actors)
        self._interval_s = interval_s
        self._dead: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="baton-health", daemon=True)
        self._thread.start()

    def check(self) -> tuple[int, str] | None:
        return self._dead

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval_s + 1.0)

    def _run(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        outstanding: dict = {}  # ping ref -> rank
        while not self._stop.is_set() and ray.is_initialized():
            pinged = set(outstanding.values())
            for rank, actor in enumerate(self._actors):
                if rank not in pinged:
                    outstanding[actor.ping.remote()] = rank
            ready, _ = ray.wait(list(outstanding), num_returns=len(outstanding), timeout=self._interval_s)
            for ref in ready:
                rank = outstanding.pop(ref)
                try:
                    ray.get(ref, timeout=0)
                except RayActorError as exc:
                    self._dead = (rank, _died_reason(exc))
                    return
            self._stop.wait(self._interval_s)


BACKENDS: dict[str, Any] = {"local": LocalBackend(), "ray": RayBackend()}


def get_backend(name: str):
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid: {sorted(BACKENDS)}") from None
