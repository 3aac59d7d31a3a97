"""What a strategy is: the protocols workers program against, their configuration, and the batch layout.

A worker says *what* to compute; a strategy says *how* on one backend (HF transformers, FSDP2,
mock; vLLM for rollouts only: `RolloutStrategy`). Every strategy reads and writes `DataProto`s with these columns:

generate() input, one row per prompt:
    input_ids        [batch, prompt_len]  int64, LEFT padded with the pad id
    attention_mask   [batch, prompt_len]  0 on padding
generate() output, `n` rows per prompt (a prompt's samples consecutive), plus the input's
non-tensor columns repeated to match:
    prompts          [rows, prompt_len]
    responses        [rows, response_len] RIGHT padded with the pad id
    response_mask    [rows, response_len] 1 on generated tokens (the stop token included)
    input_ids        [rows, prompt_len + response_len]  prompts then responses
    attention_mask   [rows, prompt_len + response_len]
    position_ids     [rows, prompt_len + response_len]
    rollout_log_probs [rows, response_len] float32, log p(token) at the sampling temperature, 0 where masked
    finish_reason    (non-tensor) "stop" (a stop token was sampled) or "length" (max_new_tokens hit)
forward() input: input_ids, attention_mask, responses (position_ids optional);
forward() output: log_probs and entropy [rows, response_len] (causal LMs) or values (critics).
top_k_log_probs(batch, k) output (`TorchStrategy`: hf, fsdp2; a distillation teacher's): top_k_log_probs float32 and
    top_k_ids int64, each [rows, response_len, k], each position's k most likely next tokens, most likely first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch

from baton.config.paths import absolute_if_found
from baton.data import DataProto

if TYPE_CHECKING:
    from baton.data.shards import WeightPiece


@dataclass
class OptimizerConfig:
    """AdamW."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        if not (math.isfinite(self.lr) and self.lr > 0):  # NaN, inf, 0 or a negative rate trains nothing sensible
            raise ValueError(f"lr is {self.lr}; give a finite learning rate above 0, e.g. 1e-5")


@dataclass
class SchedulerConfig:
    """Learning-rate schedule: `constant`, `linear` or `cosine` decay after a linear warm-up."""

    name: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None  # linear and cosine decay over this many updates; the pipelines' default: the whole run
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.name not in ("constant", "linear", "cosine"):
            raise ValueError(f"scheduler name {self.name!r} is not one of 'constant', 'linear', 'cosine'")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"scheduler total_steps={self.total_steps} must be >= 1 (or null: the whole run)")

    def num_updates_at_zero_lr(self, num_updates: int) -> int:
        """How many of a run's `num_updates` optimizer steps this schedule gives lr 0: those past a linear or cosine
        decay to min_lr_ratio 0 that ends at total_steps (the update at index total_steps is the first at 0; after
        a warm-up longer than that, the one after the warm-up)."""
        if self.name == "constant" or self.total_steps is None or self.min_lr_ratio > 0:
            return 0
        return max(0, num_updates - max(self.total_steps, self.warmup_steps + 1))


# The attention and MLP projections of Qwen2 and Llama (and most causal LMs that follow them).
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """LoRA (peft) on a training role: each `target_modules` Linear W becomes W + (alpha / rank) · B A with A
    [rank, in] and B [out, rank] trained (B starts at 0, so the model starts as its base) and W frozen.

    target_modules: module names (the last part of a dotted name, as peft matches them); the embeddings and the LM
        head cannot be targets, since the log-probs read the LM head's weight directly (`baton.strategy.logprobs`).
    dropout: on the adapter's input in training; 0 keeps train_step's log-probs equal to forward()'s.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora rank={self.rank} must be >= 1 (e.g. 8)")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora alpha={self.alpha} must be a finite number above 0 (e.g. 2 × rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise ValueError(f"lora target_modules is empty; name the Linear layers to adapt, e.g. {LORA_TARGET_MODULES}")
        untargetable = sorted({"lm_head", "embed_tokens"} & set(self.target_modules))
        if untargetable:
            raise ValueError(f"lora target_modules {untargetable}: the log-probs read the LM head's and embeddings' "
                             "weights directly, so an adapter there would be ignored; target the projections only")


@dataclass
class ParallelConfig:
    """How the `fsdp2` strategy lays its workers out (`baton.strategy.mesh`): a device mesh of
    pp × dp_replicate × dp_shard × cp × tp workers, tp varying fastest. dp_shard is what the cluster's size leaves.

    tp: tensor parallel: each decoder layer's heads and MLP, the embedding and the LM head split over tp workers
        (`baton.strategy.tensor_parallel`); the log-probs never gather the logits.
    cp: context (sequence) parallel, Ulysses: each sequence split by position over cp workers, attention run on a
        split of the heads after an all-to-all (`baton.strategy.context_parallel`).
    dp_replicate: HSDP: the model is sharded within groups of dp_shard × cp workers and replicated across
        dp_replicate such groups (gradients all-reduced across them).
    pp: pipeline parallel: the decoder layers split into pp contiguous stages, the first also holding the embedding
        and the last the final norm and the RL head, run on a 1F1B schedule (`baton.strategy.pipeline_parallel`).
    Workers of one pp × tp × cp group get the same rows; dp_replicate × dp_shard groups get different ones.
    """

    tp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("tp", "cp", "dp_replicate", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel {name}={getattr(self, name)} must be at least 1")

    @property
    def model_parallel_size(self) -> int:
        """Workers in each group that holds one copy of the data: pp × tp × cp."""
        return self.pp * self.tp * self.cp

    def dp_shard(self, world_size: int) -> int:
        """The sharding degree `world_size` workers leave, or ValueError naming the sizes that do not fit."""
        per_shard = self.pp * self.dp_replicate * self.cp * self.tp
        if world_size % per_shard:
            raise ValueError(f"{world_size} workers do not divide into pp {self.pp} × dp_replicate {self.dp_replicate} × "
                             f"cp {self.cp} × tp {self.tp}; give the role a multiple of {per_shard} workers")
        return world_size // per_shard


@dataclass
class StrategyConfig:
    """How one role's model is built and trained.

    model: a local HF-format directory, a name from `baton.models.MODEL_CONFIGS`, or a dict of
        Qwen2Config fields (with an optional "base" name to start from).
    kind: "causal_lm" (log-probs, generation) or "value" (a critic: one value per token).
    micro_batch_size_per_worker / max_tokens_per_microbatch: split each worker's batch for
        gradient accumulation by row count, or greedily by a token budget; at most one of them.
    logprob_chunk_size: tokens per chunk when turning hidden states into log-probs, so a full
        vocabulary float32 log-softmax never exists for the whole batch. None (the default) takes as many tokens as
        keep one chunk's float32 logits within 256 MiB, at most 1,024 (`baton.strategy.logprobs.chunk_tokens`: 1,024
        up to a vocabulary of 65,536, 441 at Qwen2.5's 151,936).
    trim_padding: run the model on each micro-batch without the columns that are padding in all its rows
        (`baton.strategy.padding`): a micro-batch of short rows cut from a batch padded to a long one costs
        only its own length. Outputs at the real tokens are those of the padded micro-batch up to float
        rounding; padding positions get zeros. A single micro-batch of the whole batch has no such columns.
    packing: run each micro-batch's rows as one sequence of their real tokens only, each row with its own
        positions and an attention that does not cross rows (`baton.strategy.packing`), when that costs fewer
        tokens than the padded pass; outputs come back at the batch's layout, equal to the padded ones up to float
        rounding. None (the default) packs where the model's attention implementation takes the mask that keeps rows
        apart (sdpa, eager) and leaves it off elsewhere; True refuses a model that cannot; False never packs.
    lora: None trains every parameter; a `LoraConfig` trains a LoRA adapter (peft) on the frozen model instead
        (kind causal_lm, strategy hf): only the adapter's weights are in the optimizer, checkpoints hold the adapter,
        exported weights (the weight sync's) are merged into plain HF names, and an RLVR reference that is the
        initial model is this model with the adapter off (no second copy).
    parallel: the `fsdp2` strategy's device mesh (`ParallelConfig`: tp, cp, dp_replicate, pp); the other strategies
        take only the default (one worker holds the whole model).
    dtype: the parameters' dtype, and so the optimizer's: AdamW updates parameters of this dtype.
    compute_dtype: None computes in `dtype`; "bfloat16" is mixed precision: the parameters stay in
        `dtype` (which must be float32: the master copy, with float32 gradients and AdamW state),
        forward and backward compute in bf16 (fsdp2: a `MixedPrecisionPolicy` with float32 gradient
        reduction; hf: `torch.autocast`), and log-probs come from float32 logits. A role that trains
        bf16 parameters instead loses updates below bf16's resolution (a relative 2^-8): a 1e-6
        learning-rate step rounds to nothing. float16 compute needs loss scaling, which baton does not do.
    """

    name: str = "hf"
    model: str | dict = "tiny-qwen2"
    kind: str = "causal_lm"
    dtype: str = "float32"
    compute_dtype: str | None = None
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grad_clip: float | None = 1.0
    micro_batch_size_per_worker: int | None = None
    max_tokens_per_microbatch: int | None = None
    gradient_checkpointing: bool = False
    logprob_chunk_size: int | None = None  # None: by the vocabulary (see above)
    trim_padding: bool = True
    packing: bool | None = None  # None: packed where the model's attention keeps rows apart (see `baton.strategy.packing`)
    lora: LoraConfig | None = None  # None: full fine-tuning
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the fsdp2 strategy's layout
    tokenizer: str | None = None  # local tokenizer directory; None: the shipped character tokenizer
    # An inference engine's own settings (the `vllm` strategy: more `vllm.EngineArgs` fields, e.g. kv_cache_memory_bytes,
    # gpu_memory_utilization, max_model_len, max_num_seqs); the other strategies take none.
    engine_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        # Found paths are kept absolute (read from the working directory, else beside the config file), so the run
        # directory's config.yaml and every worker see the same files.
        if isinstance(self.model, str):
            self.model = absolute_if_found(self.model)
        self.tokenizer = absolute_if_found(self.tokenizer)
        if self.kind not in ("causal_lm", "value"):
            raise ValueError(f"strategy kind {self.kind!r} is not one of 'causal_lm', 'value'")
        if self.micro_batch_size_per_worker is not None and self.max_tokens_per_microbatch is not None:
            raise ValueError("set micro_batch_size_per_worker or max_tokens_per_microbatch, not both")
        for name in ("micro_batch_size_per_worker", "max_tokens_per_microbatch", "logprob_chunk_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lora is not None and self.kind != "causal_lm":
            raise ValueError(f"lora on a kind {self.kind!r} model: its new value head must train in full, which LoRA "
                             "does not do here; drop lora for the critic (kind value)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r} is not one of 'float32', 'bfloat16', 'float16'")
        if self.compute_dtype == "float16":
            raise ValueError("compute_dtype 'float16' needs loss scaling against gradient underflow, which baton does "
                             "not do; use compute_dtype: bfloat16")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"compute_dtype {self.compute_dtype!r} is not one of None, 'float32', 'bfloat16'")
        if self.compute_dtype is not None and self.dtype != "float32":
            raise ValueError(f"compute_dtype {self.compute_dtype!r} computes from float32 master parameters, but dtype "
                             f"is {self.dtype!r}; set dtype: float32 with compute_dtype: bfloat16 (mixed precision), "
                             f"or drop compute_dtype to compute in {self.dtype}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def mixed_precision_dtype(self) -> torch.dtype | None:
        """The compute dtype when it differs from the parameters' (mixed precision), else None."""
        if self.compute_dtype is None or self.compute_dtype == self.dtype:
            return None
        return getattr(torch, self.compute_dtype)


@dataclass
class SamplingParams:
    """Sampling for `generate`. top_k=0 and top_p=1.0 switch those filters off; temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    n: int = 1
    stop_token_ids: tuple[int, ...] | None = None  # None: the tokenizer's eos
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"bad sampling parameters {self}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0, n >= 1, max_new_tokens >= 1"
            )


# A loss function gets the model's outputs for one micro-batch (log_probs / entropy / values, each
# [rows, response_len]) and that micro-batch, and returns the loss SUMMED over its units (tokens
# or sequences) plus metrics. The strategy divides by the global unit count across micro-batches
# and data-parallel ranks, so any split of the batch gives the same update. A loss whose
# `entropy_grad` attribute is False uses the entropy only as a metric, which spares its backward pass.
# A metric is a float or a (sum, count) pair. The strategy adds up both over the micro-batches and
# data-parallel ranks and reports sum / max(count, 1): a pair (e.g. a token mean as (mean · tokens,
# tokens), a loss as (its sum, its units)) gives the same value whatever the split of the batch; a
# float counts 1 per micro-batch, so it is averaged over micro-batches. A padding micro-batch
# (meta_info["baton_padding"]) counts nothing. Every micro-batch returns the same metric names.
LossFn = Callable[[dict[str, torch.Tensor], DataProto], "tuple[torch.Tensor, dict[str, float | tuple[float, float]]]"]


def metric_sum_count(value) -> tuple[float, float]:
    """A loss function's metric as (sum, count); a float counts 1 (see `LossFn`)."""
    if isinstance(value, tuple):
        total, count = value
        return float(total), float(count)
    return float(value), 1.0


@runtime_checkable
class ModelStrategy(Protocol):
    """What every strategy can do with its model."""

    def forward(self, batch: DataProto, temperature: float = 1.0) -> DataProto:
        """log_probs and entropy (causal LMs) or values (critics) of the response tokens, no gradients."""

    def export_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Full (unsharded) parameters in HF names, in buckets of about `bucket_bytes`, on the writer rank."""

    def weight_pieces(self) -> Iterator["WeightPiece"]:
        """Every weight in HF names with this rank's rows of it (what a weight sync sends: `baton.data.shards`)."""

    def import_weights(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Load full parameters (any subset, in HF names)."""

    def weight_fingerprints(self, names: list[str]) -> dict[str, int] | None:
        """`baton.data.shards.fingerprint` of each named weight held (None: not computed, e.g. sharded)."""

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype of the floating weights, which a sync into this model sends (None: as the source holds them)."""

    def save_checkpoint(self, path: str) -> None:
        """Model (HF format), optimizer, scheduler and RNG state, written atomically."""

    def load_checkpoint(self, path: str) -> None: ...

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state off the accelerator."""

    def reload(self) -> None: ...


@runtime_checkable
class RolloutStrategy(Protocol):
    """What the rollout role calls: generation, log-probs of given responses (the weight-sync probe), the actor's
    weights in, and offload/reload around training. A serving backend (`vllm`) implements only this: it trains
    nothing, and its weights are the actor's, so it exports and checkpoints nothing."""

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto: ...

    def forward(self, batch: DataProto, temperature: float = 1.0) -> DataProto: ...

    def import_weights(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None: ...

    def weight_fingerprints(self, names: list[str]) -> dict[str, int] | None: ...

    @property
    def weight_dtype(self) -> torch.dtype | None: ...

    def offload(self) -> None: ...

    def reload(self) -> None: ...


@runtime_checkable
class InferenceStrategy(ModelStrategy, RolloutStrategy, Protocol):
    """A model strategy that generates too (`hf`): a rollout whose model can also be exported and checkpointed."""


@runtime_checkable
class TrainStrategy(ModelStrategy, Protocol):
    def train_step(self, batch: DataProto, loss_fn: LossFn, loss_unit: str = "token") -> dict[str, float]:
        """One optimizer step over the batch (micro-batched); returns loss, grad_norm, lr and the loss's metrics."""
