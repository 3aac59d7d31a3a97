"""Pipeline parallelism for the fsdp2 strategy: a causal LM's (or critic's) decoder layers split into `pp` contiguous
stages, run on a 1F1B schedule of explicit point-to-point sends over the pipeline group.

Stage 0 also holds the embedding; the last stage the final norm and the RL head (log-probs and entropy, or values),
so the loss runs there. A stage keeps the whole model's module tree with the other stages' modules set to None, so
its parameters keep their global HF names (`model.layers.2...` on the second of two stages of a 4-layer model):
state dicts, checkpoints and weight syncs need no renaming. An LM head tied to the embedding becomes a copy of it on
the last stage; the two stages sum their gradients of it (`sum_tied_gradients`) before the optimizer steps both
alike, so the copies stay equal, and the strategy counts, saves and sends the weight once, as the first stage's.

Why not `torch.distributed.pipelining` (PipelineStage, Schedule1F1B): its schedules split one batch into equal
micro-batches of fixed shapes and call `loss_fn(output, target)` with one target tensor, while a baton train step
runs micro-batches of unequal rows and widths (token-budget splits, `trim_padding`), each through a loss that reads
several per-row columns of its `DataProto` and returns metrics, and flags padding micro-batches that count zero. Every
rank of a pipeline group holds the same rows (the dispatch gives a model-parallel group one shard), so each stage
knows every micro-batch itself; only the hidden states travel forward (with their shape, which `trim_padding` sets)
and their gradients back. Sends are asynchronous (`isend`) and receives blocking, so the 1F1B order (each stage runs
`pp - 1 - stage` forwards ahead, then alternates one forward and one backward, holding at most `pp - stage`
micro-batches' activations) cannot deadlock. Tested on gloo (CPU); nccl has not run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from baton.data import DataProto


def check_pipeline_parallel(config, strategy) -> None:
    """ValueError, naming the fix, for a model (its HF `config`) or settings (a `StrategyConfig`, its parallel.pp > 1)
    that pipeline stages cannot take."""
    parallel, pp = strategy.parallel, strategy.parallel.pp
    if parallel.tp > 1 or parallel.cp > 1:
        raise ValueError(f"pp: {pp} with tp: {parallel.tp}, cp: {parallel.cp}: pipeline stages are built with data "
                         "parallel only (dp_shard, dp_replicate); set tp: 1 and cp: 1, or pp: 1")
    if strategy.packing:
        raise ValueError("packing: true with pp > 1: a pipeline stage runs the padded rows and does not pack them; set "
                         "packing: null (or false), or pp: 1")
    layers = getattr(config, "num_hidden_layers", None)
    if layers is None:
        raise ValueError(f"pipeline parallelism splits Qwen2 and Llama-family models by decoder layer; this model's "
                         f"config has no num_hidden_layers ({type(config).__name__}); train it with pp: 1")
    if layers < pp or layers % pp:
        raise ValueError(f"pp: {pp} does not divide this model's {layers} decoder layers into equal stages; choose a pp "
                         "that divides num_hidden_layers")


@dataclass(frozen=True)
class Stage:
    """This rank's stage: `index` of `num_stages`, holding decoder layers `layers` (global indices); `tied`: the
    model's LM head is tied to its embedding, which the first and the last stage then both hold."""

    index: int
    num_stages: int
    layers: range
    tied: bool = False

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def split_into_stage(model: torch.nn.Module, index: int, num_stages: int) -> Stage:
    """Keep only stage `index`'s modules of `model` (an HF causal LM or token classifier), in place: the other stages'
    decoder layers, and the embedding (but on the first stage) and the final norm and head (but on the last), become
    None, so the parameters left keep their names. A tied LM head on the last stage becomes a copy of the embedding."""
    decoder = model.get_decoder()
    per_stage = len(decoder.layers) // num_stages
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is decoder.embed_tokens.weight
    stage = Stage(index, num_stages, range(index * per_stage, (index + 1) * per_stage), tied)
    if tied and stage.is_last:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    for layer in range(len(decoder.layers)):
        if layer not in stage.layers:
            decoder.layers[layer] = None
    if not stage.is_first:
        decoder.embed_tokens = None
    if not stage.is_last:
        decoder.norm = None
        setattr(model, "score" if hasattr(model, "score") else "lm_head", None)  # a critic's value head, or the LM's
    return stage


def stage_hidden_states(model: torch.nn.Module, stage: Stage, input_ids: torch.Tensor,
                        hidden_states: torch.Tensor | None, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor) -> torch.Tensor:
    """The stage's layers over the padded rows, as the HF decoder runs them: from the embedding of `input_ids` (first
    stage) or the previous stage's `hidden_states` [rows, seq, hidden]; after the final norm on the last stage."""
    decoder = model.get_decoder()
    config = decoder.config
    if stage.is_first:
        hidden_states = decoder.embed_tokens(input_ids)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    mask_kwargs = dict(config=config, inputs_embeds=hidden_states, attention_mask=attention_mask, cache=None,
                       position_ids=position_ids)
    masks = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    masks = {kind: masks[kind](**mask_kwargs) for kind in {layer_types[layer] for layer in stage.layers}}
    position_embeddings = decoder.rotary_emb(hidden_states, position_ids)
    for layer in stage.layers:
        hidden_states = decoder.layers[layer](hidden_states, attention_mask=masks[layer_types[layer]],
                                              position_embeddings=position_embeddings, position_ids=position_ids)
    return decoder.norm(hidden_states) if stage.is_last else hidden_states


# run(micro_batch, hidden states from the previous stage or None) -> the module's outputs: {"hidden_states"} before
# the last stage, the head's outputs on it.
RunStage = Callable[[DataProto, "torch.Tensor | None"], dict]


class Pipeline:
    """The schedules of one rank's stage over its pipeline group (the ranks that differ only in stage)."""

    def __init__(self, group, stage: Stage, dtype: torch.dtype, device: torch.device, tied_group=None):
        """`tied_group`: this rank's pair of the first and last stage (same place in each), where the stages share a
        tied embedding."""
        self.group, self.stage, self.dtype, self.device, self.tied_group = group, stage, dtype, device, tied_group
        self.prev = None if stage.is_first else dist.get_global_rank(group, stage.index - 1)
        self.next = None if stage.is_last else dist.get_global_rank(group, stage.index + 1)
        self._sends: list = []  # (work, tensor): a tensor stays alive until its send completes

    def tied_copy(self, model: torch.nn.Module) -> torch.nn.Parameter | None:
        """The last stage's copy of a tied embedding (its LM head's weight): counted, saved and sent as the first
        stage's weight, not again."""
        return model.get_output_embeddings().weight if self.stage.tied and self.stage.is_last else None

    def sum_tied_gradients(self, model: torch.nn.Module) -> None:
        """A tied embedding's gradient summed over the first stage (the embedding's use) and the last (the LM head's),
        in place on both: each holds its shard alike, so the local shards add up."""
        if not self.stage.tied or not (self.stage.is_first or self.stage.is_last):
            return
        weight = model.get_input_embeddings().weight if self.stage.is_first else self.tied_copy(model)
        grad = weight.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.tied_group)

    def forward(self, micro_batches: list[DataProto], run: RunStage) -> list[dict]:
        """Each micro-batch through the stages (no gradients); the head's outputs, on the last stage ([] elsewhere)."""
        outputs = []
        for micro_batch in micro_batches:
            out = run(micro_batch, None if self.stage.is_first else self._recv_activation())
            if self.stage.is_last:
                outputs.append(out)
            else:
                self._send_activation(out["hidden_states"])
        self._wait_sends()
        return outputs

    def train(self, micro_batches: list[DataProto], run: RunStage,
              loss: Callable[[dict, DataProto], torch.Tensor]) -> None:
        """Forward and backward of every micro-batch on the 1F1B schedule, gradients accumulated in the stage's
        parameters; `loss(outputs, micro_batch)`, the scaled loss to run backward from, on the last stage."""
        inputs, outputs = deque(), deque()  # of the micro-batches run forward and not yet backward, oldest first

        def forward(micro_batch: DataProto) -> None:
            hidden = None if self.stage.is_first else self._recv_activation()
            out = run(micro_batch, hidden)
            if self.stage.is_last:
                out = loss(out, micro_batch)
            else:
                out = out["hidden_states"]
                self._send_activation(out)
            inputs.append(hidden)
            outputs.append(out)

        def backward() -> None:
            hidden, out = inputs.popleft(), outputs.popleft()
            if self.stage.is_last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, self.next)
                out.backward(grad)
            if not self.stage.is_first:
                self._send(hidden.grad, self.prev)

        warmup = min(self.stage.num_stages - 1 - self.stage.index, len(micro_batches))
        for micro_batch in micro_batches[:warmup]:
            forward(micro_batch)
        for micro_batch in micro_batches[warmup:]:
            forward(micro_batch)
            backward()
        for _ in range(warmup):
            backward()
        self._wait_sends()

    def from_last(self, value):
        """The last stage's `value` (any picklable object), on every stage."""
        objects = [value]
        dist.broadcast_object_list(objects, group=self.group, group_src=self.stage.num_stages - 1)
        return objects[0]

    def gather(self, value) -> list:
        """Every stage's `value`, in stage order, on the group's first rank ([] elsewhere)."""
        gathered = [None] * self.stage.num_stages if self.stage.is_first else None
        dist.gather_object(value, gathered, group=self.group, group_dst=0)
        return gathered or []

    def all_gather(self, value) -> list:
        """Every stage's `value`, in stage order, on every stage."""
        gathered = [None] * self.stage.num_stages
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def _send_activation(self, hidden: torch.Tensor) -> None:
        """The shape first ([rows, seq, hidden]: `trim_padding` sets seq per micro-batch), then the values."""
        self._send(torch.tensor(hidden.shape, dtype=torch.long, device=hidden.device), self.next)
        self._send(hidden, self.next)

    def _recv_activation(self) -> torch.Tensor:
        shape = torch.empty(3, dtype=torch.long, device=self.device)
        dist.recv(shape, self.prev)
        hidden = torch.empty(tuple(shape.tolist()), dtype=self.dtype, device=self.device)
        dist.recv(hidden, self.prev)
        return hidden.requires_grad_(torch.is_grad_enabled())

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        self._sends.append((dist.isend(tensor, dst), tensor))

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
