"""From a causal LM's hidden states to per-token log-probs and entropy, a chunk of tokens at a time.

Rows that share a prompt (the samples of one prompt) run that prompt through the model once. Only
the response positions go through the LM head, and only `chunk_size` tokens at once, so the
full-vocabulary float32 log-softmax is never held for the whole batch. With gradients enabled each
chunk is recomputed in the backward pass instead of keeping its logits.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from baton.strategy.packing import packed_response_hidden_states, plan_packing


def sampling_temperature(batch) -> float:
    """The temperature at which a batch's log-probs are computed: the one its responses were sampled at, which the
    generation records in `meta_info["temperature"]` (`generation_output`). Responses that were not sampled (SFT data) have none and get 1;
    a sampled batch (it holds rollout_log_probs) without the record is an error, since its log-probs would
    silently come out at temperature 1."""
    temperature = batch.meta_info.get("temperature")
    if temperature is not None:
        return float(temperature)
    if "rollout_log_probs" in batch.batch:
        raise ValueError("this batch was sampled (it has rollout_log_probs) but records no meta_info['temperature']; "
                         "generate() records the temperature it sampled at: keep meta_info when you build a batch "
                         "from its output, or set meta_info['temperature'] to that temperature")
    return 1.0


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def cache_argument(model) -> str:
    """transformers 5 names the KV-cache argument `cache`; earlier releases `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def response_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor | None, response_len: int, packing: bool = False,
                           one_pass: bool = False) -> torch.Tensor:
    """Hidden states at the positions that predict each response token: [rows, response_len, hidden].

    The columns before the last `response_len` are the prompt. Three ways to compute them, the one that runs the
    fewest token positions taken: one pass over the padded rows; rows with equal prompts (ids, mask and positions)
    sharing one pass over it (each distinct prompt runs once with a KV cache, every row gets its prompt's keys and
    values, gradients flow back through the gather, and only the response tokens run per row); or, with `packing`,
    one pass over the rows' real tokens packed into bins (`baton.strategy.packing`). All three give the same values
    at the real tokens up to float rounding (padding positions: whatever the pass gives, zeros when packed).
    `one_pass`: the decoder runs exactly once (no prompt-sharing, no pass per packed bin), as a model sharded over
    ranks needs: FSDP2 gathers each layer's weights at each call, and every rank must make the same calls.
    """
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    decoder = model.get_decoder()
    rows, seq_len = input_ids.shape
    prompt_len = seq_len - response_len
    prompt_key = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].long(),
                            position_ids[:, :prompt_len]], dim=1)
    distinct, row_prompt = torch.unique(prompt_key, dim=0, return_inverse=True)  # row_prompt: [rows]
    # Sharing pays when prompts repeat (a prompt's samples); a stray duplicate (e.g. where a sampler's
    # epochs meet) is not worth the second pass. Gradient checkpointing turns the KV cache off in
    # training, so it takes the full pass.
    checkpointing = any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    shared = prompt_len > 0 and 2 * len(distinct) <= rows and not checkpointing and not one_pass
    padded_cost = len(distinct) * prompt_len + rows * response_len if shared else rows * seq_len
    if packing and prompt_len > 0:
        plan = plan_packing(attention_mask, one_pass)
        if plan.cost < padded_cost:
            return packed_response_hidden_states(decoder, input_ids, attention_mask, position_ids, response_len, plan)
    if not shared:
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [rows, seq, hidden]
        return hidden[:, -response_len - 1 : -1]
    rows = torch.arange(len(input_ids), device=input_ids.device)
    first_row = torch.full((len(distinct),), len(input_ids), device=input_ids.device).scatter_reduce(
        0, row_prompt, rows, "amin")  # a row holding each distinct prompt
    cache = DynamicCache()  # filled in place by each call
    prompt_hidden = decoder(
        input_ids=input_ids[first_row, :prompt_len], attention_mask=attention_mask[first_row, :prompt_len],
        position_ids=position_ids[first_row, :prompt_len], use_cache=True, **{cache_argument(decoder): cache},
    ).last_hidden_state  # [prompts, prompt_len, hidden]
    last_prompt = prompt_hidden[row_prompt, -1:]  # [rows, 1, hidden]: predicts the first response token
    if response_len == 1:
        return last_prompt
    cache.batch_select_indices(row_prompt)
    # The response tokens but the last (it predicts nothing), attending to the prompt through the cache.
    response_hidden = decoder(
        input_ids=input_ids[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, prompt_len:-1], use_cache=True, **{cache_argument(decoder): cache},
    ).last_hidden_state  # [rows, response_len - 1, hidden]
    return torch.cat([last_prompt, response_hidden], dim=1)


def _chunk_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    # In mixed precision the matmul runs in bf16 (autocast, or FSDP2's bf16 parameters); the log-softmax (and the
    # entropy from it) always run on float32 logits, so their error is the matmul's rounding, not bf16's over the
    # vocabulary.
    return _log_softmax((hidden @ weight.T).float(), inv_temperature)  # [tokens, vocab]


def _check_no_bias(lm_head: torch.nn.Module) -> None:
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("token log-probs support LM heads without bias (true of Qwen2, Llama and most causal LMs)")


class _ChunkedLogProbs(torch.autograd.Function):
    """Token log-probs and entropy, `chunk_size` tokens at a time, holding at most two [chunk, vocab] float32 tensors
    and one gradient of the LM head's weight.

    The forward pass keeps no logits; the backward pass recomputes each chunk's once and writes their gradient in
    place: d log p(y) / dz = onehot(y) - p and d H / dz = -p (log p + H), scaled by the inverse temperature. The
    chunks' gradients of the weight go into one buffer (autograd through the plain expressions, a function per chunk,
    holds three to four [chunk, vocab] tensors per chunk and sums the weight's gradients out of place: three weights'
    worth at Qwen2.5's vocabulary). The matmul runs in the dtype the forward pass gave it (bf16 under autocast, as
    `_chunk_log_softmax`), the softmax in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, inv_temperature: float, with_entropy: bool, entropy_grad: bool,
                chunk_size: int):
        log_probs, entropies = [], []
        for start in range(0, tokens.shape[0], chunk_size):
            product = hidden[start : start + chunk_size] @ weight.T
            ctx.matmul_dtype = product.dtype
            log_p = _log_softmax(product.float(), inv_temperature)
            del product
            log_probs.append(log_p.gather(-1, tokens[start : start + chunk_size, None])[:, 0])
            if with_entropy:
                entropies.append(log_p.exp().mul_(log_p).sum(-1).neg_())
            del log_p  # before the next chunk's logits
        log_probs = torch.cat(log_probs)
        entropy = torch.cat(entropies) if with_entropy else torch.zeros_like(log_probs)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        ctx.chunk_size, ctx.inv_temperature = chunk_size, inv_temperature
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, tokens, entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, tokens, entropy = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        dtype, chunk = ctx.matmul_dtype, ctx.chunk_size
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, tokens.shape[0], chunk):
            end = start + chunk
            h = hidden[start:end].to(dtype)
            grad = logits_grad_(_chunk_log_softmax(h, w, ctx.inv_temperature), tokens[start:end],
                                slice_or_none(grad_log_probs, start, end), slice_or_none(grad_entropy, start, end),
                                entropy[start:end], ctx.inv_temperature).to(dtype)
            add_head_grads_(grad, h, w, grad_hidden, grad_weight, start)
            del grad  # before the next chunk's logits
        return grad_hidden, grad_weight, None, None, None, None, None


def logits_grad_(log_p: torch.Tensor, tokens: torch.Tensor, grad_log_probs: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None, entropy: torch.Tensor, inv_temperature: float,
                 in_shard: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of the pre-temperature logits [tokens, vocab] (float32), made in `log_p`'s memory and one more
    tensor like it: g_lp (onehot(y) - p) - g_H p (log p + H), times the inverse temperature. `log_p`: the log-softmax
    over (this shard of) the vocabulary, consumed; `tokens`: each position's token as an index into it; `entropy` H:
    of the whole vocabulary. A shard of the vocabulary passes `in_shard` (1.0 where it holds the token, else 0.0):
    onehot(y) is zero on the others."""
    grad = log_p.exp()  # p
    if grad_entropy is not None:  # log_p becomes the entropy's part: -g_H p (log p + H)
        log_p.add_(entropy[:, None]).mul_(grad).mul_(-grad_entropy[:, None])
    if grad_log_probs is None:
        grad = log_p
    else:  # g_lp (onehot(y) - p), plus the entropy's part
        g = grad_log_probs[:, None]
        grad.mul_(-g).scatter_add_(-1, tokens[:, None], g if in_shard is None else g * in_shard[:, None])
        if grad_entropy is not None:
            grad.add_(log_p)
    if inv_temperature != 1.0:
        grad.mul_(inv_temperature)
    return grad


def add_head_grads_(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, grad_hidden: torch.Tensor | None,
                    grad_weight: torch.Tensor | None, start: int) -> None:
    """One chunk's logits' gradient `grad` [tokens, vocab] (the matmul's dtype) into the hidden states' gradient (its
    rows from `start`) and added to the head weight's (one buffer for every chunk); None: not wanted."""
    if grad_hidden is not None:
        grad_hidden[start : start + grad.shape[0]] = grad @ w
    if grad_weight is not None:
        if grad_weight.dtype == grad.dtype:
            grad_weight.addmm_(grad.T, h)
        else:
            grad_weight.add_(grad.T @ h)


def slice_or_none(values: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """values[start:end], or None for None (a gradient autograd did not materialise)."""
    return None if values is None else values[start:end]


def scale_(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """`logits` at the inverse temperature, in place."""
    return logits.mul_(inv_temperature) if inv_temperature != 1.0 else logits


def inverse_temperature(temperature: float) -> float:
    """What logits are multiplied by at `temperature`; greedy (0) scores at 1."""
    return 1.0 / temperature if temperature > 0 else 1.0


def _log_softmax(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """The log-softmax of float32 `logits` (scaled in place) at the inverse temperature. torch's log_softmax works
    row by row, so a token's log-prob does not depend on the other rows of its chunk (a logsumexp reduction may split
    a row over threads when the rows are few, and round differently with the batch's shape)."""
    return torch.log_softmax(scale_(logits, inv_temperature), dim=-1)


def log_probs_by_token(function, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float,
                       with_entropy: bool, entropy_grad: bool, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """`function` (`_ChunkedLogProbs` or the vocabulary-parallel one: hidden, weight, tokens, inverse temperature,
    with_entropy, entropy_grad, then its own `args`) over the positions of hidden [rows, len, hidden] and tokens
    [rows, len], as one flat run of tokens; two float32 tensors [rows, len]."""
    rows, length = tokens.shape
    if rows * length == 0:
        # Still a function of `hidden` and `weight`: a context-parallel rank without response tokens runs its backward
        # pass through the model (its peers' attention needs it) and gives the head a (zero) gradient, as FSDP's
        # reduction of the head's gradient over the ranks needs.
        empty = hidden.sum(-1).float() * 0 + weight.sum().float() * 0
        return empty, empty
    log_probs, entropy = function.apply(hidden.reshape(rows * length, -1), weight, tokens.reshape(-1),
                                        inverse_temperature(temperature), with_entropy, entropy_grad, *args)
    return log_probs.reshape(rows, length), entropy.reshape(rows, length)


def token_log_probs(hidden: torch.Tensor, lm_head: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0,
                    chunk_size: int = 1024, with_entropy: bool = True, entropy_grad: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(tokens) and the entropy of each position's distribution at `temperature`.

    entropy_grad=False computes the entropy as a plain value (a metric): at a large vocabulary its
    backward pass costs about as much as the log-probs' own.

    hidden [rows, len, hidden], tokens [rows, len] → two float32 tensors [rows, len].
    """
    _check_no_bias(lm_head)
    return log_probs_by_token(_ChunkedLogProbs, hidden, lm_head.weight, tokens, temperature, with_entropy,
                              entropy_grad, chunk_size)


def _chunk_log_probs_at(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                        inv_temperature: float) -> torch.Tensor:
    return _chunk_log_softmax(hidden, weight, inv_temperature).gather(-1, ids)


def check_top_k_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids in [{int(ids.min())}, {int(ids.max())}] are outside this model's vocabulary of "
                         f"{vocab_size}; the model that chose them must share this model's tokenizer")


def token_log_probs_at(hidden: torch.Tensor, lm_head: torch.nn.Module, ids: torch.Tensor, temperature: float = 1.0,
                       chunk_size: int = 1024) -> torch.Tensor:
    """log p(id) at `temperature` for k given token ids per position (e.g. another model's top-k), a chunk of
    positions at a time, recomputed in the backward pass like `token_log_probs`.

    hidden [rows, len, hidden], ids [rows, len, k] → float32 [rows, len, k]."""
    rows, length, k = ids.shape
    _check_no_bias(lm_head)
    check_top_k_ids(ids, lm_head.weight.shape[0])
    flat_hidden, flat_ids = hidden.reshape(rows * length, -1), ids.reshape(rows * length, k)
    inv_temperature = inverse_temperature(temperature)
    out = []
    for start in range(0, rows * length, chunk_size):
        args = (flat_hidden[start : start + chunk_size], lm_head.weight, flat_ids[start : start + chunk_size],
                inv_temperature)
        out.append(checkpoint(_chunk_log_probs_at, *args, use_reentrant=False) if torch.is_grad_enabled()
                   else _chunk_log_probs_at(*args))
    if not out:
        return flat_hidden.new_zeros((rows, length, k), dtype=torch.float32)
    return torch.cat(out).reshape(rows, length, k)


@torch.no_grad()
def token_top_k(hidden: torch.Tensor, lm_head: torch.nn.Module, k: int, temperature: float = 1.0,
                chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's k most likely next tokens at `temperature`: (log-probs float32, ids int64), each
    [rows, len, k], most likely first; the full-vocabulary log-softmax exists for one chunk of positions at a time."""
    _check_no_bias(lm_head)
    vocab_size = lm_head.weight.shape[0]
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-k k={k} must be in [1, {vocab_size}] (this model's vocabulary); k = {vocab_size} "
                         "sends the full distribution")
    rows, length = hidden.shape[:2]
    flat_hidden = hidden.reshape(rows * length, -1)
    inv_temperature = inverse_temperature(temperature)
    values, ids = [], []
    for start in range(0, rows * length, chunk_size):
        top = _chunk_log_softmax(flat_hidden[start : start + chunk_size], lm_head.weight, inv_temperature).topk(k, -1)
        values.append(top.values)
        ids.append(top.indices)
    if not values:
        return flat_hidden.new_zeros((rows, length, k), dtype=torch.float32), torch.zeros(
            (rows, length, k), dtype=torch.long, device=hidden.device)
    return torch.cat(values).reshape(rows, length, k), torch.cat(ids).reshape(rows, length, k)


def chunk_tokens(vocab_size: int, budget: int = 1 << 26, most: int = 1024) -> int:
    """Tokens per log-prob chunk: as many as keep one chunk's float32 logits [tokens, vocab] within `budget` values
    (256 MiB), at most `most`. The backward pass holds two such tensors (`_ChunkedLogProbs`)."""
    return max(1, min(most, budget // vocab_size))
