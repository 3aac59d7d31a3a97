"""The `hf` engine: the shipped sampling loop (`baton.strategy.sampling`) batched continuously, request by request.

One scheduler task on the caller's event loop runs decode steps in a one-thread executor, so the loop stays
free while the model runs. A step (1) prefills the requests that arrived since the last step, as one
left-padded group (equal prompts of the group run once), and merges their KV cache into the running batch's,
left-padding both to a common length; (2) samples one token for every row; (3) drops the finished rows;
(4) runs one decode forward for the rest. Everything that changes the batch (abort, weights, sleep) runs in
the same executor, between steps.

Numerics: every request samples with its own generator (seeded by `params.seed`), drawing from its own row's
distribution, so its tokens do not depend on what else runs: a sampled request equals a one-prompt
`HFStrategy.generate` call with that seed, and greedy requests equal one batch call (up to float rounding of
the different batch shapes, which can flip a near-tie).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from baton.engines.protocol import EngineHealth, GenerationRequest, GenerationResult
from baton.engines.serving import Sequence, ServingLoop
from baton.strategy.base import StrategyConfig
from baton.strategy.logprobs import cache_argument, position_ids_from_mask
from baton.strategy.sampling import filter_logits


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`tensor` with `width` columns of zeros before dim -2 (KV tensors [batch, heads, seq, dim]) or dim -1 (masks)."""
    if width == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, 0, width, 0) if tensor.dim() == 4 else (width, 0))


class _RunningBatch:
    """The rows being generated, in cache order, with their KV cache and the logits each samples its next token from.

    Used from the engine's executor thread only.
    """

    def __init__(self, model, pad_token_id: int, autocast):
        self.model, self.pad_token_id, self.autocast = model, pad_token_id, autocast
        self.cache_kwarg = cache_argument(model)
        self.rows: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.attention_mask: torch.Tensor | None = None  # [rows, cache_len], 0 on left padding
        self.next_position: torch.Tensor | None = None  # [rows, 1]
        self.logits: torch.Tensor | None = None  # [rows, vocab]
        self.logits_versions: list[int] = []  # per row: the weight version that computed its logits

    def admit(self, new: list[Sequence], version: int) -> None:
        """Prefill `new` as one left-padded group (equal inputs once) and merge it into the batch."""
        device = self.model.device
        inputs = [(*s.request.prompt_ids, *s.request.prefix_response_ids) for s in new]
        distinct = list(dict.fromkeys(inputs))
        width = max(len(x) for x in distinct)
        input_ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(distinct), width, dtype=torch.long)
        for i, ids in enumerate(distinct):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        position_ids = position_ids_from_mask(mask)  # [distinct, width]
        cache = DynamicCache()
        with self.autocast():
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=1,
                             use_cache=True, **{self.cache_kwarg: cache})
        index_of = {ids: i for i, ids in enumerate(distinct)}
        row_input = torch.tensor([index_of[ids] for ids in inputs], device=device)
        cache.batch_select_indices(row_input)
        self._merge(new, cache, mask[row_input], position_ids[row_input, -1:] + 1, out.logits[row_input, -1, :],
                    version)

    def _merge(self, new: list[Sequence], cache: DynamicCache, mask: torch.Tensor, next_position: torch.Tensor,
               logits: torch.Tensor, version: int) -> None:
        self.logits_versions += [version] * len(new)
        if not self.rows:
            self.rows, self.cache, self.attention_mask, self.next_position, self.logits = (
                list(new), cache, mask, next_position, logits)
            return
        ours, theirs = self.attention_mask.shape[1], mask.shape[1]
        width = max(ours, theirs)
        for mine, other in zip(self.cache.layers, cache.layers):
            assert isinstance(mine, DynamicLayer) and type(mine) is type(other), "full-attention dynamic layers only"
            mine.keys = torch.cat([_left_pad(mine.keys, width - ours), _left_pad(other.keys, width - theirs)])
            mine.values = torch.cat([_left_pad(mine.values, width - ours), _left_pad(other.values, width - theirs)])
        self.attention_mask = torch.cat([_left_pad(self.attention_mask, width - ours),
                                         _left_pad(mask, width - theirs)])
        self.next_position = torch.cat([self.next_position, next_position])
        self.logits = torch.cat([self.logits, logits])
        self.rows += new

    def sample(self) -> tuple[list[int], list[float]]:
        """One token per row from its logits, with its log-prob at the row's temperature (as `sampling.next_tokens`,
        but with each row's own generator)."""
        logits = self.logits.float()
        tokens = torch.empty(len(self.rows), dtype=torch.long, device=logits.device)
        log_probs = torch.empty(len(self.rows), dtype=torch.float32, device=logits.device)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(self.rows):
            p = row.request.params
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
        for (temperature, top_k, top_p), indices in groups.items():
            index = torch.tensor(indices, device=logits.device)
            group = logits if len(indices) == len(self.rows) else logits[index]
            if temperature == 0:
                chosen = group.argmax(-1)
            else:
                group = group / temperature
                probs = torch.softmax(filter_logits(group, top_k, top_p), -1)
                # torch.multinomial's own one-sample draw, argmax(p / q) with q ~ Exp(1) (the Gumbel trick), with
                # each row's q from its generator: the same token as a one-row multinomial call with that
                # generator, at a fifth of its cost per row. test_engines checks the equality.
                q = torch.empty_like(probs)
                for j, i in enumerate(indices):
                    q[j].exponential_(1, generator=self.rows[i].generator)
                chosen = (probs / q).argmax(-1)
            tokens[index] = chosen
            log_probs[index] = torch.log_softmax(group, -1).gather(-1, chosen[:, None]).squeeze(-1)
        return tokens.tolist(), log_probs.tolist()

    def keep(self, keep: list[int]) -> None:
        """Keep these rows (indices, in order) and drop the rest, with the padding columns no row needs any more."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.logits_versions = [], []
            self.cache = self.attention_mask = self.next_position = self.logits = None
            return
        index = torch.tensor(keep, device=self.attention_mask.device)
        self.cache.batch_select_indices(index)
        self.rows = [self.rows[i] for i in keep]
        self.logits_versions = [self.logits_versions[i] for i in keep]
        self.attention_mask, self.next_position, self.logits = (
            self.attention_mask[index], self.next_position[index], self.logits[index])
        unused = int(self.attention_mask.any(0).long().argmax())  # leading columns padding in every row
        if unused:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]
            self.attention_mask = self.attention_mask[:, unused:]

    def decode(self, tokens: list[int], version: int) -> None:
        """One forward of each row's last token: the logits of its next one."""
        input_ids = torch.tensor(tokens, device=self.attention_mask.device)[:, None]  # [rows, 1]
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(tokens), 1)], dim=1)
        with self.autocast():
            self.logits = self.model(input_ids=input_ids, attention_mask=self.attention_mask,
                                     position_ids=self.next_position, use_cache=True,
                                     **{self.cache_kwarg: self.cache}).logits[:, -1, :]
        self.next_position = self.next_position + 1
        self.logits_versions = [version] * len(tokens)


class HFEngine(ServingLoop):
    """Continuous batching over a transformers causal LM (see the module docstring); implements `Engine`.

    model: the causal LM, already on its device (the engine puts it in eval mode and owns it: do not run it
        elsewhere while the engine works). tokenizer: its pad and eos ids are used.
    seed: seeds the seeds of requests that bring none. max_num_seqs: rows in the running batch at most; more
        requests wait. compute_dtype: autocast dtype (mixed precision, as `StrategyConfig.compute_dtype`), or None.
    """

    def __init__(self, model, tokenizer, *, seed: int = 0, max_num_seqs: int = 256,
                 compute_dtype: torch.dtype | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.model = model.eval()
        self.device = next(model.parameters()).device

        def autocast():
            return (contextlib.nullcontext() if compute_dtype is None
                    else torch.autocast(self.device.type, dtype=compute_dtype))

        self._batch = _RunningBatch(self.model, tokenizer.pad_token_id, autocast)  # executor thread only
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
                   compute_dtype=config.mixed_precision_dtype, **kwargs)

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

    async def health(self) -> EngineHealth:
        return EngineHealth(self._error is None, self._num_running, len(self._waiting), self._paused, self._sleeping,
                            self._weight_version, None if self._error is None else repr(self._error))

    # --- the executor's work ------------------------------------------------------------------------

    @torch.no_grad()
    def _step(self, new: list[Sequence], cancelled: set[str]) -> list[GenerationResult]:
        """Admit `new`, drop `cancelled`, sample a token per row, drop the finished rows, decode the rest."""
        batch, version = self._batch, self._weight_version
        finished = self._abort_running(cancelled) if cancelled else []
        if new:
            batch.admit(new, version)
        if not batch.rows:
            return finished
        tokens, log_probs = batch.sample()
        keep = []
        for i, (row, token, log_prob) in enumerate(zip(batch.rows, tokens, log_probs)):
            row.response_ids.append(token)
            row.log_probs.append(log_prob)
            row.weight_versions.append(batch.logits_versions[i])
            if token in row.stop_token_ids:
                finished.append(row.result("stop", version))
            elif len(row.response_ids) == row.request.params.max_new_tokens:
                finished.append(row.result("length", version))
            else:
                keep.append(i)
        batch.keep(keep)
        if batch.rows:
            batch.decode([tokens[i] for i in keep], version)
        return finished

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
        names = set(self.model.state_dict())
        for bucket in buckets:
            unknown = set(bucket) - names
            if unknown:
                raise ValueError(f"weights {sorted(unknown)[:5]} do not exist in the engine's model; the two sides "
                                 "hold different architectures")
            self.model.load_state_dict({k: v.to(self.device) for k, v in bucket.items()}, strict=False)
        self._weight_version = version

    def _release(self) -> None:
        self.model.to("cpu")
        torch.cuda.empty_cache()

    def _retake(self) -> None:
        self.model.to(self.device)
