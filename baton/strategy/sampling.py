"""The sampling loop: a batch of sequences decoded step by step over one KV cache, which rows join and leave.

`DecodeBatch` is the one loop both generation paths drive: the batch `generate` of the strategies runs it to
completion over a prompt batch (`sample`), and the `hf` engine (`baton.engines.hf`) steps it between requests,
admitting new ones and dropping finished and aborted ones as they come. A step (1) prefills the rows that join as
one left-padded group, equal inputs once (a prompt's samples share their prefill), and merges their KV cache into
the running batch's, left-padding both to a common length; (2) samples one token for every row; (3) drops the
finished rows, with the padding columns no row needs any more; (4) runs one decode forward for the rest.

Every sampled row draws from its own generator, so its tokens do not depend on what else is in the batch: the
batch path seeds each row by `prompt_row_seeds` (the prompts' own `sample_seeds` where the driver set them, the
rollout system's rule, else the k-th draw of the caller's generator), and an engine request with that seed gives the
same tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from baton.data import DataProto
from baton.datasets.prompts import SAMPLE_SEEDS
from baton.strategy.base import SamplingParams
from baton.strategy.logprobs import cache_argument, position_ids_from_mask


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf (at least one token always survives)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = probs.cumsum(-1) - probs > top_p  # drop a token once the mass before it exceeds top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def row_seeds(generator: torch.Generator, count: int) -> list[int]:
    """The seeds of `count` rows' generators: the next draws of `generator` (which advances)."""
    return torch.randint(0, 2**62, (count,), generator=generator, device=generator.device).tolist()


def prompt_row_seeds(prompts: DataProto, params: SamplingParams, generator: torch.Generator) -> list[int]:
    """The seeds of the `len(prompts) * params.n` rows of a generate call (a prompt's samples consecutive): each
    prompt's `sample_seeds` where the batch has them (the first n of each), else draws of `params.seed`'s generator,
    or of `generator` (which advances) when `params.seed` is None."""
    seeds = prompts.non_tensor_batch.get(SAMPLE_SEEDS)
    if seeds is not None:
        short = [i for i, own in enumerate(seeds) if len(own) < params.n]
        if short:
            raise ValueError(f"prompt row {short[0]} carries {len(seeds[short[0]])} sample_seeds for n={params.n} "
                             "samples; collate the prompts with num_samples >= n")
        return [int(seed) for own in seeds for seed in own[:params.n]]
    if params.seed is not None:
        generator = torch.Generator(generator.device).manual_seed(params.seed)
    return row_seeds(generator, len(prompts) * params.n)


@dataclass(eq=False)
class DecodeRow:
    """One sample being decoded: what `DecodeBatch` reads and appends to (the engines' `Sequence` has the same
    attributes). `input_ids` are the tokens before the first new one (a resumed row: prompt + prefix, with the
    prefix also in `response_ids`); `params.max_new_tokens` bounds `response_ids`; `generator` None: greedy."""

    input_ids: tuple[int, ...]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`tensor` with `width` columns of zeros before dim -2 (KV tensors [batch, heads, seq, dim]) or dim -1 (masks)."""
    if width == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, 0, width, 0) if tensor.dim() == 4 else (width, 0))


class DecodeBatch:
    """The rows being decoded, in cache order, with their KV cache and the logits each samples its next token from.

    model: a causal LM on its device; autocast: a callable returning the context its forwards run in (mixed
    precision), None for none. Not thread-safe: one caller (the engine's executor thread) at a time.
    """

    def __init__(self, model, pad_token_id: int, autocast: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.model, self.pad_token_id = model, pad_token_id
        self.autocast = autocast or contextlib.nullcontext
        self.cache_kwarg = cache_argument(model)
        self.rows: list = []  # DecodeRow-like
        self.cache: DynamicCache | None = None
        self.attention_mask: torch.Tensor | None = None  # [rows, cache_len], 0 on left padding
        self.next_position: torch.Tensor | None = None  # [rows, 1]
        self.logits: torch.Tensor | None = None  # [rows, vocab]
        self.logits_versions: list[int] = []  # per row: the weight version that computed its logits

    @torch.no_grad()
    def step(self, new: list, version: int) -> list[tuple[object, str]]:
        """Admit `new`, sample a token for every row, drop the finished rows, decode the rest with the weights of
        `version`. Returns the finished rows with their finish reason ("stop" or "length")."""
        if new:
            self.admit(new, version)
        if not self.rows:
            return []
        tokens, log_probs = self.sample()
        finished, keep = [], []
        for i, (row, token, log_prob) in enumerate(zip(self.rows, tokens, log_probs)):
            row.response_ids.append(token)
            row.log_probs.append(log_prob)
            row.weight_versions.append(self.logits_versions[i])
            if token in row.stop_token_ids:
                finished.append((row, "stop"))
            elif len(row.response_ids) >= row.params.max_new_tokens:
                finished.append((row, "length"))
            else:
                keep.append(i)
        self.keep(keep)
        if self.rows:
            self.decode([tokens[i] for i in keep], version)
        return finished

    def admit(self, new: list, version: int) -> None:
        """Prefill `new` as one left-padded group (equal inputs once) and merge it into the batch."""
        device = self.model.device
        inputs = [tuple(row.input_ids) for row in new]
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
        if inputs != distinct:
            cache.batch_select_indices(row_input)
        self._merge(new, cache, mask[row_input], position_ids[row_input, -1:] + 1, out.logits[row_input, -1, :],
                    version)

    def _merge(self, new: list, cache: DynamicCache, mask: torch.Tensor, next_position: torch.Tensor,
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
        """One token per row from its logits, with its log-prob at the row's temperature before top-k/top-p filtering
        (what a trainer recomputes at that temperature); greedy rows report temperature-1 log-probs."""
        logits = self.logits.float()
        tokens = torch.empty(len(self.rows), dtype=torch.long, device=logits.device)
        log_probs = torch.empty(len(self.rows), dtype=torch.float32, device=logits.device)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(self.rows):
            p = row.params
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
        for (temperature, top_k, top_p), indices in groups.items():
            index = torch.tensor(indices, device=logits.device)
            group = logits if len(indices) == len(self.rows) else logits[index]
            if temperature == 0:
                chosen = group.argmax(-1)
            else:
                group = group / temperature
                probs = torch.softmax(filter_logits(group, top_k, top_p), -1)
                # argmax(p / q) with q ~ Exp(1) is an exact draw from p (the exponential form of the Gumbel trick,
                # torch.multinomial's own one-sample method); each row's q comes from its own generator.
                q = torch.empty_like(probs)
                for row_q, i in zip(q.unbind(0), indices):
                    row_q.exponential_(1, generator=self.rows[i].generator)
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


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, pad_token_id: int,
           stop_token_ids: list[int], seeds: list[int], autocast=None) -> dict[str, torch.Tensor]:
    """Generate `params.n` samples per prompt of a left-padded batch (a prompt's samples consecutive), by running a
    `DecodeBatch` to completion; sampled row k draws from a generator seeded by `seeds[k]` (`prompt_row_seeds`).

    Returns responses / response_mask / rollout_log_probs [rows, response_len] (response_len is the longest
    sample, at most max_new_tokens) and `stopped` [rows] bool, on CPU.
    """
    one = dataclasses.replace(params, n=1)
    stop = frozenset(stop_token_ids)
    prompts = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    rows = [DecodeRow(prompt, one, stop) for prompt in prompts for _ in range(params.n)]
    if params.temperature > 0:
        for row, seed in zip(rows, seeds, strict=True):
            row.generator = torch.Generator(input_ids.device).manual_seed(seed)
    batch, reasons = DecodeBatch(model, pad_token_id, autocast), {}
    pending = rows
    while pending or batch.rows:
        reasons.update((id(row), reason) for row, reason in batch.step(pending, version=0))
        pending = []
    return padded_responses([row.response_ids for row in rows], [row.log_probs for row in rows],
                            [reasons[id(row)] == "stop" for row in rows], pad_token_id)


def padded_responses(response_ids: list, log_probs: list, stopped: list[bool], pad_token_id: int
                     ) -> dict[str, torch.Tensor]:
    """Per-sample token ids and log-probs (sequences of any lengths) as right-padded tensors: responses /
    response_mask / rollout_log_probs [rows, longest] and `stopped` [rows] bool, on CPU."""
    length = max((len(ids) for ids in response_ids), default=0)
    padding = [length - len(ids) for ids in response_ids]
    return {
        "responses": torch.tensor([[*ids, *[pad_token_id] * pad] for ids, pad in zip(response_ids, padding)],
                                  dtype=torch.long).view(len(padding), length),
        "response_mask": torch.tensor([[1] * (length - pad) + [0] * pad for pad in padding],
                                      dtype=torch.long).view(len(padding), length),
        "rollout_log_probs": torch.tensor([[*lps, *[0.0] * pad] for lps, pad in zip(log_probs, padding)],
                                          dtype=torch.float32).view(len(padding), length),
        "stopped": torch.tensor(stopped, dtype=torch.bool).view(len(padding)),
    }


def generation_output(prompts: DataProto, params: SamplingParams, responses: torch.Tensor, response_mask: torch.Tensor,
                      rollout_log_probs: torch.Tensor, stopped: torch.Tensor) -> DataProto:
    """The generate() output layout (see `baton.strategy.base`), on CPU: `params.n` rows per prompt, the
    prompts' non-tensor columns repeated to match, and `meta_info["temperature"]` = the temperature sampled at,
    which every later log-prob computation of the batch uses (`sampling_temperature`)."""
    n = params.n
    prompt_ids = prompts.batch["input_ids"].cpu().repeat_interleave(n, 0)  # [rows, prompt_len]
    attention_mask = torch.cat([prompts.batch["attention_mask"].cpu().repeat_interleave(n, 0), response_mask.cpu()], dim=1)
    result = DataProto.from_dict(
        {
            "prompts": prompt_ids, "responses": responses.cpu(), "response_mask": response_mask.cpu(),
            "input_ids": torch.cat([prompt_ids, responses.cpu()], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask), "rollout_log_probs": rollout_log_probs.cpu(),
        },
        {"finish_reason": np.array(["stop" if s else "length" for s in stopped.tolist()], dtype=object)},
        meta_info={**prompts.meta_info, "temperature": params.temperature},
    )
    carried = {k: v for k, v in prompts.non_tensor_batch.items() if k != SAMPLE_SEEDS}
    if carried:
        result = result.union(DataProto(non_tensor_batch=carried).repeat(n, interleave=True))
    return result
