"""Distillation: a student (the actor) learns a frozen teacher's next-token distributions, token by token, on the
teacher's top-k (`baton.algorithms.distill`: forward KL, reverse KL, generalised JSD).

The loop: responses → the teacher's top-k log-probs of every response token (on the teacher's workers; only k
values and ids per token travel) → the student's update → validate → checkpoint. The responses are, by
`algorithm.mode`: off_policy, the dataset's (`responses: dataset`) or the teacher's own samples
(`responses: teacher`); on_policy, the student's samples from its rollout, which the teacher then scores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from baton.algorithms import LOSS_AGG_UNITS, loss_unit
from baton.algorithms.distill import DISTILL_LOSSES
from baton.config import ConfigError
from baton.datasets import PromptSampler, collate_prompts, collate_sft
from baton.pipelines.base import Pipeline
from baton.pipelines.config import (DataConfig, RewardSettings, RoleConfig, SamplingConfig, TrainerConfig,
                                    _check_data, _check_reward_fn, _reward_workers)
from baton.datasets.load import load_datasets
from baton.rl.losses import TEACHER_TOP_K_IDS, TEACHER_TOP_K_LOG_PROBS, DistillLoss
from baton.pipelines.policy import FUSED_POLICY, connect_policy, policy_roles, validate, validation, validation_rollout
from baton.rewards import RewardRoutes
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.capabilities import backends_that, can_share_weights, capabilities
from baton.workers import RewardWorker, TeacherWorker

MODES = ("off_policy", "on_policy")
RESPONSES = ("dataset", "teacher")
DISTILL_METRICS = ("distill/loss", "distill/forward_kl", "distill/reverse_kl", "distill/teacher_top_k_mass",
                   "distill/student_top_k_mass", "distill/top1_agreement", "distill/sft_nll", "actor/entropy")
# The columns a generated batch keeps for scoring and training (the rollout's log-probs are not used).
_TRAIN_COLUMNS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


@dataclass
class DistillSettings:
    """loss_type: forward_kl (KL(teacher ‖ student)), reverse_kl (KL(student ‖ teacher)) or jsd (generalised JSD,
    `beta` the teacher's weight in the mixture: 0 is forward_kl, 1 reverse_kl, as TRL's GKD); top_k: the teacher
    tokens per position that the loss sees, the rest of the vocabulary one tail outcome (see
    `baton.algorithms.distill`); temperature: both models' distributions are taken at it (Hinton's softening; 1: as
    they are). mode off_policy trains on `responses` (dataset: the data's responses, as SFT's; teacher: the teacher's
    samples at `sampling`); on_policy on the student's samples at `sampling` (`responses` stays unset). sft_weight w
    (dataset responses only): the loss is (1 - w) * distillation + w * the answers' negative log-likelihood, Hinton's
    mix of the teacher's soft targets and the hard labels."""

    loss_type: str = "forward_kl"
    beta: float = 0.5
    top_k: int = 16
    temperature: float = 1.0
    loss_agg_mode: str = "token-mean"
    mode: str = "off_policy"
    responses: str | None = None  # off_policy: "dataset" (null) or "teacher"
    sft_weight: float = 0.0


@dataclass
class DistillConfig:
    """A student (`actor`) distils a frozen `teacher` (a causal LM sharing the student's tokenizer; strategy.model a
    checkpoint directory, e.g. an SFT run's checkpoints/step_N/actor) on `data`'s training prompts, validated by
    greedy accuracy on its held-out split like SFT; the teacher's own held-out accuracy is measured once, at the
    start (`teacher_val_accuracy`). trainer.num_prompts_per_step counts prompts; `sampling` (on_policy, or
    teacher responses) draws num_samples_per_prompt responses of each."""

    pipeline_cls: str = "baton.pipelines.distill:DistillPipeline"
    actor: RoleConfig = field(default_factory=lambda: RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=1e-3))))
    teacher: RoleConfig | None = None
    algorithm: DistillSettings = field(default_factory=DistillSettings)
    data: DataConfig | None = field(default_factory=DataConfig)  # None inside the demo: its top-level `data`
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=1.0, num_samples_per_prompt=1))
    val_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, num_samples_per_prompt=1))
    reward_fn: str | dict[str, str] = "exact_match"  # scores validation; as RLVRConfig's
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # as RLVRConfig's
    reward_on_error: str = "raise"
    reward: RewardSettings = field(default_factory=_reward_workers)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(num_prompts_per_step=64, run_dir="runs/distill"))

    @property
    def response_source(self) -> str:
        """Whose responses the student trains on: "dataset", "teacher" or (on_policy) "student"."""
        if self.algorithm.mode == "on_policy":
            return "student"
        return self.algorithm.responses or "dataset"

    def with_run_schedules(self) -> "DistillConfig":
        """This config, with a decaying lr schedule that sets no total_steps spanning the run (one update per step)."""
        return dataclasses.replace(self, actor=self.actor.with_run_schedule(self.trainer.num_steps))

    def check(self) -> None:
        """Raise ConfigError for combinations that cannot run; the pipeline calls this before Ray or any worker starts."""
        algo, teacher = self.algorithm, self.teacher
        _check_data(self.data)
        self.actor.check_schedule("actor", self.trainer.num_steps, f"trainer.num_steps={self.trainer.num_steps}, one "
                                  "update each")
        if teacher is None:
            raise ConfigError("distillation needs a `teacher:` section: the frozen model the student learns from, "
                              "e.g. teacher.strategy.model: runs/teacher/checkpoints/step_N/actor (an SFT run's "
                              "checkpoint) or a model name")
        DISTILL_LOSSES.get(algo.loss_type, key="algorithm.loss_type")
        if not 0.0 <= algo.beta <= 1.0:
            raise ConfigError(f"algorithm.beta={algo.beta} is outside [0, 1]: it is the teacher's weight in the jsd "
                              "mixture (0: forward KL, 1: reverse KL, 0.5: the symmetric JSD)")
        if algo.beta != DistillSettings.beta and algo.loss_type != "jsd":
            warnings.warn(f"algorithm.beta={algo.beta} is ignored: loss_type {algo.loss_type!r} has no beta (jsd has)",
                          stacklevel=2)
        if algo.temperature <= 0:
            raise ConfigError(f"algorithm.temperature={algo.temperature} must be > 0 (1: the distributions as they are)")
        if algo.loss_agg_mode not in LOSS_AGG_UNITS:
            raise ConfigError(f"algorithm.loss_agg_mode {algo.loss_agg_mode!r} is not one of {sorted(LOSS_AGG_UNITS)}")
        if algo.mode not in MODES:
            raise ConfigError(f"algorithm.mode {algo.mode!r} is not one of {list(MODES)}")
        if algo.responses is not None and algo.responses not in RESPONSES:
            raise ConfigError(f"algorithm.responses {algo.responses!r} is not one of {list(RESPONSES)} (or null: "
                              "dataset)")
        if algo.mode == "on_policy" and algo.responses is not None:
            raise ConfigError(f"algorithm.responses={algo.responses!r} with mode on_policy: on-policy distillation "
                              "trains on the student's own samples; unset responses, or use mode off_policy")
        if not 0.0 <= algo.sft_weight <= 1.0:
            raise ConfigError(f"algorithm.sft_weight={algo.sft_weight} is outside [0, 1]: the hard-label term's weight "
                              "(0: distillation only, 1: SFT only)")
        if algo.sft_weight and self.response_source != "dataset":
            raise ConfigError(f"algorithm.sft_weight={algo.sft_weight} with {self.response_source} responses: the "
                              "hard-label term trains on right answers, the dataset's; use mode off_policy with "
                              "responses null (dataset), or set sft_weight 0")
        vocab = {name: vocab_size(role.strategy) for name, role in (("actor", self.actor), ("teacher", teacher))}
        if not 1 <= algo.top_k <= vocab["teacher"]:
            raise ConfigError(f"algorithm.top_k={algo.top_k} must be in [1, {vocab['teacher']}] (the teacher's "
                              f"vocabulary); top_k={vocab['teacher']} distils the full distribution")
        if teacher.strategy.tokenizer != self.actor.strategy.tokenizer or vocab["teacher"] != vocab["actor"]:
            raise ConfigError(f"teacher and student must share a tokenizer (the teacher's top-k ids index the "
                              f"student's vocabulary): teacher.strategy.tokenizer={teacher.strategy.tokenizer!r} with "
                              f"{vocab['teacher']} tokens, actor.strategy.tokenizer={self.actor.strategy.tokenizer!r} "
                              f"with {vocab['actor']}")
        if teacher.strategy.kind != "causal_lm":
            raise ConfigError(f"teacher.strategy.kind is {teacher.strategy.kind!r}; a teacher is a causal LM")
        # The teacher scores (top-k log-probs) and generates (its held-out accuracy; teacher responses).
        can = capabilities(teacher.strategy.name)
        if not (can.top_k_log_probs and can.generates):
            able = sorted(set(backends_that("top_k_log_probs")) & set(backends_that("generates")))
            raise ConfigError(f"teacher.strategy.name {teacher.strategy.name!r}: a teacher computes top-k log-probs and "
                              f"generates, which {', '.join(able)} do; set teacher.strategy.name to one of them")
        samples = 1 if self.response_source == "dataset" else self.sampling.num_samples_per_prompt
        rows = self.trainer.num_prompts_per_step * samples
        shards = self.actor.num_data_shards("actor")
        if rows % shards:
            raise ConfigError(f"a step's {rows} responses do not split evenly over the {shards} actor workers "
                              f"(data-parallel shards); make trainer.num_prompts_per_step (× sampling.num_samples_per_prompt) "
                              f"a multiple of {shards}")
        _check_reward_fn(self.reward_fn, self.reward_on_error, self.reward_kwargs)


def vocab_size(strategy: StrategyConfig) -> int:
    """The vocabulary of a role's model: a checkpoint directory's config.json, else the named or given config."""
    if isinstance(strategy.model, str) and os.path.isdir(strategy.model):
        with open(os.path.join(strategy.model, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    from baton.models import model_config

    return int(model_config(strategy.model).vocab_size)


class DistillPipeline(Pipeline):
    config_cls = DistillConfig

    def __init__(self, config: DistillConfig):
        config = config.with_run_schedules()
        super().__init__(config, config.trainer)
        self.sampler = PromptSampler(len(self.train_data), seed=config.trainer.seed)
        # Validation (and on-policy sampling) runs an hf rollout that shares (or receives) the student's weights.
        rollout = validation_rollout(config.actor)
        colocate = can_share_weights(config.actor.strategy.name, rollout.strategy.name)
        clusters = self.create_clusters({
            **policy_roles(config.actor, rollout),
            "teacher": (TeacherWorker, config.teacher, (config.teacher.strategy,)),
            "reward": (RewardWorker, config.reward, (
                config.reward_fn, config.actor.strategy.tokenizer, config.reward_on_error,
                config.reward.num_processes_per_worker, config.reward.timeout_s_per_row,
                None, 0, 1.0, config.reward_kwargs))},  # validation only: no overlong penalty
            fused=FUSED_POLICY if colocate else None)
        self.actor, self.rollout, self.reward = clusters["actor"], clusters["rollout"], clusters["reward"]
        self.teacher = clusters["teacher"]
        self.update_pairs = [connect_policy(clusters, config.actor, rollout, colocate, self.val_data, self.tokenizer,
                                            config.trainer)]
        self.checkpoint_clusters = ["actor"]  # the teacher is frozen: rebuilt from its model on resume
        self.sampling_clusters = ["rollout", "teacher"]
        algo = config.algorithm
        self.loss = DistillLoss(algo.loss_type, algo.beta, algo.loss_agg_mode, algo.sft_weight)
        self.teacher_val: dict[str, float] | None = None
        # Roles on the same devices take turns (trainer.offload_idle_roles): the teacher scores (or generates), the
        # student trains, its rollout generates. Colocated, the student and rollout share tensors: neither is offloaded.
        self.share_devices([["teacher"], ["actor"], ["rollout"]],
                           never_offloaded=FUSED_POLICY["policy"] if colocate else ())
        self.maybe_resume()

    @classmethod
    def load_data(cls, config: DistillConfig):
        """Off-policy on the dataset: one row per response (as SFT's); otherwise the prompts, each once."""
        train, val, tokenizer = load_datasets(config.data, config.actor.strategy.tokenizer,
                                              RewardRoutes(config.reward_fn, config.reward_kwargs))
        if config.response_source == "dataset":
            train = train.one_response_per_row(config.data.sft_response_key)
        return train, val, tokenizer

    # --- the step's pieces ---------------------------------------------------------------------

    def make_responses(self, indices: list[int]):
        """The step's responses to score and train on, in the generate() layout, at the distillation temperature;
        and their metrics."""
        data, sampling = self.config.data, self.config.sampling
        if self.config.response_source == "dataset":
            batch = collate_sft(self.train_data, indices, self.tokenizer, data.max_prompt_len, data.sft_response_key)
        else:
            prompts = collate_prompts(self.train_data, indices, self.tokenizer, data.max_prompt_len)
            if self.config.response_source == "student":
                self.sync_weights()  # the rollout samples with the student's latest weights
                generator = self.rollout
            else:
                self.on_device("teacher")
                generator = self.teacher
            with self.timer("generate"):
                batch = generator.generate(prompts, sampling.params()).select(batch_keys=_TRAIN_COLUMNS)
        batch.meta_info["temperature"] = self.config.algorithm.temperature  # both models' log-probs at it
        return batch, {"response_length/mean": float(batch.batch["response_mask"].sum(-1).float().mean())}

    def score_with_teacher(self, batch) -> None:
        """Add the teacher's top-k log-probs and ids of every response token to `batch`."""
        self.on_device("teacher")
        scores = self.teacher.compute_top_k_log_probs(batch, self.config.algorithm.top_k)
        batch.batch[TEACHER_TOP_K_LOG_PROBS] = scores.batch["top_k_log_probs"]
        batch.batch[TEACHER_TOP_K_IDS] = scores.batch["top_k_ids"]

    # --- validation and state -------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        self.sync_weights()
        result = validation(self.rollout, self.reward, self.val_data, self.tokenizer, self.config.val_sampling,
                            self.config.data.max_prompt_len, self.global_step, self.trainer.log_samples)
        self.val_samples = result.samples
        return result.metrics

    def validate_teacher(self) -> dict[str, float]:
        """The teacher's held-out accuracy, measured once (a resumed run keeps the first measurement)."""
        if self.teacher_val is None:
            self.on_device("teacher")
            self.teacher_val = validate(self.teacher, self.reward, self.val_data, self.tokenizer,
                                        self.config.val_sampling, self.config.data.max_prompt_len)
        return self.teacher_val

    def pipeline_state(self) -> dict:
        return {**super().pipeline_state(), "teacher_val": self.teacher_val}

    def load_pipeline_state(self, state: dict) -> None:
        super().load_pipeline_state(state)
        self.teacher_val = state["teacher_val"]

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> dict:
        trainer, algo = self.config.trainer, self.config.algorithm
        tracker = self.make_tracker()
        start = time.perf_counter()
        teacher_accuracy = self.validate_teacher().get("val/accuracy")
        if self.global_step == 0 and trainer.val_before_train:  # `first_validation`, with the teacher's accuracy
            self.first_val = self.validation(0)
            teacher = {"val/teacher_accuracy": teacher_accuracy} if teacher_accuracy is not None else {}
            tracker.log({**self.first_val, **teacher}, step=0)
        first_val = self.first_val
        metrics: dict[str, float] = {}
        for step in self.training_steps("distill"):
            with self.timer("step"):
                batch, response_metrics = self.make_responses(self.sampler.next_indices(trainer.num_prompts_per_step))
                with self.timer("teacher"):
                    self.score_with_teacher(batch)
                self.on_device("actor")
                with self.timer("update_actor"):
                    per_rank = self.actor.train_step(batch, self.loss, loss_unit(algo.loss_agg_mode))
            metrics = {**{key: per_rank[0][key] for key in DISTILL_METRICS}, **response_metrics,
                       "actor/grad_norm": per_rank[0]["grad_norm"], "actor/lr": per_rank[0]["lr"], **self.timings}
            self.end_step(step, metrics, "loss", "distill/loss")
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_loss=metrics.get("distill/loss"),
                                        teacher_val_accuracy=teacher_accuracy, mode=algo.mode,
                                        response_source=self.config.response_source, loss_type=algo.loss_type))
