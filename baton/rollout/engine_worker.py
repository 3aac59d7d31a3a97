"""`EngineWorker`: one inference engine of the rollout system's pool, served request by request from a worker.

A worker's methods run one at a time, so none of them waits on generation: `submit` hands requests to the engine
and returns, and `abort`, `pause`, weights and health go in between; `poll` returns the results finished since the
last poll (waiting at most `max_wait_s` for one) in a thread of its own, so it holds none of them up. The engine
runs on an event loop in a thread of its own (`LoopThread`), so it keeps generating between calls. Each engine is a
cluster of one worker (a tensor-parallel vLLM engine is one worker over several GPUs), so the router can take out
and restart one without the others.
"""

from __future__ import annotations

import functools
import queue
import time
from dataclasses import dataclass

from baton.data import DataProto
from baton.data.shards import WeightShards
from baton.config import import_object
from baton.distributed import Dispatch, Worker, register
from baton.engines.protocol import EngineHealth, GenerationRequest, GenerationResult, ServedEngine
from baton.strategy import StrategyConfig
from baton.strategy.capabilities import backends_that, capabilities
from baton.strategy.logprobs import sampling_temperature
from baton.workers import sync_group
from baton.workers.weight_sync import assembled_buckets

CONTROL_TIMEOUT_S = 120.0  # abort, pause, health, sleep: each returns at a decode-step boundary
WEIGHT_SYNC_TIMEOUT_S = 600.0  # one weight update, copies included


@dataclass(frozen=True)
class RequestFailure:
    """A request the engine refused or failed on: `error` says why. `engine_failed`: the engine's step raised (or
    it serves nothing more), not the request's fault; False for a request the engine refused (a ValueError)."""

    request_id: str
    error: str
    engine_failed: bool = False


class EngineWorker(Worker):
    """The engine that a rollout role's backend builds for serving (`Capabilities.engine`, e.g. the `hf` engine over
    the model alone, no strategy around it, or `vllm`), with the log-probs of the sync probe beside it
    (`compute_log_probs`, scored between two of its steps)."""

    def __init__(self, config: StrategyConfig, max_num_seqs: int = 256):
        engine = capabilities(config.name).engine
        if engine is None:
            raise ValueError(f"a rollout engine runs on a backend that serves requests "
                             f"({', '.join(backends_that('serves_requests'))}), not {config.name!r}; set "
                             "rollout.strategy.name")
        self.served: ServedEngine = import_object(engine)(config, max_num_seqs)
        self.engine, self.runner = self.served.engine, self.served.runner
        self._done: queue.Queue = queue.Queue()  # results and failures, filled by the loop thread

    # --- requests ----------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL_ONE, blocking=False)
    def submit(self, requests: list[GenerationRequest]) -> None:
        """Start generating `requests`; their results come out of `poll`. The cluster call returns at once (a
        future), so that the router can issue it while it holds its lock. The requests start on the engine's loop
        in one go (no task or thread hand-off for each: at a thousand requests a step, those cost more than the
        decoding of a tiny model)."""
        self.runner.call_soon(self._start, requests)

    def _start(self, requests: list[GenerationRequest]) -> None:
        """On the engine's loop: each request started, its result (or failure) put in `_done` when it settles."""
        for request in requests:
            try:
                future = self.engine.start(request)
            except Exception as error:  # refused (ValueError), or the engine serves no more
                self._done.put(RequestFailure(request.request_id, repr(error),
                                              engine_failed=not isinstance(error, ValueError)))
                continue
            future.add_done_callback(functools.partial(self._finished, request.request_id))

    def _finished(self, request_id: str, future) -> None:
        try:
            self._done.put(future.result())
        except BaseException as error:  # a failed step: the router decides what to do
            self._done.put(RequestFailure(request_id, repr(error), engine_failed=True))

    @register(Dispatch.ONE_TO_ALL_ONE, own_thread=True)
    def poll(self, max_wait_s: float = 0.05) -> list[GenerationResult | RequestFailure]:
        """What finished since the last poll and over the next `max_wait_s`: one call per window, however many
        requests finish in it, so that polling a busy engine does not take its process's time from generation. It
        waits in a thread of its own, so the calls issued meanwhile (submit, abort, weights, the probe) do not."""
        items, deadline = [], time.monotonic() + max_wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                items.append(self._done.get(timeout=left))
            except queue.Empty:
                break
        return items

    @register(Dispatch.ONE_TO_ALL_ONE)
    def abort(self, request_ids: list[str]) -> list[GenerationResult]:
        """Stop these requests and return what each generated so far (they also come out of `poll` once)."""
        return self.runner.run(self.engine.abort(request_ids), CONTROL_TIMEOUT_S)

    # --- control -----------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL_ONE)
    def health(self) -> EngineHealth:
        return self.runner.run(self.engine.health(), CONTROL_TIMEOUT_S)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def pause(self) -> None:
        self.runner.run(self.engine.pause(), CONTROL_TIMEOUT_S)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def resume(self) -> None:
        self.runner.run(self.engine.resume(), CONTROL_TIMEOUT_S)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def weight_version(self) -> int:
        return self.engine.weight_version

    @register(Dispatch.ONE_TO_ALL)
    def import_weights(self, shards: list[WeightShards], version: int | None = None,
                       fingerprints: bool = False) -> dict[str, int] | None:
        """Load every source rank's `ModelWorker.export_weights` in place, a bucket (of every rank) at a time, between
        decode steps, as weight `version` (None: the engine's + 1). Requests in flight go on with the new weights.
        fingerprints: then return those of the weights this call completed, computed once loaded
        (`weight_fingerprints`)."""
        version = self.engine.weight_version + 1 if version is None else version
        loaded = []
        buckets = assembled_buckets(shards, getattr(self.engine, "model", None), loaded)  # hf's: pieces copied in
        self.runner.run(self.engine.update_weights(buckets, version), timeout_s=WEIGHT_SYNC_TIMEOUT_S)
        return self.weight_fingerprints(loaded) if fingerprints else None

    @register(Dispatch.ONE_TO_ALL)
    def join_sync_group(self, group: str, address: tuple[str, int], on_one_node: bool, as_source: bool,
                        num_sources: int, num_destinations: int) -> None:
        """Join a weight sync's process groups as a destination (`baton.workers.sync_group.join`)."""
        if as_source:
            raise ValueError("an engine serves the weights a sync sends it; it is no sync's source")
        sync_group.join(group, address, on_one_node, None, self.rank, num_sources, num_destinations)

    @register(Dispatch.ONE_TO_ALL)
    def weight_fingerprints(self, names: list[str]) -> dict[str, int] | None:
        """The fingerprints of the named weights the engine serves, computed between two of its steps (None: this
        backend's engine computes none)."""
        if self.served.fingerprints is None:
            return None
        return self.served.fingerprints(names)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def weight_dtype(self) -> str | None:
        """The dtype of the engine's floating weights, which a sync into it sends (None: as the source holds them)."""
        return self.served.weight_dtype

    @register(Dispatch.ONE_TO_ALL)
    def share_weights_with(self, role: str, version: int) -> None:
        """Serve the weights of training role `role`'s worker in this process (`colocate_actor_rollout`) as weight
        `version`: the engine's parameters point at its tensors, nothing is copied."""
        if self.served.share_weights is None:
            raise ValueError(f"this rollout backend's engine holds its own copy of the weights and cannot share the "
                             f"{role}'s; set colocate_actor_rollout: false")
        self.served.share_weights(self.colocated_worker(role).strategy, version)

    @register(Dispatch.DP_COMPUTE)
    def compute_log_probs(self, batch: DataProto) -> DataProto:
        """The sync probe: log-probs of given responses by the engine's weights (see `ModelUpdatePair.check`), scored
        between two of the engine's steps (its requests in flight wait one forward pass; nothing else is held)."""
        return self.served.log_probs(batch, sampling_temperature(batch))

    @register(Dispatch.ONE_TO_ALL)
    def offload(self) -> None:
        """The engine's sleep (GPU memory released; on CPU only steps held): no request may be in flight."""
        self.runner.run(self.engine.sleep(), CONTROL_TIMEOUT_S)

    @register(Dispatch.ONE_TO_ALL)
    def reload(self) -> None:
        self.runner.run(self.engine.wake_up(), CONTROL_TIMEOUT_S)
