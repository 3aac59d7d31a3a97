"""Token log-probs and entropy from an LM head split by vocabulary over a tensor-parallel group, never gathering the
logits: each rank holds rows [vocab_start, vocab_start + its rows) of the head's weight and the same hidden states.

Per chunk of tokens, a rank computes its shard's logits; the softmax's maximum and sum of exponentials, the target
token's log-prob (from the rank that holds it) and the entropy's sum are all-reduced: a few numbers per token cross
the group, never a [tokens, vocab] tensor. The backward pass recomputes the shard's logits, writes their gradient as
the single-device path does (`baton.strategy.logprobs.logits_grad_`), all-reduces the hidden states' gradient (each
rank's shard adds its part) and keeps the weight shard's gradient local. This is Megatron's vocabulary-parallel cross
entropy, with the entropy and temperature RL needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from baton.strategy.logprobs import add_head_grads_, log_probs_by_token, logits_grad_, scale_, slice_or_none


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, inv_temperature: float, with_entropy: bool, entropy_grad: bool,
                chunk_size: int, vocab_start: int, group):
        local_tokens, in_shard = _local_tokens(tokens, vocab_start, weight.shape[0])
        log_probs, entropies, normalisers = [], [], []
        for start in range(0, tokens.shape[0], chunk_size):
            end = start + chunk_size
            product = hidden[start:end] @ weight.T
            ctx.matmul_dtype = product.dtype
            logits = scale_(product.float(), inv_temperature)
            del product
            top = logits.max(-1).values
            dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
            logits.sub_(top[:, None])
            total = logits.exp().sum(-1)
            dist.all_reduce(total, group=group)
            log_total = total.log_()
            normaliser = top + log_total  # the log-sum-exp over the whole vocabulary
            log_p = logits.sub_(log_total[:, None])  # log p over this shard's tokens
            picked = log_p.gather(-1, local_tokens[start:end, None])[:, 0] * in_shard[start:end]
            parts = [picked]
            if with_entropy:
                parts.append(log_p.exp().mul_(log_p).sum(-1).neg_())
            reduced = torch.stack(parts)
            dist.all_reduce(reduced, group=group)  # the target's log-prob and the entropy in one call
            log_probs.append(reduced[0])
            if with_entropy:
                entropies.append(reduced[1])
            normalisers.append(normaliser)
            del logits, log_p  # before the next chunk's logits
        log_probs = torch.cat(log_probs)
        entropy = torch.cat(entropies) if with_entropy else torch.zeros_like(log_probs)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        ctx.vocab_start, ctx.chunk_size, ctx.group = vocab_start, chunk_size, group
        ctx.inv_temperature = inv_temperature
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, tokens, entropy, torch.cat(normalisers))
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, tokens, entropy, normaliser = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 9
        dtype, chunk = ctx.matmul_dtype, ctx.chunk_size
        local_tokens, in_shard = _local_tokens(tokens, ctx.vocab_start, weight.shape[0])
        w = weight.to(dtype)
        # float32 whatever the matmul's dtype: the shards' parts are summed over the group
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, tokens.shape[0], chunk):
            end = start + chunk
            h = hidden[start:end].to(dtype)
            logits = scale_((h @ w.T).float(), ctx.inv_temperature)
            grad = logits_grad_(logits.sub_(normaliser[start:end, None]), local_tokens[start:end],
                                slice_or_none(grad_log_probs, start, end), slice_or_none(grad_entropy, start, end),
                                entropy[start:end], ctx.inv_temperature, in_shard[start:end]).to(dtype)
            del logits
            add_head_grads_(grad, h, w, grad_hidden, grad_weight, start)
            del grad
        if grad_hidden is not None:
            dist.all_reduce(grad_hidden, group=ctx.group)  # every shard's part of d loss / d hidden
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _local_tokens(tokens: torch.Tensor, vocab_start: int, shard_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's index into this shard (0 where another shard holds it) and whether this shard holds it (0/1)."""
    local = tokens - vocab_start
    in_shard = (local >= 0) & (local < shard_rows)
    return local.where(in_shard, 0), in_shard.float()


def vocab_parallel_token_log_probs(hidden: torch.Tensor, weight_shard: torch.Tensor, tokens: torch.Tensor,
                                   vocab_start: int, group=None, temperature: float = 1.0, chunk_size: int = 1024,
                                   with_entropy: bool = True, entropy_grad: bool = True
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(tokens) and the entropy at `temperature`, as `baton.strategy.logprobs.token_log_probs`, from this rank's
    rows of the LM head's weight (`weight_shard` [rows, hidden]: vocabulary ids vocab_start..vocab_start + rows).

    Every rank of `group` (None: the default group) calls this with the same `hidden` [rows, len, hidden] and
    `tokens` [rows, len] (vocabulary ids), and gets the same two float32 tensors [rows, len]; the gradient of
    `hidden` is the whole vocabulary's on every rank, that of `weight_shard` its own rows'. Shards may differ in
    size (a vocabulary not divisible by the group's size)."""
    return log_probs_by_token(_VocabParallelLogProbs, hidden, weight_shard, tokens, temperature, with_entropy,
                              entropy_grad, chunk_size, vocab_start, group)


__all__ = ["vocab_parallel_token_log_probs"]
