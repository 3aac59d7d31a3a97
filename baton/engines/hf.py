"""The `hf` engine: the shipped sampling loop (`baton.strategy.sampling.DecodeBatch`) driven request by request.

One scheduler task on the caller's event loop runs decode steps in a one-thread executor, so the loop stays
free while the model runs. Each step hands the requests that arrived since the last one to the running batch,
which prefills them between two decode steps and drops finished rows (see `DecodeBatch`). Everything that
changes the batch (abort, weights, sleep) runs in the same executor, between steps.

Numerics: every request samples with its own generator (seeded by `params.seed`), so its tokens do not depend
on what else runs. The batch `HFStrategy.generate` runs the same loop with row k's seed from
`sampling.row_seeds`: requests with those seeds give its tokens, sampled or greedy (greedy up to float rounding
of the different batch shapes, which can flip a near-tie).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from baton.data import DataProto
from baton.data.shards import fingerprint
from baton.engines.loop import LoopThread
from baton.engines.protocol import GenerationRequest, GenerationResult, ServedEngine
from baton.engines.serving import Sequence, ServingLoop
from baton.strategy.base import StrategyConfig
from baton.strategy.head import RLHead
from baton.strategy.logprobs import position_ids_from_mask
from baton.strategy.padding import pad_responses, trim_padding
from baton.strategy.sampling import DecodeBatch

PROBE_TIMEOUT_S = 120.0  # one forward pass of a few rows, after the step in flight


class HFEngine(ServingLoop):
    """Continuous batching over a transformers causal LM (see the module docstring); implements `Engine`.

    model: the causal LM, already on its device (the engine puts it in eval mode and owns it: do not run it
        elsewhere while the engine works). tokenizer: its pad and eos ids are used.
    seed: seeds the seeds of requests that bring none. max_num_seqs: rows in the running batch at most; more
        requests wait. compute_dtype: autocast dtype (mixed precision, as `StrategyConfig.compute_dtype`), or None.
    logprob_chunk_size: tokens per chunk when `log_probs` turns hidden states into log-probs (as
        `StrategyConfig.logprob_chunk_size`).
    """

    def __init__(self, model, tokenizer, *, seed: int = 0, max_num_seqs: int = 256,
                 compute_dtype: torch.dtype | None = None, logprob_chunk_size: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.model = model.eval()
        self.device = next(model.parameters()).device

        def autocast():
            return (contextlib.nullcontext() if compute_dtype is None
                    else torch.autocast(self.device.type, dtype=compute_dtype))

        self._autocast = autocast
        self._batch = DecodeBatch(self.model, tokenizer.pad_token_id, autocast)  # executor thread only
        self._head = RLHead(self.model, "causal_lm", logprob_chunk_size)  # log-probs as the strategies compute them
        super().__init__(ThreadPoolExecutor(1, thread_name_prefix="hf-engine"), model.config.vocab_size,
                         tokenizer.eos_token_id)
        self.max_num_running = max_num_seqs  # rows in the running batch at most
        self._seeds = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(cls, config: StrategyConfig, device: torch.device | None = None, **kwargs) -> "HFEngine":
        """The model and tokenizer of a role's `StrategyConfig`, built as the `hf` strategy builds them."""
        from baton.models import load_tokenizer
        from baton.strategy.hf import build_role_model, default_device

        if config.kind != "causal_lm":
            raise ValueError(f"an engine generates with a causal LM; this config's kind is {config.kind!r}")
        model = build_role_model(config).to(device or default_device())
        return cls(model, load_tokenizer(config.tokenizer), seed=config.seed,
                   compute_dtype=config.mixed_precision_dtype, logprob_chunk_size=config.logprob_chunk_size, **kwargs)

    name = "hf"

    def _new_sequence(self, request: GenerationRequest, stop_token_ids: frozenset[int],
                      future: asyncio.Future) -> Sequence:
        generator = None
        if request.params.temperature > 0:
            seed = request.params.seed
            seed = seed if seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
            generator = torch.Generator(self.device).manual_seed(seed)
        return Sequence(request, future, stop_token_ids, generator)

    @property
    def _releases_memory(self) -> bool:
        """On a GPU, sleep moves the model to CPU memory and frees the KV cache (empty: nothing may run). On CPU
        there is nothing to release (a no-op but for holding steps until `wake_up`)."""
        return self.device.type == "cuda"

    async def log_probs(self, batch: DataProto, temperature: float = 1.0) -> DataProto:
        """"log_probs" [rows, response_len] of the batch's given (right-padded) responses by the engine's weights at
        `temperature`, as the strategies' `forward` computes them, in the engine's step thread between two steps
        (the weight-sync probe)."""
        return await self.run_between_steps(self._log_probs, batch, temperature)

    # --- the executor's work ------------------------------------------------------------------------

    @torch.no_grad()
    def _log_probs(self, batch: DataProto, temperature: float) -> DataProto:
        batch, tail = trim_padding(batch)  # as the strategies run it: without its all-padding columns
        data = batch.batch
        attention_mask = data["attention_mask"].to(self.device)
        position_ids = (data["position_ids"].to(self.device) if "position_ids" in data
                        else position_ids_from_mask(attention_mask))
        with self._autocast():
            out = self._head(data["input_ids"].to(self.device), attention_mask, position_ids,
                             data["responses"].to(self.device), temperature, with_entropy=False)
        padded = pad_responses({"log_probs": out["log_probs"]}, tail)
        return DataProto.from_dict({"log_probs": padded["log_probs"].cpu()})

    def _step(self, new: list[Sequence], cancelled: set[str]) -> list[GenerationResult]:
        """Drop `cancelled`, then one `DecodeBatch.step`: admit `new`, a token per row, the finished rows out."""
        finished = self._abort_running(cancelled) if cancelled else []
        version = self._weight_version
        return finished + [row.result(reason, version) for row, reason in self._batch.step(new, version)]

    def _abort_running(self, request_ids: Iterable[str]) -> list[GenerationResult]:
        request_ids = set(request_ids)
        batch = self._batch
        keep = [i for i, row in enumerate(batch.rows) if row.request.request_id not in request_ids]
        aborted = [row for row in batch.rows if row.request.request_id in request_ids]
        batch.keep(keep)
        return [row.result("abort", self._weight_version) for row in aborted]

    @torch.no_grad()
    def _load_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """Buckets load one by one; a bucket naming a weight the model lacks raises ValueError, with the buckets
        before it loaded and the version unchanged."""
        from baton.strategy.hf import copy_weights

        for bucket in buckets:
            copy_weights(self.model, bucket, "the engine's model")
        self._weight_version = version

    async def fingerprints(self, names: list[str]) -> dict[str, int]:
        """`baton.data.shards.fingerprint` of each named weight the model serves, between two steps."""
        return await self._run(self._fingerprints, names)

    @torch.no_grad()
    def _fingerprints(self, names: list[str]) -> dict[str, int]:
        state = self.model.state_dict()
        return {name: fingerprint(state[name]) for name in names if name in state}

    async def share_weights(self, model: torch.nn.Module, version: int) -> None:
        """Point the engine's parameters at `model`'s tensors (a model of the same architecture in this process: an
        actor's), as weight `version`, between two steps: nothing is copied, and `model`'s in-place updates are the
        engine's too."""
        if version < self._weight_version:
            raise ValueError(f"weight version {version} is older than the engine's {self._weight_version}; versions "
                             "only go up")
        await self._run(self._share_weights, model, version)

    @torch.no_grad()
    def _share_weights(self, model: torch.nn.Module, version: int) -> None:
        theirs = dict(model.named_parameters())
        ours = dict(self.model.named_parameters())
        differ = sorted(n for n, p in ours.items() if n not in theirs or theirs[n].shape != p.shape)
        if differ:
            raise ValueError(f"cannot share weights: parameters {differ[:5]} differ between the engine's model and the "
                             "actor's; the two sides hold different architectures")
        for name, param in ours.items():
            param.data = theirs[name].data
        self._weight_version = version

    def _release(self) -> None:
        self.model.to("cpu")
        torch.cuda.empty_cache()

    def _retake(self) -> None:
        self.model.to(self.device)


def serve(config: StrategyConfig, max_num_seqs: int = 256) -> ServedEngine:
    """The `hf` backend's engine for the rollout system (its `Capabilities.engine`): the model built from a role's
    `StrategyConfig` as the `hf` strategy builds it, with no strategy around it (no optimizer, no training state); the
    sync probe's log-probs come from that model, between two of the engine's steps."""
    engine = HFEngine.from_config(config, max_num_seqs=max_num_seqs)
    runner = LoopThread("hf-engine")

    def log_probs(batch: DataProto, temperature: float) -> DataProto:
        return runner.run(engine.log_probs(batch, temperature), PROBE_TIMEOUT_S)

    def share_weights(strategy, version: int) -> None:  # an `hf` strategy's model in this process
        runner.run(engine.share_weights(strategy.hf_model, version), PROBE_TIMEOUT_S)

    def fingerprints(names: list[str]) -> dict[str, int]:
        return runner.run(engine.fingerprints(names), PROBE_TIMEOUT_S)

    return ServedEngine(engine, runner, log_probs, share_weights, fingerprints,
                        str(engine.model.dtype).removeprefix("torch."))
