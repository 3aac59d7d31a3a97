"""`RLHead`: a causal LM or critic as one module whose forward gives what RL needs of the response tokens (log-probs
and entropy, values, top-k), from the hidden states a chunk at a time; the LM head whole or split by vocabulary over a
tensor-parallel group (`baton.strategy.vocab_parallel`); or one pipeline stage of them
(`baton.strategy.pipeline_parallel`)."""

from __future__ import annotations

import torch

from baton.strategy.context_parallel import context_parallel_hidden_states, gather_responses
from baton.strategy.logprobs import (
    chunk_tokens, position_ids_from_mask, response_hidden_states, token_log_probs, token_log_probs_at, token_top_k,
)
from baton.strategy.packing import resolve_packing
from baton.strategy.pipeline_parallel import Stage, stage_hidden_states
from baton.strategy.tensor_parallel import vocab_shard
from baton.strategy.vocab_parallel import vocab_parallel_token_log_probs


class RLHead(torch.nn.Module):
    """Wraps an HF model so that one forward call returns what RL needs for the response tokens.

    Going through this module's forward (rather than reaching into the model's weights from
    outside) is what lets FSDP gather the weights of the embedding and LM head when they are used.
    causal LMs: {"log_probs", "entropy"}; kind "value" (token classifiers): {"values"}; each [rows, response_len].
    A causal LM given `log_probs_at` (token ids [rows, response_len, k]) also returns "log_probs_at", the log-probs
    of those ids [rows, response_len, k]; given `top_k` > 0 it returns only "top_k_log_probs" and "top_k_ids"
    [rows, response_len, top_k] (`token_top_k`). A pipeline stage (`stage` set) but the last returns
    {"hidden_states"} [rows, seq, hidden] for the next stage, which passes them in as `hidden_states`.
    """

    def __init__(self, model: torch.nn.Module, kind: str, chunk_size: int, packing: bool | None = False):
        super().__init__()
        self.model = model
        self.kind = kind
        self.chunk_size = chunk_size or chunk_tokens(model.config.vocab_size)
        self.packing = resolve_packing(packing, model)  # see `response_hidden_states`
        self.one_pass = False  # set by a strategy that shards the model over ranks (`response_hidden_states`)
        self.context_parallel = None  # a process group over which each sequence is split (`context_parallel`)
        self.stage: Stage | None = None  # the pipeline stage this module holds (`split_into_stage`); None: all of it

    def forward(self, input_ids, attention_mask, position_ids, responses, temperature: float = 1.0,
                with_entropy: bool = True, entropy_grad: bool = True, log_probs_at: torch.Tensor | None = None,
                top_k: int = 0, hidden_states: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        response_len = responses.shape[1]
        if self.stage is not None:
            hidden = stage_hidden_states(self.model, self.stage, input_ids, hidden_states, attention_mask,
                                         position_ids)
            if not self.stage.is_last:
                return {"hidden_states": hidden}
            return self._head(hidden[:, -response_len - 1 : -1], attention_mask[:, -response_len:].bool(), responses,
                              temperature, with_entropy, entropy_grad, log_probs_at, top_k)
        if self.kind == "value" and getattr(self.model, "score", None) is None:  # not a Qwen2/Llama-style classifier
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            return {"values": logits[:, -response_len - 1 : -1, 0].float()}
        if self.context_parallel is None:
            hidden = response_hidden_states(self.model, input_ids, attention_mask, position_ids, response_len,
                                            self.packing, self.one_pass)
            return self._head(hidden, attention_mask[:, -response_len:].bool(), responses, temperature, with_entropy,
                              entropy_grad, log_probs_at, top_k)
        # Context parallel: this rank's share of the response positions through the head, then every rank's outputs.
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden, share, sizes = context_parallel_hidden_states(self.model, input_ids, attention_mask, position_ids,
                                                              response_len, self.context_parallel)
        real = attention_mask[:, -response_len:][:, share].bool()
        ids = None if log_probs_at is None else log_probs_at[:, share]
        out = self._head(hidden, real, responses[:, share], temperature, with_entropy, entropy_grad, ids, top_k)
        return {key: gather_responses(value, sizes, self.context_parallel) for key, value in out.items()}

    def _head(self, hidden: torch.Tensor, real: torch.Tensor, responses: torch.Tensor, temperature: float,
              with_entropy: bool, entropy_grad: bool, log_probs_at: torch.Tensor | None, top_k: int
              ) -> dict[str, torch.Tensor]:
        """The outputs at response positions [rows, n] from their hidden states [rows, n, hidden]; `real` [rows, n]:
        which positions hold response tokens."""
        if self.kind == "value":  # no dropout before the head: build_role_model sets classifier_dropout 0
            return {"values": self.model.score(hidden)[..., 0].float()}
        lm_head = self.model.get_output_embeddings()
        # Only the real response tokens go through the LM head, as one row: a padding position's outputs are never
        # read, and at a real vocabulary the head costs more than several layers. Padding positions get zeros.
        hidden = hidden[real][None]  # [1, tokens, hidden]
        if top_k:
            values, ids = token_top_k(hidden, _whole(lm_head), top_k, temperature, self.chunk_size)
            return {"top_k_log_probs": at_rows(values, real), "top_k_ids": at_rows(ids, real)}
        tokens = responses[real][None]
        shard = vocab_shard(lm_head.weight)
        if shard is None:
            log_probs, entropy = token_log_probs(hidden, lm_head, tokens, temperature, self.chunk_size, with_entropy,
                                                 entropy_grad)
        else:
            weight, vocab_start, group = shard
            log_probs, entropy = vocab_parallel_token_log_probs(hidden, weight, tokens, vocab_start, group, temperature,
                                                                self.chunk_size, with_entropy, entropy_grad)
        out = {"log_probs": at_rows(log_probs, real), "entropy": at_rows(entropy, real)}
        if log_probs_at is not None:
            out["log_probs_at"] = at_rows(token_log_probs_at(hidden, _whole(lm_head), log_probs_at[real][None],
                                                             temperature, self.chunk_size), real)
        return out


def _whole(lm_head: torch.nn.Module) -> torch.nn.Module:
    """`lm_head`, or where its weight is split by vocabulary, a head holding the gathered weight (differentiable):
    the top-k and given-id log-probs read every row of it. Gathers a weight, never logits."""
    if vocab_shard(lm_head.weight) is None:
        return lm_head
    whole = torch.nn.Module()
    whole.weight, whole.bias = lm_head.weight.full_tensor(), None
    return whole


def at_rows(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """`values` of the real positions, [1, tokens, ...], back at their rows' positions [rows, len, ...]; zeros elsewhere."""
    out = values.new_zeros((*real.shape, *values.shape[2:]))
    return out.index_put((real,), values[0])
