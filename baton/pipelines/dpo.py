"""DPO: preference optimisation on (prompt, chosen, rejected) pairs against a frozen reference model (sigmoid, IPO,
hinge), or reference-free (SimPO).

The loop: pairs → the reference's log-probs (its own workers) → the actor's update → validate → checkpoint. A pair's
chosen and rejected rows travel side by side (`collate_pairs`), so they train on one worker and in one micro-batch.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from baton.algorithms.preference import (PREFERENCE_LOSSES, get_preference_loss, preference_loss,
                                         sequence_log_probs)
from baton.config import ConfigError
from baton.config.paths import absolute_if_found
from baton.data import DataProto
from baton.datasets import DataError, PromptSampler
from baton.datasets.arith_prefs import SHIPPED_PAIRS
from baton.datasets.preference import PreferenceDataset, check_pairs_together, collate_pairs
from baton.pipelines.base import Pipeline
from baton.pipelines.config import (DataConfig, RewardSettings, RoleConfig, SamplingConfig, TrainerConfig,
                                    _check_data, _check_reward_fn, _reward_workers)
from baton.datasets.load import load_datasets
from baton.pipelines.policy import FUSED_POLICY, connect_policy, policy_roles, validation, validation_rollout
from baton.rewards import RewardRoutes
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.capabilities import can_share_weights
from baton.workers import ReferenceWorker, RewardWorker

# The loss's metrics, by TRL's names; the strategy reports each as its mean over the step's pairs.
PREFERENCE_METRICS = ("dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                      "logps/chosen", "logps/rejected")


@dataclass
class PairDataConfig:
    """The preference pairs DPO trains on: a .jsonl/.parquet file whose rows hold a prompt, a chosen and a rejected
    response (text, or chat messages rendered by the tokenizer's chat template). Prompts are held to
    `data.max_prompt_len` tokens; a response with its eos to `max_response_len`."""

    train_path: str | None = None  # None: the shipped arithmetic pairs (baton/datasets/data/arith_prefs.jsonl)
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_response_len: int = 32

    def __post_init__(self):
        self.train_path = absolute_if_found(self.train_path)
        if self.max_response_len < 1:
            raise ValueError(f"pairs.max_response_len must be >= 1, got {self.max_response_len}")


@dataclass
class PreferenceConfig:
    """The preference loss, by TRL's names (`baton.algorithms.preference`): loss_type "sigmoid" (DPO), "ipo",
    "hinge", or "simpo" (reference-free: no reference model runs); beta (the KL strength: the rewards are
    beta × log-ratio); label_smoothing (sigmoid and simpo: the share of pairs taken to be mislabelled); simpo_gamma
    (simpo's target margin)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


@dataclass
class DPOConfig:
    """DPO on preference pairs (`pairs`), validated like SFT on `data`'s held-out prompts (the arithmetic task's val
    split, or data.val_path; DPO does not train on data's training split). trainer.num_prompts_per_step counts pairs:
    each is one prompt with its two responses, two rows of the batch. `reference` is the frozen model the loss
    compares with (null: the actor's settings, so the same model or checkpoint); simpo runs none."""

    pipeline_cls: str = "baton.pipelines.dpo:DPOPipeline"
    actor: RoleConfig = field(default_factory=lambda: RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=1e-4))))
    reference: RoleConfig | None = None
    pairs: PairDataConfig = field(default_factory=PairDataConfig)
    algorithm: PreferenceConfig = field(default_factory=PreferenceConfig)
    data: DataConfig | None = field(default_factory=DataConfig)  # None inside the demo: its top-level `data`
    val_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, num_samples_per_prompt=1))
    reward_fn: str | dict[str, str] = "exact_match"  # scores validation; as RLVRConfig's
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # as RLVRConfig's
    reward_on_error: str = "raise"
    reward: RewardSettings = field(default_factory=_reward_workers)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(num_prompts_per_step=32, run_dir="runs/dpo"))

    def with_run_schedules(self) -> "DPOConfig":
        """This config, with a decaying lr schedule that sets no total_steps spanning the run (one update per step)."""
        return dataclasses.replace(self, actor=self.actor.with_run_schedule(self.trainer.num_steps))

    def check(self) -> None:
        """Raise ConfigError for combinations that cannot run; the pipeline calls this before Ray or any worker starts."""
        algo, strategy = self.algorithm, self.actor.strategy
        _check_data(self.data)
        self.actor.check_schedule("actor", self.trainer.num_steps, f"trainer.num_steps={self.trainer.num_steps}, one "
                                  "update each")
        PREFERENCE_LOSSES.get(algo.loss_type, key="algorithm.loss_type")
        spec = get_preference_loss(algo.loss_type)
        if algo.beta <= 0:
            raise ConfigError(f"algorithm.beta={algo.beta} must be > 0 (TRL's default: 0.1)")
        if not 0.0 <= algo.label_smoothing < 0.5:
            raise ConfigError(f"algorithm.label_smoothing={algo.label_smoothing} must be in [0, 0.5): it is the share "
                              "of pairs taken to be mislabelled")
        if algo.label_smoothing and not spec.uses_label_smoothing:
            warnings.warn(f"algorithm.label_smoothing={algo.label_smoothing} is ignored: loss_type {algo.loss_type!r} "
                          "has no label smoothing (sigmoid and simpo do)", stacklevel=2)
        if self.reference is not None and not spec.needs_reference:
            raise ConfigError(f"a `reference:` section is set but algorithm.loss_type {algo.loss_type!r} is "
                              "reference-free; remove the section, or use loss_type sigmoid, ipo or hinge")
        if strategy.max_tokens_per_microbatch is not None:
            raise ConfigError(f"actor.strategy.max_tokens_per_microbatch={strategy.max_tokens_per_microbatch} splits "
                              "micro-batches by tokens, which can part a preference pair's chosen and rejected rows; "
                              "set actor.strategy.micro_batch_size_per_worker (an even number of rows) instead")
        if strategy.micro_batch_size_per_worker is not None and strategy.micro_batch_size_per_worker % 2:
            raise ConfigError(f"actor.strategy.micro_batch_size_per_worker={strategy.micro_batch_size_per_worker} "
                              "would part a preference pair (two rows, chosen and rejected) between micro-batches; "
                              f"use an even number, e.g. {strategy.micro_batch_size_per_worker + 1}")
        shards = self.actor.num_data_shards("actor")
        if self.trainer.num_prompts_per_step % shards:
            raise ConfigError(f"trainer.num_prompts_per_step={self.trainer.num_prompts_per_step} pairs do not split "
                              f"evenly over the {shards} actor workers (data-parallel shards), so a pair would be "
                              f"parted between two; make it a multiple of {shards}")
        _check_reward_fn(self.reward_fn, self.reward_on_error, self.reward_kwargs)


@dataclass(frozen=True)
class DPOLoss:
    """A preference loss (`PreferenceConfig`) over micro-batches laid out by `collate_pairs`: rows 2i and 2i + 1
    are pair i's chosen and rejected; `ref_log_probs` is in the batch unless the loss is reference-free.

    Returns each pair's loss counted once per row of it (twice): train_step with loss_unit "sequence" divides by
    the step's rows, two per pair, so the update is the mean over pairs. Metrics are (sum, pairs)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def entropy_grad(self) -> bool:
        return False  # the entropy is no term of the loss

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto
                 ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
        if batch.meta_info.get("baton_padding"):  # fsdp2's filler row: it counts nothing (see `LossFn`)
            return outputs["log_probs"].sum() * 0.0, dict.fromkeys(PREFERENCE_METRICS, (0.0, 0.0))
        check_pairs_together(batch)
        spec = get_preference_loss(self.loss_type)
        mask = batch.batch["response_mask"]
        logps = sequence_log_probs(outputs["log_probs"], mask, spec.length_normalised)  # [rows]
        ref = None
        if spec.needs_reference:
            if "ref_log_probs" not in batch.batch:
                raise ValueError(f"loss_type {self.loss_type!r} compares with a reference model, and the batch has no "
                                 "'ref_log_probs' (the reference's log-probs of its responses); compute them first")
            ref = sequence_log_probs(batch.batch["ref_log_probs"], mask, spec.length_normalised)
        out = preference_loss(self.loss_type, logps[0::2], logps[1::2], None if ref is None else ref[0::2],
                              None if ref is None else ref[1::2], self.beta, self.label_smoothing, self.simpo_gamma)
        num_pairs = float(len(out.losses))

        def over_pairs(values: torch.Tensor) -> tuple[float, float]:
            return float(values.detach().float().sum()), num_pairs

        margins = out.chosen_rewards - out.rejected_rewards
        metrics = {"dpo/loss": over_pairs(out.losses), "rewards/chosen": over_pairs(out.chosen_rewards),
                   "rewards/rejected": over_pairs(out.rejected_rewards), "rewards/margins": over_pairs(margins),
                   "rewards/accuracies": over_pairs(margins > 0), "logps/chosen": over_pairs(out.chosen_logps),
                   "logps/rejected": over_pairs(out.rejected_logps)}
        return 2.0 * out.losses.sum(), metrics


class DPOPipeline(Pipeline):
    config_cls = DPOConfig

    def __init__(self, config: DPOConfig):
        config = config.with_run_schedules()
        super().__init__(config, config.trainer)
        self.sampler = PromptSampler(self.num_train_prompts(self.train_data), seed=config.trainer.seed)  # over pairs
        # Validation generates with an hf rollout that shares (or receives) the actor's weights, as in SFT.
        rollout = validation_rollout(config.actor)
        colocate = can_share_weights(config.actor.strategy.name, rollout.strategy.name)
        roles = {**policy_roles(config.actor, rollout),
                 "reward": (RewardWorker, config.reward, (
                     config.reward_fn, config.actor.strategy.tokenizer, config.reward_on_error,
                     config.reward.num_processes_per_worker, config.reward.timeout_s_per_row,
                     None, 0, 1.0, config.reward_kwargs))}  # validation only: no overlong penalty
        algo = config.algorithm
        if get_preference_loss(algo.loss_type).needs_reference:
            reference = config.reference or config.actor
            roles["reference"] = (ReferenceWorker, reference, (reference.strategy,))
        clusters = self.create_clusters(roles, fused=FUSED_POLICY if colocate else None)
        self.actor, self.rollout, self.reward = clusters["actor"], clusters["rollout"], clusters["reward"]
        self.reference = clusters.get("reference")
        self.update_pairs = [connect_policy(clusters, config.actor, rollout, colocate, self.val_data, self.tokenizer,
                                            config.trainer)]
        self.checkpoint_clusters = ["actor"]  # the reference is frozen: rebuilt from its model on resume
        self.sampling_clusters = ["rollout"]
        self.loss = DPOLoss(algo.loss_type, algo.beta, algo.label_smoothing, algo.simpo_gamma)
        # Roles on the same devices take turns (trainer.offload_idle_roles): the reference scores, the actor trains,
        # the validation rollout generates. Colocated, the actor and rollout share tensors: neither is offloaded.
        self.share_devices([["reference"], ["actor"], ["rollout"]],
                           never_offloaded=FUSED_POLICY["policy"] if colocate else ())
        self.maybe_resume()

    @classmethod
    def num_train_prompts(cls, train) -> int:
        return len(train) // 2  # a pair is two rows

    @classmethod
    def load_data(cls, config: DPOConfig):
        """(the pairs as rows, chosen then rejected: `PreferenceDataset.to_rows`; the held-out prompts; tokenizer).
        DataError when a pair's prompt is a held-out one: validation would score what DPO trained on."""
        _, val, tokenizer = load_datasets(config.data, config.actor.strategy.tokenizer,
                                          RewardRoutes(config.reward_fn, config.reward_kwargs))
        pairs = config.pairs
        dataset = PreferenceDataset.from_file(pairs.train_path or SHIPPED_PAIRS, pairs.prompt_key, pairs.chosen_key,
                                              pairs.rejected_key)
        rows = dataset.to_rows(tokenizer, config.data.max_prompt_len, pairs.max_response_len)
        held_out = set(val.text_prompts()) if val is not None else set()
        leaked = [i for i in range(0, len(rows), 2) if rows[i]["prompt"] in held_out]
        if leaked:
            raise DataError(f"{rows.where(leaked[0])}: the prompt {rows[leaked[0]]['prompt']!r} is one of the held-out "
                            f"prompts validation scores ({len(leaked)} of the {len(rows) // 2} pairs' prompts are), so "
                            "validation would measure problems DPO trained on; remove those pairs, or validate on "
                            "other prompts (data.val_path, or the task's data.seed and data.num_val_examples the pairs "
                            "were made for)")
        return rows, val, tokenizer

    def validate(self) -> dict[str, float]:
        self.sync_weights()
        result = validation(self.rollout, self.reward, self.val_data, self.tokenizer, self.config.val_sampling,
                            self.config.data.max_prompt_len, self.global_step, self.trainer.log_samples)
        self.val_samples = result.samples
        return result.metrics

    def run(self) -> dict:
        trainer = self.config.trainer
        tracker = self.make_tracker()
        start = time.perf_counter()
        first_val = self.first_validation()
        metrics: dict[str, float] = {}
        for step in self.training_steps("dpo"):
            with self.timer("step"):
                batch = collate_pairs(self.train_data, self.sampler.next_indices(trainer.num_prompts_per_step),
                                      self.tokenizer, self.config.data.max_prompt_len)
                if self.reference is not None:
                    self.on_device("reference")
                    with self.timer("ref"):
                        batch.batch["ref_log_probs"] = self.reference.compute_log_probs(batch).batch["log_probs"]
                self.on_device("actor")
                with self.timer("update_actor"):
                    per_rank = self.actor.train_step(batch, self.loss, "sequence")
            metrics = {**{key: per_rank[0][key] for key in PREFERENCE_METRICS},
                       "actor/grad_norm": per_rank[0]["grad_norm"], "actor/lr": per_rank[0]["lr"], **self.timings}
            self.end_step(step, metrics, "loss", "dpo/loss")
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_loss=metrics.get("dpo/loss"),
                                        final_reward_accuracy=metrics.get("rewards/accuracies")))
