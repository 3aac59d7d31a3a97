"""`Router`: spreads generation requests over the engine pool, and keeps the pool serving when an engine fails.

Each request goes to the live engine with the fewest outstanding requests (ties: the lowest index), or, with an
affinity key (a multi-turn conversation's id), to the engine that served that key before, so the conversation
stays on one engine's prefix cache. One thread per engine polls it for finished results and checks its health
every `health_interval_s`. An engine whose worker dies, freezes, or reports a failed step is taken out: its
requests in flight go to the other engines (from their start; a request is retried at most `max_retries` times),
and it is restarted (`Cluster.restart`, then `on_restart(index)`, where the weight publisher gives it the current
weights) and taken back. Every request's future is settled exactly once. `metrics()` reports load per engine,
retries and restarts.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from baton.distributed import Cluster
from baton.engines.protocol import GenerationRequest, GenerationResult
from baton.rollout.engine_worker import RequestFailure
from baton.tracking import trace


def _unstarted(request: GenerationRequest) -> GenerationResult:
    """The abort result of a request no engine has started: its prefix, as given."""
    return GenerationResult(request.request_id, request.prefix_response_ids, request.prefix_log_probs,
                            request.prefix_weight_versions, -1, "abort")


class EngineFailedError(RuntimeError):
    """A request could not be served: it failed on `max_retries` + 1 engines, or no engine could be restarted."""


@dataclass
class _Request:
    request: GenerationRequest
    future: concurrent.futures.Future
    affinity_key: str | None
    engine: int | None = None  # None: waiting for a live engine
    attempts: int = 0
    sent: bool = False  # handed to its engine (else waiting in the engine's outbox)
    sent_at: float = 0.0  # when (time.time()), for the trace


@dataclass
class _EngineState:
    alive: bool = True
    outstanding: int = 0
    served: int = 0
    restarts: int = 0
    incarnation: int = 0  # bumped by each restart: a failure seen by a call to an earlier one is stale
    last_error: str | None = None
    outbox: list = field(default_factory=list)  # requests assigned and not yet sent; its thread sends them
    thread: threading.Thread | None = field(default=None, repr=False)


class Router:
    """Routes requests over `engines` (clusters of one `EngineWorker` each); see the module docstring.

    poll_s: how long one poll of an engine waits for a result. on_restart(index): called after engine `index`
    restarted, before it takes requests again (give it the current weights there).
    """

    def __init__(self, engines: Sequence[Cluster], *, poll_s: float = 0.02, health_interval_s: float = 5.0,
                 max_retries: int = 2, restart_engines: bool = True,
                 on_restart: Callable[[int], None] | None = None):
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.poll_s, self.health_interval_s, self.max_retries = poll_s, health_interval_s, max_retries
        self.restart_engines, self.on_restart = restart_engines, on_restart
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._state = [_EngineState() for _ in self.engines]
        self._affinity: dict[str, int] = {}
        self._num_retries = 0
        self._closed = threading.Event()
        for index, state in enumerate(self._state):
            state.thread = threading.Thread(target=self._pump, args=(index,), name=f"router-engine-{index}", daemon=True)
            state.thread.start()

    # --- requests ----------------------------------------------------------------------------------

    def submit(self, requests: Iterable[GenerationRequest],
               affinity_keys: Iterable[str | None] | None = None) -> list[concurrent.futures.Future]:
        """Route `requests` (one future each, settled with its `GenerationResult`); one call per engine. The futures
        cannot be cancelled (`cancel()` returns False): `abort` stops a request."""
        requests = list(requests)
        keys = list(affinity_keys) if affinity_keys is not None else [None] * len(requests)
        if len(keys) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(keys)} affinity keys")
        entries = []
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the router is closed")
            seen = set()
            for request in requests:  # all checked before any is taken, so a refused call leaves nothing behind
                if request.request_id in self._requests or request.request_id in seen:
                    raise ValueError(f"request {request.request_id!r} is already in flight; request ids must be unique")
                seen.add(request.request_id)
            for request, key in zip(requests, keys):
                entry = _Request(request, concurrent.futures.Future(), key)
                entry.future.set_running_or_notify_cancel()  # settled only by the router; stop a request with abort
                self._requests[request.request_id] = entry
                entries.append(entry)
            self._assign(entries)
            stranded = [] if self.restart_engines else self._take_stranded()
        self._fail(stranded, "no engine is alive and restart_engines is off")
        return [entry.future for entry in entries]

    def generate(self, request: GenerationRequest, affinity_key: str | None = None) -> concurrent.futures.Future:
        return self.submit([request], [affinity_key])[0]

    def abort(self, request_ids: Iterable[str], timeout_s: float = 120.0) -> list[GenerationResult]:
        """Stop these requests and return what each generated so far (finish_reason "abort"; "stop" or "length" for
        one that finished first), their futures settled with the same. Ids not in flight are skipped. Bounded: each
        engine answers at its next decode-step boundary, and no result is awaited longer than `timeout_s`."""
        by_engine: dict[int, list[str]] = {}
        futures = []
        with self._lock:
            for request_id in dict.fromkeys(request_ids):
                entry = self._requests.get(request_id)
                if entry is None:
                    continue
                futures.append(entry.future)
                if not entry.sent:  # waiting for a live engine, or in an outbox: nothing generated
                    del self._requests[request_id]
                    if entry.engine is not None:
                        self._state[entry.engine].outstanding -= 1
                    entry.future.set_result(_unstarted(entry.request))
                else:
                    by_engine.setdefault(entry.engine, []).append(request_id)
        for index, ids in by_engine.items():
            incarnation = self._state[index].incarnation
            try:
                partials = self.engines[index].abort(ids)
            except Exception as error:  # the engine is gone: its requests were moved; abort them there
                self._engine_failed(index, error, incarnation)
                self.abort(ids, timeout_s)
                continue
            for result in partials:
                self._settle(index, result)
        deadline = time.monotonic() + timeout_s
        return [future.result(max(0.0, deadline - time.monotonic())) for future in futures]

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._requests)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {"router/num_alive_engines": float(sum(s.alive for s in self._state)),
                   "router/retries": float(self._num_retries),
                   "router/restarts": float(sum(s.restarts for s in self._state)),
                   "router/num_in_flight": float(len(self._requests))}
            for index, state in enumerate(self._state):
                out[f"router/engine_{index}/outstanding"] = float(state.outstanding)
                out[f"router/engine_{index}/served"] = float(state.served)
            return out

    def close(self) -> None:
        """Stop the polling threads, and the engines' work on the requests still in flight (aborted there: the router
        does not own the engines, which may serve another router next); those requests fail with
        EngineFailedError."""
        self._closed.set()
        for state in self._state:
            if state.thread is not None:
                state.thread.join(timeout=self.poll_s + 10)
        with self._lock:
            entries, self._requests = list(self._requests.values()), {}
        by_engine: dict[int, list[str]] = {}
        for entry in entries:
            if entry.sent and self._state[entry.engine].alive:
                by_engine.setdefault(entry.engine, []).append(entry.request.request_id)
        for index, ids in by_engine.items():
            try:  # each call bounded by the cluster's call timeout; the results polled out, so none is left queued
                self.engines[index].abort(ids)
                self.engines[index].poll(0.0)
            except Exception:  # a dead engine generates nothing
                pass
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(EngineFailedError("the router was closed with the request in flight"))

    # --- placement ---------------------------------------------------------------------------------

    def _assign(self, entries: list[_Request]) -> None:
        """Under the lock: an engine for each entry (none while no engine is alive), into its outbox."""
        for entry in entries:
            index = self._affinity.get(entry.affinity_key) if entry.affinity_key is not None else None
            if index is None or not self._state[index].alive:
                live = [i for i, s in enumerate(self._state) if s.alive]
                if not live:
                    continue  # waits for a restarted engine (`_restart`)
                index = min(live, key=lambda i: (self._state[i].outstanding, i))
                if entry.affinity_key is not None:
                    self._affinity[entry.affinity_key] = index
            entry.engine, entry.attempts, entry.sent = index, entry.attempts + 1, False
            self._state[index].outstanding += 1
            self._state[index].outbox.append(entry)

    def _flush(self, index: int) -> None:
        """Send engine `index` the requests in its outbox, in one call. The call is issued under the lock, so an
        abort (issued after it) reaches the engine after the requests it aborts."""
        with self._lock:
            state = self._state[index]
            batch, state.outbox = state.outbox, []
            batch = [e for e in batch if e.engine == index and self._requests.get(e.request.request_id) is e]
            now = time.time()
            for entry in batch:
                entry.sent, entry.sent_at = True, now
            call = self.engines[index].submit([entry.request for entry in batch]) if batch else None
        if call is not None:
            call.get()

    def _settle(self, index: int, item: GenerationResult | RequestFailure) -> bool:
        """Settle a request with what engine `index` returned for it; False for one no longer in flight there (a
        duplicate, or a request moved to another engine)."""
        with self._lock:
            entry = self._requests.get(item.request_id)
            if entry is None or entry.engine != index:
                return False
            del self._requests[item.request_id]
            self._state[index].outstanding -= 1
            self._state[index].served += 1
        if (current := trace.tracer()) is not None:
            _trace_request(current, index, entry, item)
        if isinstance(item, RequestFailure):
            entry.future.set_exception(EngineFailedError(f"engine {index} failed request {item.request_id!r}: "
                                                         f"{item.error}"))
        else:
            entry.future.set_result(item)
        return True

    def _take_stranded(self) -> list[_Request]:
        """Under the lock: when no engine is alive, the requests waiting for one, taken out (to fail them)."""
        if any(s.alive for s in self._state):
            return []
        stranded = [e for e in self._requests.values() if e.engine is None]
        for entry in stranded:
            del self._requests[entry.request.request_id]
        return stranded

    @staticmethod
    def _fail(entries: list[_Request], reason: str) -> None:
        for entry in entries:
            entry.future.set_exception(EngineFailedError(f"request {entry.request.request_id!r}: {reason}"))

    # --- the engines' threads ----------------------------------------------------------------------

    def _pump(self, index: int) -> None:
        next_health = time.monotonic() + self.health_interval_s
        while not self._closed.is_set():
            if not self._state[index].alive:
                self._closed.wait(0.1)
                continue
            incarnation = self._state[index].incarnation
            try:
                self._flush(index)
                items = self.engines[index].poll(self.poll_s)
                step_failures = [i for i in items if isinstance(i, RequestFailure) and i.engine_failed]
                for item in items:
                    if item not in step_failures:
                        self._settle(index, item)
                if step_failures:  # its requests are not at fault: retried elsewhere, like a dead engine's
                    raise RuntimeError(f"engine {index} failed: {step_failures[0].error}")
                if time.monotonic() >= next_health:
                    next_health = time.monotonic() + self.health_interval_s
                    health = self.engines[index].health()
                    if not health.healthy:
                        raise RuntimeError(f"engine {index} reports a failure: {health.error}")
            except Exception as error:
                if self._closed.is_set():
                    return
                self._engine_failed(index, error, incarnation)

    def _engine_failed(self, index: int, error: BaseException, incarnation: int | None = None) -> None:
        """Take engine `index` out, move its requests to the live engines, and restart it (in its thread). A failure
        seen by a call to an earlier `incarnation` of the engine (one already restarted) is stale, and ignored."""
        with self._lock:
            state = self._state[index]
            if not state.alive or (incarnation is not None and incarnation != state.incarnation):
                return
            state.alive, state.outstanding, state.outbox = False, 0, []
            state.last_error = "".join(traceback.format_exception_only(type(error), error)).strip()
            moved = [entry for entry in self._requests.values() if entry.engine == index]
            failed = []
            for entry in moved:
                entry.engine = None
                if entry.attempts > self.max_retries:
                    failed.append(entry)
            for entry in failed:
                del self._requests[entry.request.request_id]
            retried = [entry for entry in moved if entry not in failed]
            self._num_retries += len(retried)
            self._assign(retried)
            stranded = [] if self.restart_engines else self._take_stranded()
        for entry in failed:
            entry.future.set_exception(EngineFailedError(
                f"request {entry.request.request_id!r} failed on {entry.attempts} engine(s); the last, engine {index}: "
                f"{state.last_error}"))
        self._fail(stranded, f"no engine is alive and restart_engines is off; engine {index}: {state.last_error}")
        if self.restart_engines and threading.current_thread() is state.thread:
            self._restart(index)
        elif self.restart_engines:
            threading.Thread(target=self._restart, args=(index,), daemon=True).start()

    def _restart(self, index: int) -> None:
        try:
            self.engines[index].restart()
            if self.on_restart is not None:
                self.on_restart(index)
        except Exception as error:
            with self._lock:
                self._state[index].last_error = f"restart failed: {error!r}"
                stranded = self._take_stranded()
            self._fail(stranded, f"no engine is alive: engine {index} could not be restarted: {error!r}")
            return
        with self._lock:
            self._state[index].incarnation += 1
            self._state[index].alive = True
            self._state[index].restarts += 1
            self._assign([e for e in self._requests.values() if e.engine is None])


def _trace_request(current: trace.Tracer, index: int, entry: _Request, item: GenerationResult | RequestFailure) -> None:
    """A traced sample's request on engine `index`'s track: from its hand-over to the engine to its result (its CPU
    time counted into the tracer's cost)."""
    start, counted = time.thread_time(), current.cost_s
    try:
        _record_request(current, index, entry, item)
    finally:  # what its span already counted, once
        current.cost_s += time.thread_time() - start - (current.cost_s - counted)


def _record_request(current: trace.Tracer, index: int, entry: _Request,
                    item: GenerationResult | RequestFailure) -> None:
    sample, group, evaluation = trace.request_sample(entry.request.request_id)
    if not current.traced(group):
        return
    args = {"sample": sample, "group": group, "request_id": entry.request.request_id, "attempt": entry.attempts}
    if evaluation:
        args["eval"] = True
    if isinstance(item, RequestFailure):
        args["error"] = str(item.error)[:200]
    else:
        made = [v for v in item.weight_versions[len(entry.request.prefix_response_ids):] if v >= 0]
        args.update(finish=item.finish_reason, tokens=len(item.response_ids), versions=[min(made), max(made)] if made
                    else [])
    current.span(f"engine {index}", "eval request" if evaluation else "request", entry.sent_at or time.time(),
                 time.time(), **args)
