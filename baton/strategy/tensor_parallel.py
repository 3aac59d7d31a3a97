"""Tensor parallelism for Qwen2 and Llama-family models on torch's DTensor: Megatron's split of each decoder layer.

Each attention layer's q, k and v projections are split by output (whole heads per rank) and the output projection
by input, so a layer's attention needs one all-reduce forward and one backward; the MLP likewise (gate and up by
output, down by input). The embedding is split by vocabulary rows (each rank looks up the ids it holds, the partial
rows are summed), and the LM head's weight, tied to it or not, is split the same way: the log-probs come from it
shard by shard (`baton.strategy.vocab_parallel`), never from gathered logits. The norms, the rotary embedding and a
critic's value head stay whole on every rank; their gradients are equal on every rank, since every input to them
is.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel, "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel, "mlp.down_proj": RowwiseParallel,
}


def check_tensor_parallel(config, tp: int) -> None:
    """ValueError, naming the size and the fix, for a model whose heads or MLP a `tp`-way split cannot divide."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        size = getattr(config, name, None)
        if size is None:
            raise ValueError(f"tensor parallelism splits Qwen2 and Llama-family models; this model's config has no "
                             f"{name} ({type(config).__name__}); train it with tp: 1")
        if size % tp:
            raise ValueError(f"tp: {tp} does not divide this model's {name} ({size}); choose a tp that divides "
                             f"num_attention_heads, num_key_value_heads and intermediate_size")
    if config.vocab_size < tp:
        raise ValueError(f"tp: {tp} is more than this model's vocabulary ({config.vocab_size}); choose a smaller tp")


def parallelize_tensors(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Split `model` (an HF causal LM or token classifier) over the one-dimensional `mesh`, in place."""
    check_tensor_parallel(model.config, mesh.size())
    decoder = model.get_decoder()
    for layer in decoder.layers:
        parallelize_module(layer, mesh, {name: style() for name, style in LAYER_PLAN.items()})
    embedding = decoder.embed_tokens
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=_replicate(), output_layouts=_replicate()))
    if tied:
        head.weight = embedding.weight
    elif head is not None:  # read directly by the log-probs (`RLHead`): its weight only, no forward hooks
        head.weight = torch.nn.Parameter(distribute_tensor(head.weight.data, mesh, [Shard(0)]))


def vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, object] | None:
    """For an LM head weight split by vocabulary rows over a tensor-parallel mesh: (this rank's rows, the first
    vocabulary id they hold, the mesh's process group); None for a whole weight."""
    if not isinstance(weight, DTensor):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(f"an LM head laid out as {weight.placements} over {mesh}: the log-probs take a head split by "
                         "vocabulary rows (Shard(0)) over one tensor-parallel dimension")
    rows = weight.shape[0]
    per_rank = -(-rows // mesh.size())  # torch's split of an uneven dimension: the first ranks hold ceil(rows / n)
    return weight.to_local(), per_rank * mesh.get_local_rank(), mesh.get_group()


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()
