"""Batched sampling from a causal LM with a KV cache and left-padded prompts.

A prompt's samples share its prefill, and rows that have stopped leave the batch (and the cache):
each step runs the model on the rows still generating only.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from baton.data import DataProto

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


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens [rows], log p(token) at the sampling temperature [rows]).

    The log-prob is taken from the temperature-scaled distribution before top-k/top-p filtering
    (what a trainer recomputes at that temperature); greedy decoding reports temperature-1 log-probs.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    tokens = torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator).squeeze(-1)
    return tokens, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, pad_token_id: int,
           stop_token_ids: list[int], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Generate `params.n` samples per prompt (a prompt's samples consecutive).

    Returns responses / response_mask / rollout_log_probs [rows, response_len] (response_len is
    the longest sample, at most max_new_tokens) and `stopped` [rows] bool.
    """
    n = params.n
    position_ids = position_ids_from_mask(attention_mask)  # [batch, prompt_len]
    cache = DynamicCache()  # filled in place by every forward call
    with_cache = {cache_argument(model): cache, "use_cache": True}
    # The prompt's n samples share its prefill: each prompt runs once, then its cache and logits are repeated.
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1,
                **with_cache)
    cache.batch_repeat_interleave(n)
    logits = out.logits[:, -1, :].repeat_interleave(n, 0)  # [rows, vocab]
    attention_mask = attention_mask.repeat_interleave(n, 0)  # [rows, prompt_len]
    next_position = position_ids[:, -1:].repeat_interleave(n, 0) + 1
    rows, device = attention_mask.shape[0], attention_mask.device
    stop = torch.tensor(stop_token_ids, device=device)
    responses = torch.full((rows, params.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(rows, params.max_new_tokens, dtype=torch.float32, device=device)
    response_mask = torch.zeros(rows, params.max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    running = torch.arange(rows, device=device)  # the rows in the cache, in its order
    length = 0
    for step in range(params.max_new_tokens):
        # Every row draws, stopped ones from stale logits (their tokens are discarded): the generator's
        # draws, and so the samples, do not depend on which rows have stopped.
        tokens, token_log_probs = next_tokens(logits, params, generator)
        tokens = tokens.masked_fill(finished, pad_token_id)
        responses[:, step] = tokens
        log_probs[:, step] = token_log_probs.masked_fill(finished, 0.0)
        response_mask[:, step] = (~finished).long()
        finished |= torch.isin(tokens, stop)
        length = step + 1
        if bool(finished.all()) or length == params.max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
        still_running = ~finished[running]
        if not bool(still_running.all()):
            cache.batch_select_indices(still_running.nonzero().squeeze(-1))
            running = running[still_running]
        logits[running] = model(input_ids=tokens[running, None], attention_mask=attention_mask[running],
                                position_ids=next_position[running], **with_cache).logits[:, -1, :]
        next_position = next_position + 1
    return {
        "responses": responses[:, :length],
        "response_mask": response_mask[:, :length],
        "rollout_log_probs": log_probs[:, :length],
        "stopped": finished,
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
    if prompts.non_tensor_batch:
        result = result.union(DataProto(non_tensor_batch=dict(prompts.non_tensor_batch)).repeat(n, interleave=True))
    return result
