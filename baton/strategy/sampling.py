"""Batched sampling from a causal LM with a KV cache and left-padded prompts."""

from __future__ import annotations

import inspect

import numpy as np
import torch
from transformers import DynamicCache

from baton.data import DataProto

from baton.strategy.base import SamplingParams
from baton.strategy.logprobs import position_ids_from_mask


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
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
    filtered = _filter_logits(scaled, params.top_k, params.top_p)
    tokens = torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator).squeeze(-1)
    return tokens, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)


def _cache_argument(model) -> str:
    """transformers 5 names the KV-cache argument `cache`; earlier releases `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, pad_token_id: int,
           stop_token_ids: list[int], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Generate `params.n` samples per prompt (a prompt's samples consecutive).

    Returns responses / response_mask / rollout_log_probs [rows, response_len] (response_len is
    the longest sample, at most max_new_tokens) and `stopped` [rows] bool.
    """
    n = params.n
    input_ids = input_ids.repeat_interleave(n, 0)  # [rows, prompt_len]
    attention_mask = attention_mask.repeat_interleave(n, 0)
    rows, device = input_ids.shape[0], input_ids.device
    position_ids = position_ids_from_mask(attention_mask)
    stop = torch.tensor(stop_token_ids, device=device)
    responses = torch.full((rows, params.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(rows, params.max_new_tokens, dtype=torch.float32, device=device)
    response_mask = torch.zeros(rows, params.max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    cache = {_cache_argument(model): DynamicCache()}  # filled in place by every forward call
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=1, **cache)
    next_position = position_ids[:, -1:] + 1
    length = 0
    for step in range(params.max_new_tokens):
        tokens, token_log_probs = next_tokens(out.logits[:, -1, :], params, generator)
        tokens = tokens.masked_fill(finished, pad_token_id)
        responses[:, step] = tokens
        log_probs[:, step] = token_log_probs.masked_fill(finished, 0.0)
        response_mask[:, step] = (~finished).long()
        finished |= torch.isin(tokens, stop)
        length = step + 1
        if bool(finished.all()) or length == params.max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_position,
                    use_cache=True, **cache)
        next_position = next_position + 1
    return {
        "responses": responses[:, :length],
        "response_mask": response_mask[:, :length],
        "rollout_log_probs": log_probs[:, :length],
        "stopped": finished,
    }


def generation_output(prompts: DataProto, n: int, responses: torch.Tensor, response_mask: torch.Tensor,
                      rollout_log_probs: torch.Tensor, stopped: torch.Tensor) -> DataProto:
    """The generate() output layout (see `baton.strategy.base`), on CPU: `n` rows per prompt, the
    prompts' non-tensor columns repeated to match."""
    prompt_ids = prompts.batch["input_ids"].cpu().repeat_interleave(n, 0)  # [rows, prompt_len]
    attention_mask = torch.cat([prompts.batch["attention_mask"].cpu().repeat_interleave(n, 0), response_mask.cpu()], dim=1)
    result = DataProto.from_dict(
        {
            "prompts": prompt_ids, "responses": responses.cpu(), "response_mask": response_mask.cpu(),
            "input_ids": torch.cat([prompt_ids, responses.cpu()], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask), "rollout_log_probs": rollout_log_probs.cpu(),
        },
        {"finish_reason": np.array(["stop" if s else "length" for s in stopped.tolist()], dtype=object)},
        meta_info=dict(prompts.meta_info),
    )
    if prompts.non_tensor_batch:
        result = result.union(DataProto(non_tensor_batch=dict(prompts.non_tensor_batch)).repeat(n, interleave=True))
    return result
