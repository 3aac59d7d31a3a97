"""The FSDP2 strategy: one model sharded over the cluster's workers with torch's `fully_shard`, on a device mesh
(`strategy.parallel`: `baton.strategy.mesh`) that may also split it by tensors (tp), sequences (cp) and layers (pp:
pipeline stages, `baton.strategy.pipeline_parallel`, each sharded over its own ranks) and replicate the shards
(HSDP).

torch.distributed is initialised from the environment the cluster sets (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) by `baton.distributed.rendezvous`, whose store listens on MASTER_ADDR
only: gloo on CPU, nccl on GPU. Each worker's `RankInfo` is its place on the mesh (plain FSDP: dp_rank = rank).
Because FSDP averages gradients over its ranks (dp_replicate × dp_shard × cp), the strategy scales each rank's loss
by that count / the global unit count (summed over the data-parallel ranks), so N workers with shards of any sizes
make the same update as one worker on the whole batch. With `compute_dtype` bfloat16 every shard group
gathers its float32 parameters as bf16 for compute and reduces gradients in float32
(`MixedPrecisionPolicy`), so the optimizer steps float32 shards.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from baton.data import DataProto
from baton.data.shards import WeightPiece
from baton.distributed.rendezvous import init_process_group
from baton.strategy.base import LossFn
from baton.strategy.context_parallel import use_ulysses_attention
from baton.strategy.hf import LossTally, TorchStrategy, default_device
from baton.strategy.mesh import ParallelMesh
from baton.strategy.pipeline_parallel import Pipeline, check_pipeline_parallel, split_into_stage
from baton.strategy.tensor_parallel import parallelize_tensors


class Fsdp2Strategy(TorchStrategy):
    """Implements `TrainStrategy` (training and log-probs; it does not generate: pair it with an `hf` rollout)."""

    def __init__(self, config, device: torch.device | None = None):
        if config.lora is not None:
            raise ValueError("strategy.lora is built for the hf strategy only (one model per worker); train the LoRA "
                             "actor with strategy.name: hf, or drop lora to shard the full model with fsdp2")
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if "RANK" in os.environ:
                init_process_group(backend)
            else:  # the local backend: one in-process worker, a group of one
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        device = device or default_device()
        self.mesh = ParallelMesh.build(config.parallel, device.type)
        self.rank_info = self.mesh.rank_info
        self.pipeline: Pipeline | None = None  # with pp > 1, this rank's stage's schedules (set by `_wrap`)
        super().__init__(config, device)

    def _wrap(self, module):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        compute_dtype = self.config.mixed_precision_dtype
        policy = MixedPrecisionPolicy() if compute_dtype is None else MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32)
        # Each layer gathers its weights at each call, so every rank must call the decoder alike: once per micro-batch
        # whatever its rows (no prompt-sharing pass, no pass per packed bin), or ranks would pair unlike collectives.
        module.one_pass = self.world_size > 1
        # The whole model's weights and ties, in its order: what every rank names in a weight sync and a checkpoint,
        # whichever pipeline stage it holds.
        self.weight_shapes = {name: (tuple(t.shape), t.dtype) for name, t in module.model.state_dict().items()}
        self._ties = super()._tied_names()
        if self.config.parallel.pp > 1:
            self.pipeline = self._pipeline(module)
        if self.config.parallel.tp > 1:
            parallelize_tensors(module.model, self.mesh.tp)
        if self.config.parallel.cp > 1:
            if self.config.packing:
                raise ValueError("packing: true with cp > 1: a context-parallel pass splits padded rows by position and "
                                 "does not pack them; set packing: null (or false), or cp: 1")
            use_ulysses_attention(module.model, self.config.parallel.cp)
            module.context_parallel = self.mesh.cp.get_group()
        for layer in module.model.base_model.layers:
            if layer is not None:  # None: another pipeline stage's
                fully_shard(layer, mesh=self.mesh.fsdp, mp_policy=policy)
        fully_shard(module, mesh=self.mesh.fsdp, mp_policy=policy)
        return module

    def _pipeline(self, module) -> Pipeline:
        """Keep this rank's stage of `module` (`split_into_stage`); its schedules over the pipeline group."""
        pp = self.config.parallel.pp
        check_pipeline_parallel(module.model.config, self.config)
        module.stage = split_into_stage(module.model, self.rank_info.pp_rank, pp)
        tied_group = None
        if module.stage.tied:  # each place in a stage: its ranks in the first and the last stage
            places = self.mesh.mesh.mesh.reshape(pp, -1).T.tolist()
            tied_group, _ = dist.new_subgroups_by_enumeration([[ranks[0], ranks[-1]] for ranks in places])
        return Pipeline(self.mesh.pp.get_group(), module.stage, self.config.mixed_precision_dtype or
                        self.config.torch_dtype, self.device, tied_group)

    def _autocast(self):
        """No autocast: the `MixedPrecisionPolicy` casts the parameters for compute."""
        return contextlib.nullcontext()

    def _eval_outputs(self, batch: DataProto, temperature: float, top_k: int = 0) -> DataProto:
        """As `TorchStrategy._eval_outputs` (forward, top-k log-probs), then reshards the root. FSDP2 keeps the
        root's parameters unsharded after a forward (a backward would reshard them); left so, the module would expose
        the gathered copies instead of the sharded parameters, so an optimizer built next would step copies that the
        next all-gather discards, and loaded weights would land in them too."""
        try:
            return super()._eval_outputs(batch, temperature, top_k)
        finally:
            self.module.reshard()

    def _micro_batch_outputs(self, micro_batches: list[DataProto], temperature: float,
                             top_k: int) -> list[dict[str, torch.Tensor]]:
        """With pp, the micro-batches through the stages; every stage returns the last one's outputs."""
        if self.pipeline is None:
            return super()._micro_batch_outputs(micro_batches, temperature, top_k)
        parts = self.pipeline.forward(micro_batches, lambda micro_batch, hidden: self._outputs(
            micro_batch, temperature, top_k=top_k, hidden_states=hidden))
        return self.pipeline.from_last([{key: value.cpu() for key, value in part.items()} for part in parts])

    def _accumulate_gradients(self, micro_batches: list[DataProto], loss_fn: LossFn, global_units: float) -> LossTally:
        """With pp, the micro-batches on the 1F1B schedule; every stage reports the last one's tally."""
        if self.pipeline is None:
            return super()._accumulate_gradients(micro_batches, loss_fn, global_units)
        tally = LossTally()
        self.pipeline.train(micro_batches, lambda micro_batch, hidden: self._train_outputs(micro_batch, loss_fn, hidden),
                            lambda outputs, micro_batch: self._scaled_loss(outputs, micro_batch, loss_fn, global_units,
                                                                           tally))
        self.pipeline.sum_tied_gradients(self.hf_model)
        return self.pipeline.from_last(tally)

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        """Summed over the ranks that hold different rows (a tp × cp group holds the same ones)."""
        return self._all_reduce(values, dist.ReduceOp.SUM, self.mesh.dp_group)

    def _all_reduce(self, values: list[float], op, group=None) -> list[float]:
        """One collective for all `values` (float64, so sums of token counts stay exact) over `group` (None: all)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(tensor, op=op, group=group)
        return tensor.tolist()

    @property
    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    @property
    def _grad_scale(self) -> float:
        return float(self.mesh.fsdp_size)

    def _clip_gradients(self) -> float:
        """The gradient norm over every rank's parameters (every pipeline stage's), each element counted once (a shard
        by the ranks that hold it, a replicated tensor once, a tied embedding as the first stage's), then every
        gradient scaled to `grad_clip`."""
        tied_copy = None if self.pipeline is None else self.pipeline.tied_copy(self.hf_model)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        stage_size = self.world_size // self.config.parallel.pp  # the ranks that hold this stage's parameters
        for grad in grads:
            if tied_copy is not None and grad is tied_copy.grad:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            squares += torch.linalg.vector_norm(local, dtype=torch.float32) ** 2 / _copies(grad, stage_size)
        squares = squares.to(self._collective_device)
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        if self.config.grad_clip is not None and norm > self.config.grad_clip:
            scale = self.config.grad_clip / (norm + 1e-6)  # torch's clip_grad_norm_
            for grad in grads:
                grad.mul_(scale)
        return norm

    def _micro_batches(self, batch: DataProto) -> list[DataProto]:
        """Every rank runs the same number of forward/backward passes (FSDP's collectives must pair up);
        ranks with fewer micro-batches repeat a row, flagged so its loss counts zero."""
        if len(batch) == 0:
            raise ValueError("fsdp2 needs at least one row on every worker; give the cluster fewer workers or more rows")
        pieces = super()._micro_batches(batch)
        [most] = self._all_reduce([len(pieces)], dist.ReduceOp.MAX)
        for _ in range(int(most) - len(pieces)):
            filler = batch[:1]
            filler.meta_info["baton_padding"] = True
            pieces.append(filler)
        return pieces

    def weight_pieces(self) -> Iterator[WeightPiece]:
        """Every weight of the whole model, each as this rank holds its rows once laid out by rows over its mesh (a
        sharded weight is redistributed, an all-to-all at most, never gathered whole); a rank sends them where no
        lower rank of its pipeline stage holds the same rows (the first of a weight's replicas, the one holding the
        stage's first rank). Another stage's weights come with no rows."""
        state = self.hf_model.state_dict()
        first = self.mesh.stage_first_rank
        for name, tied_to in self._tied_order(self.weight_shapes):
            shape, dtype = self.weight_shapes[name]
            tensor = state.get(name)
            if tied_to is not None:
                yield WeightPiece(name, None, shape, dtype, 0, tied_to)
            elif tensor is None:
                yield WeightPiece(name, None, shape, dtype)
            elif isinstance(tensor, DTensor) and tensor.dim() > 0:
                mesh = tensor.device_mesh
                by_rows = tensor.redistribute(mesh, [Shard(0)] * mesh.ndim)
                _, offset = compute_local_shape_and_global_offset(shape, mesh, by_rows.placements)
                sends = bool((mesh.mesh == first).any())
                yield WeightPiece(name, by_rows.to_local() if sends else None, shape, dtype, offset[0])
            else:
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                yield WeightPiece(name, whole if self.rank == first else None, shape, dtype)

    def weight_fingerprints(self, names: list[str]) -> dict[str, int] | None:
        return None  # a sharded model's weights are not computed here; a sync into one is probe-checked

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathers one parameter at a time (all ranks take part); only rank 0 keeps the full tensors, on CPU (with pp,
        each stage's first rank its stage's, which rank 0 then joins: the stages hold the model's weights in order).

        Tied names (the embeddings and the LM head) get one shared tensor, as in HF's own state dict, so
        `save_pretrained` writes it once."""
        tied = self._tied_names()
        full = {}
        for name, tensor in self.hf_model.state_dict().items():
            if tied.get(name, name) != name:
                continue
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            if self.rank == self.mesh.stage_first_rank:
                full[name] = tensor.detach().cpu()
        full = {name: tensor for stage in self._join_stages(full) for name, tensor in stage.items()}
        if self.rank == 0:
            full.update({name: full[first] for name, first in tied.items() if first != name})
        return full

    def _load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The weights of `state` this rank holds (with pp, its stage's; a stage's copy of a tied embedding takes the
        embedding's value)."""
        own = self.hf_model.state_dict()
        unknown = set(state) - set(self.weight_shapes)
        if unknown:
            raise ValueError(f"weights {sorted(unknown)[:5]} do not exist in this model; the two sides hold different architectures")
        tied = self._tied_names()
        values = {tied.get(name, name): value for name, value in state.items()}  # by the weight's first name
        with torch.no_grad():
            for name, target in own.items():
                first = tied.get(name, name)
                if (first != name and first in own) or first not in values:  # a tied name of a weight loaded as such
                    continue
                value = values[first]
                if isinstance(target, DTensor):
                    target.to_local().copy_(self._shard_like(value, target).to_local())
                else:
                    target.copy_(value)

    def _is_writer(self) -> bool:
        return self.rank == 0

    def _barrier(self) -> None:
        dist.barrier()

    def _rank_suffix(self) -> str:
        return f"_rank{self.rank}"

    def _tied_names(self) -> dict[str, str]:
        """As the whole model ties its weights (recorded before a pipeline stage keeps its part)."""
        return self._ties

    def _retie_weights(self) -> None:
        """Pipeline stages hold no tie to restore (a tied copy is loaded as the embedding's value)."""
        if self.pipeline is None:
            super()._retie_weights()

    def _optimizer_param_names(self) -> list[str]:
        """A pipeline stage's copy of a tied embedding under the embedding's name: saved once, loaded into both."""
        tied = {f"model.{alias}": f"model.{name}" for alias, name in self._tied_names().items()}  # RLHead's `model`
        return [tied.get(name, name) for name in super()._optimizer_param_names()]

    def _join_stages(self, part):
        """Gathered from each stage's first rank (the pipeline group of rank 0) to rank 0."""
        if self.pipeline is None:
            return [part]
        return self.pipeline.gather(part) if self.rank == self.mesh.stage_first_rank else []

    def _every_stage(self, part):
        return [part] if self.pipeline is None else self.pipeline.all_gather(part)

    def _whole_tensor(self, tensor):
        if not isinstance(tensor, DTensor):
            return tensor
        whole = tensor.full_tensor()  # a collective: every rank of the stage gathers each state tensor in one order
        return whole.cpu() if self.rank == self.mesh.stage_first_rank else None

    def _shard_like(self, value, param: torch.Tensor):
        if not (isinstance(param, DTensor) and torch.is_tensor(value) and value.dim() > 0):
            return super()._shard_like(value, param)
        whole = DTensor.from_local(value.to(self.device), param.device_mesh, [_replicate()] * param.device_mesh.ndim)
        return whole.redistribute(param.device_mesh, param.placements)

    def _load_optimizer_shard(self, state: dict) -> None:
        """A checkpoint saved before whole-tensor optimizer states: this rank's shard, for the same layout only."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, entry in state["state"].items():
            param = params[index]
            if isinstance(param, DTensor):
                entry.update({
                    k: DTensor.from_local(v.to(self.device), param.device_mesh, param.placements, shape=param.shape,
                                          stride=param.stride())
                    for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0
                })
        self.optimizer.load_state_dict(state)


def _copies(tensor: torch.Tensor, world_size: int) -> int:
    """How many of `world_size` ranks hold each element of `tensor`: all of them for a plain tensor; for a DTensor,
    all but the split of the mesh dimensions it is sharded over."""
    if not isinstance(tensor, DTensor):
        return world_size
    shards = 1
    for dim, placement in enumerate(tensor.placements):
        if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over a tensor-parallel shard (not is_shard())
            shards *= tensor.device_mesh.size(dim)
    return world_size // shards


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()
