"""What an inference engine is: request-level async generation, and the typed records that cross its boundary.

An engine serves one request per sample: `await engine.generate(request)` returns that sample's tokens and
log-probs, and any number of requests may be in flight at once (the engine batches them continuously). A
prompt's several samples are several requests with the same prompt ids (and their own seeds); an engine may
share their prefill (the `hf` engine does for requests admitted together; vLLM's prefix cache does). One
sample per request keeps abort, resume and per-sample weight versions simple: each has one answer.

An engine does only what serving does: no training, checkpoints or export. The log-probs of given tokens (the
weight-sync probe) are not in the protocol: a backend's engine factory supplies them beside it (`ServedEngine`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Protocol, runtime_checkable

import torch

from baton.data import DataProto
from baton.engines.loop import LoopThread
from baton.strategy.base import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate.

    prompt_ids: the prompt's token ids, unpadded.
    params: sampling; `params.n` must be 1 (send n requests for n samples). `params.seed` seeds this
        request's own generator, so its tokens do not depend on what else is in flight; None: the
        engine picks a seed. `params.max_new_tokens` bounds the whole response, prefix included.
        `params.stop_token_ids` None: the tokenizer's eos.
    prefix_response_ids / prefix_log_probs / prefix_weight_versions: a resumed request (slime's partial
        rollout): the response generated so far, e.g. by an aborted request (see `resumed`). The model
        continues from prompt_ids + prefix_response_ids; the result holds the whole response, the
        prefix's log-probs and versions carried as given. Empty for a fresh request.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    prefix_response_ids: tuple[int, ...] = ()
    prefix_log_probs: tuple[float, ...] = ()
    prefix_weight_versions: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("prompt_ids", "prefix_response_ids", "prefix_log_probs", "prefix_weight_versions"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # lists and tensors' tolist() accepted
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt; an engine needs at least one token")
        if self.params.n != 1:
            raise ValueError(f"request {self.request_id!r} asks for n={self.params.n} samples; one request is one "
                             f"sample: send {self.params.n} requests (with their own seeds) for the same prompt")
        num_prefix = len(self.prefix_response_ids)
        if len(self.prefix_log_probs) != num_prefix or len(self.prefix_weight_versions) != num_prefix:
            raise ValueError(f"request {self.request_id!r}: prefix_response_ids, prefix_log_probs and "
                             f"prefix_weight_versions must have one entry per token, got {num_prefix}, "
                             f"{len(self.prefix_log_probs)} and {len(self.prefix_weight_versions)}")
        if num_prefix >= self.params.max_new_tokens:
            raise ValueError(f"request {self.request_id!r} resumes a response of {num_prefix} tokens, but "
                             f"max_new_tokens={self.params.max_new_tokens} bounds the whole response: it is finished")

    def resumed(self, partial: "GenerationResult") -> "GenerationRequest":
        """This request continued from `partial` (an aborted result of it): same id, prompt and params."""
        if partial.request_id != self.request_id:
            raise ValueError(f"result {partial.request_id!r} is not of request {self.request_id!r}")
        if partial.finish_reason != "abort":
            raise ValueError(f"request {self.request_id!r} finished ({partial.finish_reason!r}); only an aborted "
                             "result can be resumed")
        return dataclasses.replace(self, prefix_response_ids=partial.response_ids, prefix_log_probs=partial.log_probs,
                                   prefix_weight_versions=partial.weight_versions)


@dataclass(frozen=True)
class GenerationResult:
    """One sample, finished or aborted.

    response_ids: the whole response (a resumed request's prefix first); with finish_reason "stop" the
        last token is the stop token.
    log_probs: log p(token) per response token at the request's sampling temperature, before top-k/top-p
        filtering (what a trainer recomputes at that temperature); greedy (temperature 0) reports
        temperature-1 log-probs. float32 values.
    weight_versions: per token, the `weight_version` of the weights whose forward pass gave the distribution
        it was sampled from. Weights may change while a request runs (`update_weights` between decode
        steps); the tokens after the change come from the new weights, over a KV cache the old ones computed.
    weight_version: the version at finish (of the last token, or the engine's when no token was made).
    finish_reason: "stop" (a stop token), "length" (max_new_tokens), "abort" (`Engine.abort`).
    """

    request_id: str
    response_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    weight_versions: tuple[int, ...]
    weight_version: int
    finish_reason: FinishReason

    def __post_init__(self):
        assert len(self.response_ids) == len(self.log_probs) == len(self.weight_versions), "one entry per token"


@dataclass(frozen=True)
class EngineHealth:
    """What `Engine.health` reports. `error` is the failure that stopped the engine (healthy False), else None."""

    healthy: bool
    num_running: int  # requests in the running batch
    num_waiting: int  # requests not yet admitted
    paused: bool
    sleeping: bool
    weight_version: int
    error: str | None = None


@runtime_checkable
class Engine(Protocol):
    """An inference engine: async, request-level, continuously batched.

    Every method is a coroutine on the event loop that calls it; methods other than `generate` return
    at a decode-step boundary (the engine never changes state in the middle of a step).
    """

    @property
    def weight_version(self) -> int:
        """The version of the weights the next decode step uses: 0 as built, then `update_weights`'s."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample. Many calls may be in flight; an aborted request returns its partial result."""

    async def abort(self, request_ids: Iterable[str]) -> list[GenerationResult]:
        """Stop these requests now and return what each generated so far (finish_reason "abort"); their
        `generate` calls return the same results. Ids not in flight (unknown or finished) are skipped.
        Works while paused."""

    async def pause(self) -> None:
        """Return once no decode step runs, and run none until `resume`. Requests keep arriving and waiting."""

    async def resume(self) -> None: ...

    async def update_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """Load full parameters (any subset, in HF names, as `ModelStrategy.export_weights` yields them) between
        decode steps, and set `weight_version` to `version` (at least the current one). Every forward pass
        after this returns uses them. A token carries the version of the forward pass that computed its
        distribution, so a running request's first token after the update may still carry the old one."""

    async def sleep(self) -> None:
        """Release model and KV-cache memory (no request may be in flight; abort them first) and run nothing
        until `wake_up`. A documented no-op where the backend cannot release memory (e.g. on CPU)."""

    async def wake_up(self) -> None: ...

    async def health(self) -> EngineHealth: ...

    async def close(self) -> None:
        """Abort what is in flight (their `generate` calls return "abort" results) and release the engine's
        threads and memory; it serves nothing after."""


@dataclass(frozen=True)
class ServedEngine:
    """An engine with what serving it from a worker takes beside it: what a backend's engine factory builds
    (`Capabilities.engine`) and a rollout-system `EngineWorker` holds.

    engine: the `Engine`.
    runner: the event-loop thread every call to the engine runs on; the engine keeps generating there between calls.
    log_probs: `(batch, temperature) -> DataProto` with "log_probs" [rows, response_len]: the log-probs of the batch's
        given (right-padded) responses by the engine's current weights (the weight-sync probe; the `Engine` protocol
        does no scoring). Called from a worker thread; it runs between two of the engine's steps, so requests in
        flight wait for it and no weight load changes the model meanwhile.
    share_weights: `(strategy, version) -> None`: point the engine's parameters at the tensors of a training strategy
        of the same backend in this process (`Capabilities.shares_weights`: an engine colocated with an actor rank),
        as weight `version`, between two steps; nothing is copied and the actor's updates need no sync after. None:
        the engine holds its own copy of the weights.
    fingerprints: `(names) -> {name: fingerprint}` of the weights the engine serves (`baton.data.shards.fingerprint`),
        computed where they live between two steps: what a sync checks delivered. None: the engine computes none (the
        probe checks a sync).
    weight_dtype: the dtype of the engine's floating weights, which a sync sends ("float32", ...); None: as the
        source holds them.
    """

    engine: Engine
    runner: LoopThread
    log_probs: Callable[[DataProto, float], DataProto]
    share_weights: Callable[[Any, int], None] | None = None
    fingerprints: Callable[[list[str]], dict[str, int]] | None = None
    weight_dtype: str | None = None
