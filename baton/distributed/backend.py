"""The two ways a cluster's workers run: Ray actors, or objects in the driver's process.

Both offer the same four operations (create a host, submit a method call, wait for results, kill),
so dispatch, collection and errors are written once. Every wait has a timeout; a failure becomes
a `WorkerError` naming the cluster, rank, method and the remote traceback. On Ray, a wait watched
by the cluster's `HealthMonitor` also fails on a dead or frozen worker, and stops the cluster.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

from baton.distributed.errors import CallTimeoutError, ClusterStoppedError, LayoutError, WorkerDiedError, WorkerError
from baton.distributed.health import HealthMonitor, died_reason
from baton.distributed.host import WorkerHost


@dataclass(frozen=True)
class Source:
    """Who produces a result: named in every error about it."""

    cluster: str
    rank: int
    method: str

    def __str__(self) -> str:
        return f"{self.cluster}[rank {self.rank}].{self.method}"


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

    def get(self, refs: Sequence[LocalRef], sources: Sequence[Source], timeout_s: float, guard: HealthMonitor | None = None) -> list:
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
    """The Ray actor class around `WorkerHost` (made on first use, so importing baton does not import Ray).

    Calls run in Ray's default concurrency group, one at a time and in submission order; the
    heartbeat has a group (a thread) of its own, so it is answered while a call runs, and so do the
    `own_thread` methods (a long poll), so that the calls behind them do not wait.
    """
    global _RAY_HOST_CLASS
    if _RAY_HOST_CLASS is None:
        import ray

        class RayWorkerHost(WorkerHost):
            @ray.method(concurrency_group="heartbeat")
            def heartbeat(self) -> bool:
                return super().heartbeat()

            @ray.method(concurrency_group="own_thread")
            def call_own_thread(self, request: list):
                return super().call_own_thread(request)

        _RAY_HOST_CLASS = ray.remote(concurrency_groups={"heartbeat": 1, "own_thread": 1})(RayWorkerHost)
    return _RAY_HOST_CLASS


class RayBackend:
    name = "ray"
    poll_s = 0.5  # how often a pending wait looks for failed, dead or frozen workers

    def create_host(self, name: str, options: dict):
        return _ray_host_class().options(name=name, **options).remote(sets_environment=True)

    def submit(self, actor, method: str, *args, num_returns: int = 1):
        remote_method = getattr(actor, method)
        if num_returns != 1:
            remote_method = remote_method.options(num_returns=num_returns)
        return remote_method.remote(*args)

    def get(self, refs: Sequence, sources: Sequence[Source], timeout_s: float, guard: HealthMonitor | None = None) -> list:
        """The results of `refs`, or the first error among them.

        With a `guard` (the cluster's monitor), a dead or frozen worker fails the wait within the
        monitor's bounds, and a dead, frozen or timed-out call halts the guard: every process of the
        cluster is killed, since Ray cannot interrupt a running call and later calls would queue
        behind it. The error says so. A method that raised leaves the cluster running.
        """
        import ray
        from ray.exceptions import RayError

        refs = list(refs)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(refs, timeout=max(0.0, min(self.poll_s, deadline - time.monotonic())))
            except RayError:  # GetTimeoutError included; find out what went wrong, below
                pass
            if guard is not None and guard.stopped_reason is not None:
                raise ClusterStoppedError(
                    f"{sources[0]}: the result is lost: cluster {sources[0].cluster!r}'s worker processes were "
                    f"stopped {guard.stopped_reason}"
                )
            note = _STOPPED_NOTE if guard is not None else ""
            error = self._first_failure(refs, sources, note)
            if error is not None and not isinstance(error, WorkerDiedError) and guard is not None:
                error = self._died_peer(refs, sources, note, guard) or error
            if error is None and guard is not None and (lost := guard.check()) is not None:
                source = next((s for s in sources if s.rank == lost.rank), sources[0])
                error = lost.error(source.cluster, source.method, note)
            halt_reason = f"after {error.cluster}[rank {error.rank}].{error.method} {error.what}" if error else ""
            if error is None and time.monotonic() >= deadline:
                error, first_pending = self._timeout_error(refs, sources, timeout_s, note)
                halt_reason = f"after {first_pending} timed out ({timeout_s:g} s)"
            if error is None:
                continue
            if guard is not None and isinstance(error, (WorkerDiedError, CallTimeoutError)):  # not for a method that raised
                guard.halt(halt_reason)
            raise error

    def _first_failure(self, refs: list, sources: Sequence[Source], note: str,
                       died_only: bool = False) -> WorkerError | None:
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
                reason = died_reason(exc) + (f"; {note}" if note else "")
                return WorkerDiedError(source.cluster, source.rank, source.method, reason)
            except RayTaskError as exc:
                if died_only:
                    continue
                error = WorkerError(source.cluster, source.rank, source.method, str(exc))
                error.__cause__ = exc.cause
                return error
            except RayError as exc:
                if died_only:
                    continue
                error = WorkerError(source.cluster, source.rank, source.method, repr(exc))
                error.__cause__ = exc
                return error
        return None

    def _died_peer(self, refs: list, sources: Sequence[Source], note: str, guard: HealthMonitor) -> WorkerError | None:
        """A worker that died while another raised, found within the guard's bound, or None.

        A rank killed inside a collective makes its peers' collectives raise (gloo: "Connection reset by
        peer") before the monitor sees the death; the death is the cause to report. Only waited for while some
        call is still pending: a method that raised on every rank is reported at once.
        """
        import ray

        deadline = time.monotonic() + guard.death_bound_s
        while True:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            if (lost := guard.check()) is not None:
                source = next((s for s in sources if s.rank == lost.rank), sources[0])
                return lost.error(source.cluster, source.method, note)
            died = self._first_failure(refs, sources, note, died_only=True)
            if died is not None or not pending or time.monotonic() >= deadline:
                return died
            time.sleep(0.05)

    @staticmethod
    def _timeout_error(refs: list, sources: Sequence[Source], timeout_s: float, note: str) -> tuple[CallTimeoutError, str]:
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        pending = [str(s) for r, s in zip(refs, sources) if r not in done] or [str(sources[0])]
        message = (f"{len(pending)} call(s) still running after {timeout_s:g} s: {', '.join(pending[:8])}; "
                   "raise the cluster's call_timeout_s if this step is expected to take longer")
        if note:
            message += f". Ray cannot interrupt a running call, so {note}"
        return CallTimeoutError(message), pending[0]

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
                f"cluster {sources[0].cluster!r}: rank(s) {', '.join(stuck)} not started after {timeout_s:g} s. "
                f"Ray could not place them; free resources: {ray.available_resources()}. {advice}"
            ) from None

    def kill(self, actor) -> None:
        import ray

        ray.kill(actor, no_restart=True)


_STOPPED_NOTE = ("the cluster's worker processes were stopped (their state is lost); "
                 "call restart() on the cluster to start fresh ones")


BACKENDS: dict[str, Any] = {"local": LocalBackend(), "ray": RayBackend()}


def get_backend(name: str):
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid: {sorted(BACKENDS)}") from None
