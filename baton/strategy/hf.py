"""The HF strategy: one full model copy per worker, plain transformers + torch. The reference implementation.

Runs on CPU or one GPU. Generation runs the `hf` engine's sampling loop (`baton.strategy.sampling`) over the
whole prompt batch; log-probs come from hidden states a chunk of tokens at a time; training accumulates
gradients over micro-batches and normalises the loss by the batch's global unit count. With
`compute_dtype` bfloat16 the float32 parameters compute under `torch.autocast`. With `lora` the model trains a
peft LoRA adapter (`baton.strategy.lora`) and exports and checkpoints as `TorchStrategy` says.
`TorchStrategy` holds everything but generation; `Fsdp2Strategy` shares it by overriding the
methods under "(distributed hooks)".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch

from baton.algorithms.aggregation import LOSS_UNITS, count_loss_units
from baton.checkpoint import has_state, load_state, save_state, writing
from baton.data import DataProto
from baton.data.shards import WeightPiece, fingerprint
from baton.models import build_model, load_tokenizer, model_config, save_tokenizer
from baton.strategy.base import LossFn, SamplingParams, StrategyConfig, metric_sum_count
from baton.strategy.head import RLHead
from baton.strategy.logprobs import position_ids_from_mask, sampling_temperature
from baton.strategy.lora import adapter_state, add_lora, has_adapter, load_adapter, merged_state_dict, save_adapter
from baton.strategy.padding import pad_responses, trim_padding
from baton.strategy.sampling import generation_output, prompt_row_seeds, sample


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_role_model(config: StrategyConfig):
    """The model of a role: a causal LM, or (kind "value") a one-output token classifier used as a critic."""
    from_directory = isinstance(config.model, str) and os.path.isdir(config.model)
    if config.kind == "causal_lm":  # the seed initialises new weights; a checkpoint's are loaded as they are
        return build_model(config.model, dtype=config.torch_dtype, seed=None if from_directory else config.seed)
    from transformers import AutoConfig, AutoModelForTokenClassification

    model_cfg = AutoConfig.from_pretrained(config.model, local_files_only=True) if from_directory else model_config(config.model)
    model_cfg.num_labels = 1
    # The token-classification head applies dropout 0.1 by default: values in train_step would be
    # noisy and differ from forward()'s for the same weights.
    model_cfg.classifier_dropout = 0.0
    # Seeds the new value head of a loaded backbone too; CPU generator only, as in `build_model`.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(config.seed)
        if from_directory:
            return AutoModelForTokenClassification.from_pretrained(
                config.model, config=model_cfg, dtype=config.torch_dtype, local_files_only=True
            )
        return AutoModelForTokenClassification.from_config(model_cfg, dtype=config.torch_dtype)


def split_micro_batches(batch: DataProto, rows: int | None, max_tokens: int | None) -> list[DataProto]:
    """Consecutive micro-batches of at most `rows` rows, or greedily up to `max_tokens` real tokens each."""
    if rows is not None:
        return batch.split(rows)
    if max_tokens is None:
        return [batch]
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    pieces, start, used = [], 0, 0
    for row, length in enumerate(lengths):
        if row > start and used + length > max_tokens:
            pieces.append(batch[start:row])
            start, used = row, 0
        used += length
    pieces.append(batch[start:])
    return pieces


def lr_lambda(config: StrategyConfig):
    sched = config.scheduler
    if sched.name not in ("constant", "linear", "cosine"):
        raise ValueError(f"scheduler {sched.name!r} is not one of 'constant', 'linear', 'cosine'")
    if sched.name != "constant" and not sched.total_steps:
        raise ValueError(f"scheduler {sched.name!r} needs scheduler.total_steps")

    def factor(step: int) -> float:
        if step < sched.warmup_steps:
            return (step + 1) / sched.warmup_steps
        if sched.name == "constant":
            return 1.0
        progress = min(1.0, (step - sched.warmup_steps) / max(1, sched.total_steps - sched.warmup_steps))
        decay = 1.0 - progress if sched.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * decay

    return factor


@dataclass
class LossTally:
    """A rank's loss (summed over its micro-batches, over the global unit count) and its loss function's metrics
    (name -> [sum, count], see `LossFn`)."""

    loss: float = 0.0
    metric_sums: dict[str, list[float]] = field(default_factory=dict)


def copy_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy `state`'s weights (any subset, HF names) into `model`'s own tensors (`where` names it in errors), cast to
    their dtype and device: what `load_state_dict(strict=False)` does for a plain HF model, without its walk over every
    module (milliseconds a call, and a streamed weight sync calls this once a bucket). A weight already in place (put
    together in the model's own tensor) is not copied again."""
    own = model.state_dict(keep_vars=True)
    unknown = set(state) - set(own)
    if unknown:
        raise ValueError(f"weights {sorted(unknown)[:5]} do not exist in {where}; the two sides hold different "
                         "architectures")
    with torch.no_grad():
        for name, value in state.items():
            target = own[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r} arrived with shape {tuple(value.shape)}, but {where}'s is "
                                 f"{tuple(target.shape)}; the two sides hold different architectures")
            if not (value.data_ptr() == target.data_ptr() and value.dtype == target.dtype
                    and value.stride() == target.stride()):
                target.copy_(value)


class TorchStrategy:
    """Everything but generation, for a torch model: forward, train_step, weights, checkpoints, offload.

    `hf_model` is the transformers model; `module` wraps it (an `RLHead`) and is what runs forward
    and backward: the FSDP2 strategy shards `module`.

    With `config.lora`, peft injects a LoRA adapter into `hf_model` in place and freezes its other weights;
    `peft_model` (the `PeftModel` around it) switches the adapter off (`base_forward`) and saves it. Only the
    adapter's weights go to the optimizer. `export_weights` gives the merged weights (W + scale · B A) in plain HF
    names, so a rollout receives a plain model; a checkpoint holds the adapter in peft's format
    (adapter_model.safetensors, adapter_config.json) beside the optimizer state, its base being the role's
    `model`; `save_merged` writes the merged model as an HF directory.
    """

    rank_info = None  # a model-parallel layout's `RankInfo` (fsdp2 with strategy.parallel); None: plain data parallel

    def __init__(self, config: StrategyConfig, device: torch.device | None = None):
        self.config = config
        self.device = device or default_device()
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.hf_model = build_role_model(config).to(self.device)
        self.peft_model = add_lora(self.hf_model, config.lora, config.seed) if config.lora is not None else None
        if config.gradient_checkpointing:
            self.hf_model.gradient_checkpointing_enable()
        self.module = self._wrap(RLHead(self.hf_model, config.kind, config.logprob_chunk_size, config.packing))
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.global_step = 0

    # --- (distributed hooks) ----------------------------------------------------------------

    def _wrap(self, model):
        return model

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        """Each value summed over data-parallel ranks."""
        return values

    def _autocast(self):
        """Mixed precision (`compute_dtype`): matmuls and attention in bf16 from the float32 parameters, which keep
        float32 gradients; autocast leaves norms and softmax in float32, and the loss runs outside it."""
        dtype = self.config.mixed_precision_dtype
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    @property
    def _grad_scale(self) -> float:
        """Factor that undoes any averaging of gradients over data-parallel ranks."""
        return 1.0

    def _micro_batches(self, batch: DataProto) -> list[DataProto]:
        return split_micro_batches(batch, self.config.micro_batch_size_per_worker, self.config.max_tokens_per_microbatch)

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters in HF names, on the writer rank (others: {}); with LoRA, merged."""
        return self.hf_model.state_dict() if self.peft_model is None else merged_state_dict(self.hf_model)

    def _load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        copy_weights(self.hf_model, state, "this model")

    def _is_writer(self) -> bool:
        return True

    def _barrier(self) -> None:
        pass

    def _rank_suffix(self) -> str:
        return ""

    def _join_stages(self, part):
        """Every pipeline stage's `part` (a stage's first rank's), in stage order, on the writer; one stage: [part]."""
        return [part]

    def _every_stage(self, part):
        """Every pipeline stage's `part`, in stage order, on every rank; one stage: [part]."""
        return [part]

    # --- inference ------------------------------------------------------------------------------

    def _outputs(self, batch: DataProto, temperature: float, with_entropy: bool = True, entropy_grad: bool = True,
                 log_probs_at: str | None = None, top_k: int = 0,
                 hidden_states: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The module's outputs (see `RLHead`); `log_probs_at` names a batch column of token ids [rows, len, k];
        `hidden_states`: a pipeline stage's input from the previous stage. Runs without the batch's all-padding columns
        (`trim_padding`); the outputs come back at the batch's width (a stage's hidden states, at the trimmed one: the
        next stage trims alike)."""
        tail = 0
        if self.config.trim_padding:
            batch, tail = trim_padding(batch)
        data = batch.batch
        attention_mask = data["attention_mask"].to(self.device)
        position_ids = data["position_ids"].to(self.device) if "position_ids" in data else position_ids_from_mask(attention_mask)
        ids = None
        if log_probs_at is not None:
            if log_probs_at not in data:
                raise ValueError(f"the loss asks for the log-probs at the token ids in column {log_probs_at!r}, which "
                                 f"this batch lacks (it has {sorted(data.keys())}); compute it first")
            ids = data[log_probs_at].to(self.device)
        with self._autocast():
            outputs = self.module(data["input_ids"].to(self.device), attention_mask, position_ids,
                                  data["responses"].to(self.device), temperature, with_entropy, entropy_grad,
                                  log_probs_at=ids, top_k=top_k, hidden_states=hidden_states)
        return outputs if "hidden_states" in outputs else pad_responses(outputs, tail)

    @torch.no_grad()
    def _eval_outputs(self, batch: DataProto, temperature: float, top_k: int = 0) -> DataProto:
        """The module's outputs over the batch's micro-batches, joined on CPU (a padding micro-batch's rows cut)."""
        self.module.eval()
        parts = self._micro_batch_outputs(self._micro_batches(batch), temperature, top_k)
        return DataProto.from_dict({k: torch.cat([p[k] for p in parts])[: len(batch)].cpu() for k in parts[0]})

    def _micro_batch_outputs(self, micro_batches: list[DataProto], temperature: float,
                             top_k: int) -> list[dict[str, torch.Tensor]]:
        """The module's outputs of each micro-batch (`_outputs`)."""
        return [self._outputs(micro_batch, temperature, top_k=top_k) for micro_batch in micro_batches]

    def forward(self, batch: DataProto, temperature: float = 1.0) -> DataProto:
        return self._eval_outputs(batch, temperature)

    def base_forward(self, batch: DataProto, temperature: float = 1.0) -> DataProto:
        """`forward` of the model without its LoRA adapter: the initial model, a reference without a second copy."""
        if self.peft_model is None:
            raise ValueError("base_forward is the model with its LoRA adapter off, and this role has none; set "
                             "strategy.lora, or take the reference's log-probs from a reference role")
        with self.peft_model.disable_adapter():
            return self._eval_outputs(batch, temperature)

    def top_k_log_probs(self, batch: DataProto, k: int, temperature: float = 1.0) -> DataProto:
        """`top_k_log_probs` (float32) and `top_k_ids` (int64), each [rows, response_len, k]: each response position's
        k most likely next tokens (a distillation teacher's scores). Only these leave the strategy, never the
        full-vocabulary distribution."""
        return self._eval_outputs(batch, temperature, top_k=k)

    # --- training --------------------------------------------------------------------------------

    def _ensure_optimizer(self) -> None:
        if self.optimizer is None:
            if self.config.dtype != "float32":
                warnings.warn(f"training {self.config.dtype} parameters: AdamW updates them in {self.config.dtype}, "
                              "where small updates round away (a 1e-6 learning-rate step moves most weights not at "
                              "all); train with dtype: float32 and compute_dtype: bfloat16", stacklevel=3)
            opt = self.config.optimizer
            trained = [p for p in self.module.parameters() if p.requires_grad]  # with LoRA, the adapter's only
            # fused: one kernel a step and no temporaries; torch's default on CPU (neither foreach nor fused) makes two
            # copies of each weight it steps: 1 GB for the tied embedding of a 0.5B model (docs/scale.md).
            self.optimizer = torch.optim.AdamW(trained, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                               weight_decay=opt.weight_decay, fused=True)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.config))

    def train_step(self, batch: DataProto, loss_fn: LossFn, loss_unit: str = "token") -> dict[str, float]:
        if loss_unit not in LOSS_UNITS:
            raise ValueError(f"loss_unit {loss_unit!r} is not one of {list(LOSS_UNITS)}")
        self._ensure_optimizer()
        self.module.train()
        # The loss sums over units (tokens, sequences with a valid token); "none" (token-sum) is divided by 1.
        local_units = float(count_loss_units(batch.batch["response_mask"], loss_unit))
        [global_units] = self._all_reduce_sum([local_units])
        global_units = max(global_units, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        tally = self._accumulate_gradients(self._micro_batches(batch), loss_fn, global_units)
        grad_norm = self._clip_gradients()
        lr = self.scheduler.get_last_lr()[0]  # this update's lr; scheduler.step() sets the next step's
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        # One collective for the loss and every metric: [loss, sum_1, count_1, sum_2, count_2, ...]; the same
        # names on every rank (see `LossFn`), in sorted order.
        names = sorted(tally.metric_sums)
        totals = self._all_reduce_sum([tally.loss, *(x for name in names for x in tally.metric_sums[name])])
        metrics = {name: totals[1 + 2 * i] / max(totals[2 + 2 * i], 1.0) for i, name in enumerate(names)}
        return {"loss": totals[0], "grad_norm": grad_norm, "lr": lr, **metrics}

    def _accumulate_gradients(self, micro_batches: list[DataProto], loss_fn: LossFn, global_units: float) -> LossTally:
        """Forward and backward of each micro-batch, the gradients summed in the parameters; this rank's tally."""
        tally = LossTally()
        for micro_batch in micro_batches:
            outputs = self._train_outputs(micro_batch, loss_fn)
            self._scaled_loss(outputs, micro_batch, loss_fn, global_units, tally).backward()
        return tally

    def _train_outputs(self, micro_batch: DataProto, loss_fn: LossFn,
                       hidden_states: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The outputs `loss_fn` takes. A loss with `log_probs_at` (a column of token ids [rows, len, k]) also gets
        their log-probs (distillation)."""
        return self._outputs(micro_batch, temperature=sampling_temperature(micro_batch),
                             entropy_grad=getattr(loss_fn, "entropy_grad", True),
                             log_probs_at=getattr(loss_fn, "log_probs_at", None), hidden_states=hidden_states)

    def _scaled_loss(self, outputs: dict[str, torch.Tensor], micro_batch: DataProto, loss_fn: LossFn,
                     global_units: float, tally: LossTally) -> torch.Tensor:
        """The micro-batch's loss as its backward pass takes it (over the global unit count, times `_grad_scale`);
        its loss and metrics added to `tally`."""
        micro_batch = micro_batch.to(self.device)
        loss_sum, metrics = loss_fn(outputs, micro_batch)
        padding = micro_batch.meta_info.get("baton_padding")  # keeps collectives in step; contributes nothing
        if padding:
            loss_sum = loss_sum * 0.0
        tally.loss += float(loss_sum.detach()) / global_units
        for key, value in metrics.items():
            total, count = (0.0, 0.0) if padding else metric_sum_count(value)
            sums = tally.metric_sums.setdefault(key, [0.0, 0.0])
            sums[0], sums[1] = sums[0] + total, sums[1] + count
        return loss_sum * (self._grad_scale / global_units)

    def _clip_gradients(self) -> float:
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return float(norm)

    # --- weights -----------------------------------------------------------------------------------

    def export_weights(self, bucket_bytes: int = 256 << 20) -> Iterator[dict[str, torch.Tensor]]:
        """The whole weights in HF names (with LoRA, merged), in buckets of about `bucket_bytes`, on the writer rank
        (a sharded model gathers them there: for checks and in-process use; a weight sync sends `weight_pieces`)."""
        bucket, size = {}, 0
        for name, tensor in self._full_state_dict().items():
            bucket[name] = tensor
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = {}, 0
        if bucket:
            yield bucket

    def weight_pieces(self) -> Iterator[WeightPiece]:
        """Every weight in HF names (with LoRA, merged), in the same order on every rank, with this rank's rows of it
        or None (what a weight sync sends, `baton.data.shards`). One process: every weight whole."""
        state = self._full_state_dict()
        for name, tied_to in self._tied_order(state):
            tensor = state[name]
            yield WeightPiece(name, tensor if tied_to is None else None, tuple(tensor.shape), tensor.dtype, 0, tied_to)

    def _tied_order(self, names) -> Iterator[tuple[str, str | None]]:
        """`names` (a state dict's) with the weight each shares a tensor with (the embeddings and a tied LM head), or
        None: a weight first, then its tied names."""
        tied = self._tied_names()
        aliases: dict[str, list[str]] = {}
        for name in names:
            if tied.get(name, name) != name:
                aliases.setdefault(tied[name], []).append(name)
        for name in names:
            if tied.get(name, name) == name:
                yield name, None
                for alias in aliases.get(name, []):
                    yield alias, name

    def _tied_names(self) -> dict[str, str]:
        """Each weight name → the first name of the parameter it is (the embeddings and a tied LM head share one)."""
        first: dict[int, str] = {}
        return {name: first.setdefault(id(param), name)
                for name, param in self.hf_model.named_parameters(remove_duplicate=False)}

    def weight_fingerprints(self, names: list[str]) -> dict[str, int] | None:
        """`baton.data.shards.fingerprint` of each named weight this model serves (a sync's destination proves with
        them which values it holds); None where the model is sharded (not computed)."""
        state = self.hf_model.state_dict()
        return {name: fingerprint(state[name]) for name in names if name in state}

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of this model's floating weights: what a weight sync into it sends."""
        return self.config.torch_dtype

    def export_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The LoRA adapter alone (`adapter_state`: peft's tensors and adapter_config.json), for a rollout that serves
        adapters on its own copy of the base (`syncs_policy_adapter`)."""
        if self.peft_model is None:
            raise ValueError("export_adapter on a role without strategy.lora: it has no adapter; use export_weights")
        return adapter_state(self.peft_model)

    def import_weights(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        if self.peft_model is not None:
            raise ValueError("a role with a LoRA adapter takes no weights: its base is its `model` and its adapter "
                             "trains; send weights to a role without lora")
        for bucket in buckets:
            self._load_full_state_dict({k: v.to(self.device) for k, v in bucket.items()})

    # --- offload -------------------------------------------------------------------------------------

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU memory. On a CPU device there is nothing to move: no-op."""
        if self.device.type == "cpu":
            return
        self.module.to("cpu")
        for state in (self.optimizer.state.values() if self.optimizer else []):
            for key, value in state.items():
                if torch.is_tensor(value):
                    state[key] = value.to("cpu", non_blocking=True)
        torch.cuda.synchronize(self.device)  # non-blocking device-to-host copies are not readable until then
        torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring everything `offload` moved back to the device. No-op on CPU."""
        if self.device.type == "cpu":
            return
        self.module.to(self.device)
        for state in (self.optimizer.state.values() if self.optimizer else []):
            for key, value in state.items():
                if torch.is_tensor(value):
                    state[key] = value.to(self.device, non_blocking=True)

    # --- checkpoints ---------------------------------------------------------------------------------

    def save_checkpoint(self, path: str, overwrite: bool = False) -> None:
        """Write `path` atomically: HF model files (safetensors) + optimizer, scheduler and RNG state files
        (`baton.checkpoint`: safetensors and JSON, nothing pickled).

        Everything goes to `path + ".partial"` first and is renamed at the end, so an interrupted
        write leaves any earlier checkpoint intact. An existing `path` is replaced only with `overwrite`.
        A full disk, a read-only file system or a denied permission raises CheckpointError in words.
        """
        path = os.path.abspath(path)
        partial = path + ".partial"
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"checkpoint {path} exists; pass overwrite=True or choose another path")
        with writing(path, partial, remove=self._is_writer()):
            if self._is_writer():
                shutil.rmtree(partial, ignore_errors=True)
                os.makedirs(partial)
            self._barrier()
            state = self._full_state_dict() if self.peft_model is None else None
            if self._is_writer():
                if self.peft_model is None:
                    self.hf_model.save_pretrained(partial, state_dict=state, safe_serialization=True)
                else:  # the adapter, and the base's config.json (for the tokenizer; no weights beside it)
                    save_adapter(self.peft_model, partial)
                    self.hf_model.config.save_pretrained(partial)
                save_tokenizer(self.tokenizer, partial)  # after config.json, which AutoTokenizer reads
                with open(os.path.join(partial, "trainer_state.json"), "w") as f:
                    json.dump({"global_step": self.global_step}, f)
                if self.scheduler is not None:
                    save_state(os.path.join(partial, "scheduler.state"), self.scheduler.state_dict())
            if self.optimizer is not None:
                optimizer_state = self._optimizer_state()  # every rank takes part
                if self._is_writer():
                    save_state(os.path.join(partial, "optimizer.state"), optimizer_state)
            save_state(os.path.join(partial, f"rng{self._rank_suffix()}.state"), self._rng_state())
            self._barrier()
            if self._is_writer():
                if os.path.exists(path):
                    old = path + ".old"
                    shutil.rmtree(old, ignore_errors=True)  # left by a save interrupted between the two renames
                    os.replace(path, old)
                    os.replace(partial, path)
                    shutil.rmtree(old)
                else:
                    os.replace(partial, path)
            self._barrier()

    def load_checkpoint(self, path: str) -> None:
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            raise FileNotFoundError(f"{path} is not a baton checkpoint (no trainer_state.json)")
        self.load_model_weights(path)
        with open(os.path.join(path, "trainer_state.json")) as f:
            self.global_step = json.load(f)["global_step"]
        optimizer_file = os.path.join(path, "optimizer.state")
        own_shard = os.path.join(path, f"optimizer{self._rank_suffix()}.state")  # fsdp2 before whole-tensor states
        if has_state(optimizer_file) or (self._rank_suffix() and has_state(own_shard)):
            self._ensure_optimizer()
            if has_state(optimizer_file):
                self._load_optimizer_state(load_state(optimizer_file))
            else:
                self._load_optimizer_shard(load_state(own_shard))
            self.scheduler.load_state_dict(load_state(os.path.join(path, "scheduler.state")))
        self._set_rng_state(load_state(self._rng_file(path)))

    def load_model_weights(self, path: str) -> None:
        """The model of checkpoint `path`: its full weights, or (a LoRA role) its adapter on this role's base."""
        from safetensors.torch import load_file

        if has_adapter(path) != (self.peft_model is not None):
            raise ValueError(f"{path} holds a LoRA adapter and this role has no strategy.lora: set the lora settings of "
                             "the run that saved it" if has_adapter(path) else
                             f"{path} holds full weights and this role trains a LoRA adapter: drop strategy.lora, or "
                             "start a new adapter on it with strategy.model set to it")
        if self.peft_model is not None:
            load_adapter(self.peft_model, path)
            return
        state = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(path, name)))
        self._load_full_state_dict(state)
        self._retie_weights()

    def _retie_weights(self) -> None:
        """A tied LM head shares the embedding's tensor again after a load."""
        if getattr(self.hf_model.config, "tie_word_embeddings", False):
            self.hf_model.tie_weights()

    def save_merged(self, path: str) -> None:
        """The model as a plain HF directory at `path` (safetensors, config.json, tokenizer): with LoRA, the adapter
        merged into its base (W + scale · B A), loadable without peft."""
        state = self._full_state_dict()
        if self._is_writer():
            os.makedirs(path, exist_ok=True)
            base = self.hf_model if self.peft_model is None else self.peft_model.get_base_model()
            with torch.device("meta"):  # the architecture only: the weights are `state`'s
                plain = type(base)(base.config)
            plain.save_pretrained(path, state_dict=state, safe_serialization=True)
            save_tokenizer(self.tokenizer, path)

    def _optimizer_state(self) -> dict:
        """The optimizer's state by parameter name, in whole tensors, so that any layout loads it: {"state": {name:
        {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]} (on the writer; others: {})."""
        state = self.optimizer.state_dict()
        names = self._optimizer_param_names()
        whole = {names[index]: {key: self._whole_tensor(value) for key, value in entry.items()}
                 for index, entry in sorted(state["state"].items())}
        group_names = [[names[index] for index in group["params"]] for group in state["param_groups"]]
        stages = self._join_stages((whole, group_names))
        if not self._is_writer():
            return {}
        groups = [{**group, "params": list(dict.fromkeys(name for _, names in stages for name in names[i]))}
                  for i, group in enumerate(state["param_groups"])]  # a tied embedding is in two stages
        return {"state": {name: entry for part, _ in stages for name, entry in part.items()}, "param_groups": groups}

    def _load_optimizer_state(self, state: dict) -> None:
        """Load what `_optimizer_state` saved (or, from checkpoints before it, torch's state_dict keyed by index)."""
        names = self._optimizer_param_names()
        if not all(isinstance(name, str) for group in state["param_groups"] for name in group["params"]):
            self.optimizer.load_state_dict(state)
            return
        index = {name: i for i, name in enumerate(names)}
        saved = [name for group in state["param_groups"] for name in group["params"]]
        every = {name for stage in self._every_stage(names) for name in stage}  # a tied embedding is in two stages
        if sorted(saved) != sorted(every):
            missing, extra = sorted(set(every) - set(saved)), sorted(set(saved) - set(every))
            raise ValueError(f"the checkpoint's optimizer state is for other parameters (missing {missing[:3]}, extra "
                             f"{extra[:3]}); it was saved by a different model or LoRA setting")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.optimizer.load_state_dict({  # this stage's parameters of the saved ones
            "state": {index[name]: {key: self._shard_like(value, params[index[name]]) for key, value in entry.items()}
                      for name, entry in state["state"].items() if name in index},
            "param_groups": [{**group, "params": sorted(index[name] for name in group["params"] if name in index)}
                             for group in state["param_groups"]],  # in the optimizer's order, which torch maps by
        })

    def _optimizer_param_names(self) -> list[str]:
        """The names of the optimizer's parameters, in its order."""
        names = {id(param): name for name, param in self.module.named_parameters()}
        return [names[id(param)] for group in self.optimizer.param_groups for param in group["params"]]

    def _whole_tensor(self, tensor):
        """A state tensor of the whole parameter (sharded strategies gather it; every rank takes part)."""
        return tensor

    def _shard_like(self, value, param: torch.Tensor):
        """A whole state tensor as this rank's part of `param`'s layout."""
        return value.to(param.device) if torch.is_tensor(value) and value.dim() > 0 else value

    def _load_optimizer_shard(self, state: dict) -> None:
        raise ValueError("this checkpoint holds per-rank optimizer shards, which only a sharded strategy loads")

    def _rng_file(self, path: str) -> str:
        """This rank's RNG state file, or where the checkpoint was saved by another number of ranks, its first one."""
        for name in (f"rng{self._rank_suffix()}.state", "rng.state", "rng_rank0.state"):
            if has_state(os.path.join(path, name)):
                return os.path.join(path, name)
        raise FileNotFoundError(f"{path} has no RNG state file (rng.state); it is not a complete baton checkpoint")

    def _rng_state(self) -> dict:
        return {
            "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "sampler": self.generator.get_state(),
        }

    def _set_rng_state(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        self.generator.set_state(state["sampler"])


class HFStrategy(TorchStrategy):
    """One full model copy per worker: implements `InferenceStrategy` and `TrainStrategy`."""

    @torch.no_grad()
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        self.hf_model.eval()
        input_ids = prompts.batch["input_ids"].to(self.device)
        attention_mask = prompts.batch["attention_mask"].to(self.device)
        if len(prompts) and bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("generate needs LEFT-padded prompts (the last column must be real tokens); "
                             "tokenize with padding_side='left'")
        seeds = prompt_row_seeds(prompts, params, self.generator)
        stop = list(params.stop_token_ids) if params.stop_token_ids is not None else [self.tokenizer.eos_token_id]
        out = sample(self.hf_model, input_ids, attention_mask, params, self.tokenizer.pad_token_id, stop, seeds,
                     self._autocast)
        return generation_output(prompts, params, **out)

    def share_weights_from(self, other: "TorchStrategy") -> None:
        """Point this model's parameters at another in-process model's tensors: no copy (colocated roles)."""
        if self.peft_model is not None or other.peft_model is not None:
            raise ValueError("a LoRA role's served weights are merged (W + scale · B A), tensors it does not hold: "
                             "copy them (export_weights) instead of sharing")
        theirs = dict(other.hf_model.named_parameters())
        for name, param in self.hf_model.named_parameters():
            if name not in theirs or theirs[name].shape != param.shape:
                raise ValueError(f"cannot share weights: parameter {name!r} differs between the two models")
            param.data = theirs[name].data
