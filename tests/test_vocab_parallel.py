"""The LM head split by vocabulary over two gloo processes (`baton.strategy.vocab_parallel`) gives the single-device
log-probs, entropy and gradients, with shards of unequal size, chunks, a temperature, and the entropy as a loss term
or as a metric."""

from __future__ import annotations

import math

import pytest
import torch

from baton.strategy.logprobs import token_log_probs

VOCAB, HIDDEN, SPLIT = 11, 8, 6  # rank 0 holds ids 0..5, rank 1 ids 6..10


def case(temperature: float, entropy_grad: bool):
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, HIDDEN)
    weight = torch.randn(VOCAB, HIDDEN)
    tokens = torch.randint(0, VOCAB, (2, 5))
    tokens[0, :2] = torch.tensor([0, VOCAB - 1])  # both ends of the vocabulary
    lp_weight, ent_weight = torch.randn(2, 5), torch.randn(2, 5)
    return hidden, weight, tokens, lp_weight, ent_weight


def loss_of(log_probs, entropy, lp_weight, ent_weight, entropy_grad):
    return (log_probs * lp_weight).sum() + ((entropy * ent_weight).sum() if entropy_grad else 0)


def _shard(rank: int, init_file: str, temperature: float, entropy_grad: bool, out: str) -> None:
    import torch.distributed as dist

    from baton.strategy.vocab_parallel import vocab_parallel_token_log_probs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        hidden, weight, tokens, lp_weight, ent_weight = case(temperature, entropy_grad)
        rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, VOCAB)
        reduced = []  # the shape of every tensor the group all-reduces
        all_reduce = dist.all_reduce
        dist.all_reduce = lambda tensor, *args, **kwargs: reduced.append(tuple(tensor.shape)) or all_reduce(
            tensor, *args, **kwargs)
        hidden = hidden.clone().requires_grad_()
        shard = weight[rows].clone().requires_grad_()
        log_probs, entropy = vocab_parallel_token_log_probs(hidden, shard, tokens, rows.start, temperature=temperature,
                                                            chunk_size=3, entropy_grad=entropy_grad)
        loss_of(log_probs, entropy, lp_weight, ent_weight, entropy_grad).backward()
        torch.save({"log_probs": log_probs.detach(), "entropy": entropy.detach(), "hidden_grad": hidden.grad,
                    "weight_grad": shard.grad, "entropy_requires_grad": entropy.requires_grad,
                    "reduced": reduced}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, True), (0.7, False)])
def test_a_vocabulary_split_over_two_ranks_gives_the_single_device_log_probs_and_gradients(tmp_path, temperature,
                                                                                           entropy_grad):
    out = str(tmp_path / "shard")
    torch.multiprocessing.spawn(_shard, args=(str(tmp_path / "init"), temperature, entropy_grad, out), nprocs=2)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]

    hidden, weight, tokens, lp_weight, ent_weight = case(temperature, entropy_grad)
    hidden.requires_grad_()
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight.data.copy_(weight)
    log_probs, entropy = token_log_probs(hidden, head, tokens, temperature, chunk_size=4, entropy_grad=entropy_grad)
    loss_of(log_probs, entropy, lp_weight, ent_weight, entropy_grad).backward()
    for rank in ranks:  # every rank has the whole vocabulary's outputs and hidden-state gradient
        torch.testing.assert_close(rank["log_probs"], log_probs.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(rank["entropy"], entropy.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(rank["hidden_grad"], hidden.grad, atol=1e-6, rtol=1e-5)
        assert rank["entropy_requires_grad"] == entropy_grad
        # What crossed the group: a few values per token of a chunk (3 tokens), then the hidden states' gradient once;
        # never logits.
        *per_chunk, last = rank["reduced"]
        assert last == (10, HIDDEN) and max(math.prod(shape) for shape in per_chunk) <= 2 * 3
    torch.testing.assert_close(torch.cat([ranks[0]["weight_grad"], ranks[1]["weight_grad"]]), head.weight.grad,
                               atol=1e-6, rtol=1e-5)
