"""RLVR: reinforcement learning on verifiable rewards, GRPO (no critic) or PPO (critic + GAE).

The loop: generate (and, for ReMax, a greedy baseline) → reward → old/ref log-probs (and values) → advantages →
update → sync → validate → checkpoint. Roles on the same devices take turns on them (`on_device`: the rollout for
generation, validation and the sync; the actor, reference and critic for their compute). Copy `run()` to make a new
algorithm.
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np
import torch
from tqdm import tqdm

from baton.algorithms import (AdaptiveKLController, apply_kl_penalty, compute_advantages, estimator_needs, loss_unit,
                              policy_loss_params, rollout_correction_params)
from baton.data import DataProto
from baton.datasets import PromptSampler, collate_prompts
from baton.pipelines.base import Pipeline
from baton.pipelines.config import AlgorithmConfig, RLVRConfig
from baton.pipelines.losses import PolicyLoss, ValueLoss
from baton.pipelines.policy import (FUSED_POLICY, connect_policy, policy_roles, reward_error_count,
                                    reward_extra_metrics, validate)
from baton.rewards import REWARD_EXTRA_PREFIX, RewardError
from baton.strategy import SamplingParams
from baton.workers import CriticWorker, ReferenceWorker, RewardWorker


class RLVRPipeline(Pipeline):
    config_cls = RLVRConfig

    def __init__(self, config: RLVRConfig):
        config = config.with_run_schedules()
        super().__init__(config, config.trainer)
        algo = config.algorithm
        self.sampler = PromptSampler(len(self.train_data), seed=config.trainer.seed)
        roles = {**policy_roles(config.actor, config.rollout),
                 "reward": (RewardWorker, config.reward, (
                     config.reward_fn, config.actor.strategy.tokenizer, config.reward_on_error,
                     config.reward.num_processes_per_worker, config.reward.timeout_s_per_row,
                     config.sampling.max_new_tokens, config.overlong_buffer.len, config.overlong_buffer.penalty_factor))}
        if config.reference is not None or algo.use_kl_loss or algo.use_kl_in_reward:
            reference = config.reference or config.actor
            roles["reference"] = (ReferenceWorker, reference, (reference.strategy,))
        needs = estimator_needs(algo.adv_estimator)  # the estimator's registration says what it needs
        if needs.critic:
            roles["critic"] = (CriticWorker, config.critic, (config.critic.strategy,))
        if config.reward_model is not None:
            roles["reward_model"] = reward_model_role(config)
        roles.update(self.extra_roles(config))
        clusters = self.create_clusters(roles, fused=self.fused_roles(config, roles))
        self.actor, self.rollout, self.reward = clusters["actor"], clusters["rollout"], clusters["reward"]
        self.reference, self.critic = clusters.get("reference"), clusters.get("critic")
        self.reward_model = clusters.get("reward_model")
        self.update_pairs = [connect_policy(clusters, config.actor, config.rollout, config.colocate_actor_rollout,
                                            self.val_data, self.tokenizer)]
        self.checkpoint_clusters = ["actor"] + (["critic"] if self.critic else [])
        # Roles on the same devices take turns (trainer.offload_idle_roles): the rollout generates, then the
        # actor, reference and critic compute. Colocated actor and rollout share tensors: neither is offloaded.
        self.share_devices([["rollout"], ["actor", "reference", "critic"]],
                           never_offloaded=FUSED_POLICY["policy"] if config.colocate_actor_rollout else ())
        stale = config.trainer.sync_every_steps > 1 and not config.colocate_actor_rollout  # colocated: shared tensors
        self.build_algorithm(config, stale)
        self.maybe_resume()

    def extra_roles(self, config: RLVRConfig) -> dict:
        """Further clusters to start with the loop's (name → (worker class, settings, constructor args)); none."""
        return {}

    def fused_roles(self, config: RLVRConfig, roles: dict) -> dict | None:
        """Roles that share one process per slot: the actor and rollout when colocated."""
        return FUSED_POLICY if config.colocate_actor_rollout else None

    def build_algorithm(self, config: RLVRConfig, stale: bool) -> None:
        """The losses, the KL controller, the signal watch and the baseline sampling of `config.algorithm`, and
        whether a step computes old log-probs. stale: the rollout samples with weights older than the actor's."""
        algo = config.algorithm
        needs = estimator_needs(algo.adv_estimator)
        self.policy_loss = PolicyLoss(algo.policy_loss, policy_loss_settings(algo), algo.loss_agg_mode,
                                      algo.loss_scale_factor, algo.entropy_coeff,
                                      algo.kl_loss_coef if algo.use_kl_loss else 0.0, algo.kl_loss_estimator,
                                      algo.rollout_correction, rollout_correction_settings(algo))
        self.value_loss = ValueLoss(algo.cliprange_value, algo.loss_agg_mode, algo.loss_scale_factor)
        self.kl_ctrl = (AdaptiveKLController(algo.kl_reward_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon)
                        if algo.use_kl_in_reward and algo.kl_ctrl.type == "adaptive" else None)
        self.signal_watch = SignalWatch(algo.adv_estimator) if needs.groups else None
        # ReMax (verl): one greedy response per prompt, whose reward is the baseline of that prompt's samples.
        self.baseline_sampling = (SamplingParams(temperature=0.0, max_new_tokens=config.sampling.max_new_tokens, n=1)
                                  if needs.baseline_rollout else None)
        # One update per batch is on-policy: the loss detaches the current log-probs instead (as TRL does).
        # Several epochs or mini-batches move the weights between updates, the KL reward penalty needs the
        # log-probs before the update, and with sync_every_steps > 1 they measure how far the rollout's older
        # weights are from the actor's (rollout/logprob_diff); a rollout correction weighs the loss by them.
        corrected = algo.rollout_correction != "none"
        self.needs_old_log_probs = (algo.num_ppo_epochs > 1 or algo.num_mini_batches_per_step > 1
                                    or algo.use_kl_in_reward or stale or corrected)
        if stale and not corrected:
            warnings.warn(
                f"trainer.sync_every_steps={config.trainer.sync_every_steps}: the rollout samples with weights up to "
                f"{config.trainer.sync_every_steps - 1} update(s) older than the actor's, and the loss does not correct "
                "for it (its ratio is against the actor's own log-probs); rollout/logprob_diff/mean and max show the "
                "gap. Use sync_every_steps=1 for on-policy training, or an algorithm.rollout_correction",
                StaleSamplesWarning, stacklevel=3)

    def pipeline_state(self) -> dict:
        return {**super().pipeline_state(), "kl_coef": self.kl_ctrl.value if self.kl_ctrl is not None else None}

    def load_pipeline_state(self, state: dict) -> None:
        super().load_pipeline_state(state)
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = state["kl_coef"]

    def next_prompts(self) -> DataProto:
        trainer = self.config.trainer
        return collate_prompts(self.train_data, self.sampler.next_indices(trainer.num_prompts_per_step), self.tokenizer,
                               self.config.data.max_prompt_len, uid_offset=self.global_step * trainer.num_prompts_per_step)

    def compute_advantages(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        algo = self.config.algorithm
        coef = self.kl_ctrl.value if self.kl_ctrl is not None else algo.kl_reward_coef
        columns, metrics = advantage_columns(batch, algo, self.config.reward_fn, coef)
        if self.kl_ctrl is not None:  # verl: the observed KL over this batch's samples sets the next coefficient
            self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], num_steps=len(batch))
        batch.batch.update(columns)
        return batch, metrics

    def update(self, cluster, batch: DataProto, loss_fn) -> dict[str, float]:
        """num_ppo_epochs passes over num_mini_batches_per_step mini-batches; returns the last step's metrics."""
        algo = self.config.algorithm
        for _ in range(algo.num_ppo_epochs):
            for mini_batch in batch.chunk(algo.num_mini_batches_per_step):
                per_rank = cluster.train_step(mini_batch, loss_fn, loss_unit(algo.loss_agg_mode))
        return {k: float(np.mean([m[k] for m in per_rank])) for k in per_rank[0]}

    def train_on(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """A rewarded batch's old/ref log-probs and values, advantages, and the critic's and actor's updates; returns
        the batch with those columns and the metrics (advantages', `actor/...`, `critic/...`)."""
        if self.needs_old_log_probs:
            with self.timer("old_log_prob"):
                batch.batch["old_log_probs"] = self.actor.compute_log_probs(batch).batch["log_probs"]
        if self.reference is not None:
            with self.timer("ref"):
                batch.batch["ref_log_probs"] = self.reference.compute_log_probs(batch).batch["log_probs"]
        if self.critic is not None:
            with self.timer("values"):
                batch.batch["values"] = self.critic.compute_values(batch).batch["values"]
        with self.timer("adv"):
            batch, metrics = self.compute_advantages(batch)
        if self.critic is not None:
            with self.timer("update_critic"):
                metrics.update(_prefixed(self.update(self.critic, batch, self.value_loss), "critic/"))
        with self.timer("update_actor"):
            metrics.update(_prefixed(self.update(self.actor, batch, self.policy_loss), "actor/"))
        return batch, metrics

    def run(self) -> dict:
        trainer = self.config.trainer
        tracker = self.make_tracker()
        start = time.perf_counter()
        first_val = self.first_validation()
        metrics: dict[str, float] = {}
        for step in self.training_steps("rlvr"):
            with self.timer("step"):
                self.on_device("rollout")
                with self.timer("gen"):
                    prompts = self.next_prompts()
                    batch = self.rollout.generate(prompts, self.config.sampling.params())
                if self.baseline_sampling is not None:
                    with self.timer("gen_max"):
                        baseline = self.rollout.generate(prompts, self.baseline_sampling)
                        baseline_rewards = self.reward.compute_rewards(baseline, apply_overlong_penalty=True)
                        batch.batch["reward_baselines"] = baseline_per_row(baseline, baseline_rewards, batch)
                self.on_device("actor", "reference", "critic")
                with self.timer("reward"):
                    rewards = self.reward.compute_rewards(batch, apply_overlong_penalty=True)  # overlong_buffer
                    batch = batch.union(rewards.select(None, [], []))  # scores, token_level_scores, reward_extra/*
                    if self.reward_model is not None:
                        batch, model_metrics = add_model_scores(batch, self.reward_model.score(batch),
                                                                self.config.reward_model_settings.weight)
                        rewards.meta_info.setdefault("metrics", {}).update(model_metrics)
                batch, train_metrics = self.train_on(batch)
                if step % trainer.sync_every_steps == 0:
                    self.sync_rollout()
            metrics = {**self.rollout_metrics(batch), **reward_error_count(rewards), **reward_extra_metrics(rewards),
                       **{k: float(np.sum(v)) for k, v in rewards.meta_info.get("metrics", {}).items()
                          if k.startswith("reward_model/")}, **train_metrics, **self.timings}
            if self.signal_watch is not None:
                self.signal_watch.update(step, metrics["critic/frac_reward_zero_std"], metrics["critic/score/mean"])
            self.end_step(step, metrics, "reward", "critic/score/mean")
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_reward=metrics.get("critic/score/mean")))

    def rollout_metrics(self, batch: DataProto) -> dict[str, float]:
        metrics = batch_metrics(batch, groups=self.signal_watch is not None)
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / self.timings.get("timing_s/step", float("nan"))
        return metrics

    def validate(self) -> dict[str, float]:
        self.on_device("rollout")
        return validate(self.rollout, self.reward, self.val_data, self.tokenizer, self.config.val_sampling,
                        self.config.data.max_prompt_len)

    def roles_to_save_from(self) -> list[str]:
        return ["rollout", *self.checkpoint_clusters]  # the rollout's sampling state is saved too (pipeline_state)


def reward_model_role(config: RLVRConfig) -> tuple:
    """The `reward_model` cluster's (worker class, settings, constructor args): a scalar reward model or a judge."""
    from baton.workers.reward_model import JudgeWorker, RewardModelWorker

    role, settings = config.reward_model, config.reward_model_settings
    if settings.type == "scalar":
        return RewardModelWorker, role, (role.strategy,)
    return JudgeWorker, role, (role.strategy, settings.template, settings.parse_fn, settings.max_new_tokens)


def add_model_scores(batch: DataProto, scored: DataProto, weight: float) -> tuple[DataProto, dict]:
    """`batch` with `weight` × the reward model's `rm_scores` added to `scores` and to the last response token of
    `token_level_scores` (kept as `reward_extra/reward_model`), and its metrics: reward_model/score/mean and the
    judge's unparsed answers."""
    data = batch.batch
    model_scores = scored.batch["rm_scores"].float()
    lengths = data["response_mask"].long().sum(-1)
    rows = torch.arange(len(batch))[lengths > 0]
    data["token_level_scores"] = data["token_level_scores"].clone()
    data["token_level_scores"][rows, lengths[lengths > 0] - 1] += weight * model_scores[lengths > 0]
    data["scores"] = data["scores"] + weight * model_scores
    data[REWARD_EXTRA_PREFIX + "reward_model"] = model_scores
    metrics = {"reward_model/score/mean": float(model_scores.mean())}
    metrics.update(scored.meta_info.get("metrics", {}))
    return batch, metrics


def advantage_columns(batch: DataProto, algo: AlgorithmConfig, reward_fn, kl_coef: float
                      ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """`token_level_rewards` (the scores, less the KL penalty with use_kl_in_reward at `kl_coef`), `advantages` and
    `returns` [rows, response_len] of a rewarded batch by `algo.adv_estimator`, and the KL penalty's metrics."""
    data, metrics = batch.batch, {}
    rewards = data["token_level_scores"]
    if algo.use_kl_in_reward:
        rewards, metrics = apply_kl_penalty(rewards, data["old_log_probs"], data["ref_log_probs"], data["response_mask"],
                                            kl_coef, algo.kl_reward_estimator)
    advantages, returns = compute_advantages(
        algo.adv_estimator, token_level_rewards=rewards, response_mask=data["response_mask"],
        index=batch.non_tensor_batch["uid"], values=data.get("values"), reward_baselines=data.get("reward_baselines"),
        reward_components=reward_components(data, algo.gdpo_reward_keys, reward_fn),
        reward_weights=algo.gdpo_reward_weights, gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std,
    )
    return {"token_level_rewards": rewards, "advantages": advantages, "returns": returns}, metrics


def batch_metrics(batch: DataProto, groups: bool) -> dict[str, float]:
    """A trained batch's scores, response lengths, stop ratio, token count (`perf/total_num_tokens`), advantages
    and log-prob gap where it has them; with `groups` (a group estimator) the share of groups with one reward."""
    data = batch.batch
    lengths = data["response_mask"].sum(-1).float()
    metrics = {
        "critic/score/mean": float(data["scores"].mean()), "critic/score/max": float(data["scores"].max()),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response/stop_ratio": float(np.mean(batch.non_tensor_batch["finish_reason"] == "stop")),
        "perf/total_num_tokens": float(data["attention_mask"].sum()),
    }
    if "advantages" in data:  # absent where nothing trains (a rollout-only run, an SFT loss)
        metrics["critic/advantages/mean"] = float(data["advantages"][data["response_mask"].bool()].mean())
    if "reward_baselines" in data:  # ReMax: the greedy responses' mean reward (each prompt's, n times)
        metrics["critic/baseline_score/mean"] = float(data["reward_baselines"].mean())
    if "old_log_probs" in data and "rollout_log_probs" in data:
        metrics.update(logprob_gap(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"]))
    if groups:  # group estimators: the share of groups that teach nothing
        metrics["critic/frac_reward_zero_std"] = zero_std_group_fraction(data["scores"].numpy(),
                                                                         batch.non_tensor_batch["uid"])
    return metrics


def baseline_per_row(baseline: DataProto, baseline_rewards: DataProto, batch: DataProto) -> torch.Tensor:
    """ReMax's `reward_baselines` [rows]: for each row of `batch`, the reward of the greedy response (`baseline`, one
    per prompt, scored as `baseline_rewards`) to its prompt: its token-level scores summed (verl), matched by uid."""
    reward = baseline_rewards.batch["token_level_scores"].sum(-1)  # [prompts]
    by_uid = dict(zip(baseline.non_tensor_batch["uid"].tolist(), reward.tolist()))
    assert len(by_uid) == len(baseline), "one greedy response per prompt"
    return torch.tensor([by_uid[uid] for uid in batch.non_tensor_batch["uid"].tolist()], dtype=torch.float32)


def reward_components(data: dict[str, torch.Tensor], keys: list[str] | None, reward_fn: str) -> torch.Tensor | None:
    """The reward function's fields `keys` (algorithm.gdpo_reward_keys) stacked as [rows, len(keys)]; None without
    keys."""
    if keys is None:
        return None
    missing = [key for key in keys if REWARD_EXTRA_PREFIX + key not in data]
    if missing:
        returned = sorted(name.removeprefix(REWARD_EXTRA_PREFIX) for name in data
                          if name.startswith(REWARD_EXTRA_PREFIX))
        raise RewardError(
            f"algorithm.gdpo_reward_keys names {', '.join(map(repr, missing))}, which reward function {reward_fn!r} "
            f"does not return; the fields it returned beside 'score': {returned}. A reward function returns reward "
            "components as a dict, e.g. {'score': 1.0, 'format': 1.0, 'correct': 1.0}")
    return torch.stack([data[REWARD_EXTRA_PREFIX + key] for key in keys], dim=-1)


def policy_loss_settings(algo) -> dict:
    """The algorithm's policy-loss settings; a setting changed from its default that the chosen loss does not take
    is ignored with a warning."""
    names = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
             "kl_cov_ratio", "ppo_kl_coef")
    settings = {name: getattr(algo, name) for name in names}
    taken, defaults = policy_loss_params(algo.policy_loss), AlgorithmConfig()
    ignored = [n for n in names if n not in taken and settings[n] != getattr(defaults, n)]
    if ignored:
        warnings.warn(f"algorithm.policy_loss {algo.policy_loss!r} takes none of {ignored}; they are ignored",
                      stacklevel=3)
    return settings


def rollout_correction_settings(algo) -> dict:
    """The algorithm's rollout-correction settings; one changed from its default that the chosen correction does
    not take is ignored with a warning."""
    names = ("rollout_is_cap", "rollout_mask_low", "rollout_mask_high")
    settings = {name: getattr(algo, name) for name in names}
    taken, defaults = rollout_correction_params(algo.rollout_correction), AlgorithmConfig()
    ignored = [n for n in names if n not in taken and settings[n] != getattr(defaults, n)]
    if ignored:
        warnings.warn(f"algorithm.rollout_correction {algo.rollout_correction!r} takes none of {ignored}; they are "
                      "ignored", stacklevel=3)
    return settings


class StaleSamplesWarning(UserWarning):
    """Training uses samples from weights older than the actor's, without an importance-sampling correction."""


def logprob_gap(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's log-probs of its samples are from the actor's (before the update), over response
    tokens: |difference| mean and max, and the spread of the token-level ratio p_actor / p_rollout. Nonzero from
    numerics alone (another kernel, batch shape or dtype); large when the rollout's weights are stale."""
    real = mask.bool()
    diff = (actor_log_probs - rollout_log_probs)[real]  # [tokens]
    if not diff.numel():
        return {}
    ratio = diff.exp()
    return {"rollout/logprob_diff/mean": float(diff.abs().mean()), "rollout/logprob_diff/max": float(diff.abs().max()),
            "rollout/is_ratio/min": float(ratio.min()), "rollout/is_ratio/max": float(ratio.max())}


def zero_std_group_fraction(scores: np.ndarray, uids: np.ndarray) -> float:
    """The share of prompt groups (rows with one uid) whose samples all got the same reward; TRL logs it as
    `frac_reward_zero_std`. For a group estimator such a group's advantages are zero: it teaches nothing."""
    _, group = np.unique(uids, return_inverse=True)
    low, high = np.full(group.max() + 1, np.inf), np.full(group.max() + 1, -np.inf)
    np.minimum.at(low, group, scores)
    np.maximum.at(high, group, scores)
    return float(np.mean(np.isclose(low, high)))


class SignalWatch:
    """Says so above the progress bar when more than `threshold` of the prompt groups have had zero reward
    variance in each of `patience` steps in a row (no learning signal), then keeps quiet for `quiet_steps` steps."""

    def __init__(self, estimator: str, threshold: float = 0.9, patience: int = 5, quiet_steps: int = 50):
        self.estimator, self.threshold, self.patience, self.quiet_steps = estimator, threshold, patience, quiet_steps
        self.num_steps_without_signal = 0
        self.last_warning_step: int | None = None

    def update(self, step: int, zero_std_frac: float, mean_reward: float) -> str | None:
        """Take one step's `critic/frac_reward_zero_std` and mean reward; returns the warning when one is written."""
        self.num_steps_without_signal = self.num_steps_without_signal + 1 if zero_std_frac > self.threshold else 0
        if self.num_steps_without_signal < self.patience or (
                self.last_warning_step is not None and step - self.last_warning_step < self.quiet_steps):
            return None
        self.last_warning_step = step
        message = (
            f"baton: warning: step {step}: in each of the last {self.num_steps_without_signal} steps, over "
            f"{self.threshold:.0%} of the prompt groups gave all their samples the same reward (this step "
            f"{zero_std_frac:.0%}, mean reward {mean_reward:.3f}), so their {self.estimator} advantages are zero and "
            "the policy learns nothing from them. What usually helps: more SFT, or a learning-rate warm-up "
            "(actor.strategy.scheduler), so that some samples succeed; a higher sampling.temperature; more "
            "sampling.num_samples_per_prompt; a reward with partial credit; easier prompts (harder ones if every "
            "sample already succeeds).")
        tqdm.write(message, file=sys.stderr)
        return message


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """Metric names as verl users know them: keys that already carry a role prefix keep it."""
    return {(k if "/" in k else prefix + k): v for k, v in metrics.items()}


__all__ = ["RLVRPipeline", "SignalWatch", "StaleSamplesWarning", "baseline_per_row", "logprob_gap", "reward_components",
           "zero_std_group_fraction"]
