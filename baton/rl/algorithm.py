"""`RLAlgorithm`: the RL step of one config, built once and composed by every driver.

A rewarded batch goes in; its old and reference log-probs, values, advantages, and the critic's and actor's updates
come out, with the step's metrics. The loop (`pipelines.rlvr`), the rollout system (`pipelines.rollout_rlvr`) and the
workflow nodes (`dag.nodes`) all hold one, so a feature of the algorithm (an estimator, a loss, adaptive KL, a
rollout correction) works in every one of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from baton.algorithms import (
    AdaptiveKLController,
    apply_kl_penalty,
    compute_advantages,
    estimator_needs,
    loss_unit,
)
from baton.data import DataProto
from baton.data.balance import balance_by_tokens
from baton.rewards import REWARD_EXTRA_PREFIX, RewardError
from baton.rl.config import AlgorithmConfig
from baton.rl.losses import PolicyLoss, ValueLoss
from baton.rl.metrics import SignalWatch, batch_metrics, prefixed


class StaleSamplesWarning(UserWarning):
    """Training uses samples from weights older than the actor's, without an importance-sampling correction."""


@dataclass
class TrainingRoles:
    """The roles the RL step computes with: clusters on the driver, or a rank's own workers (the multi-controller).
    actor: `compute_log_probs(batch)` and `train_step(batch, loss_fn, loss_unit) -> [metrics per rank]`;
    reference: `compute_log_probs`; critic: `compute_values` and `train_step`. None: the config has no such role."""

    actor: Any
    reference: Any = None
    critic: Any = None


def _untimed(name: str):
    return contextlib.nullcontext()


class RLAlgorithm:
    """The losses, the KL controller and the estimator's needs of `config`, and the step that trains on a batch.

    reward_fn: the run's reward (named in GDPO's error message). stale: the samples come from weights older than
    the actor's (trainer.sync_every_steps > 1), so the old log-probs are computed (rollout/logprob_diff).
    """

    def __init__(self, config: AlgorithmConfig, reward_fn: Any = "exact_match", *, stale: bool = False):
        self.config, self.reward_fn = config, reward_fn
        self.needs = estimator_needs(config.adv_estimator)  # the estimator's registration says what it needs
        config.advantage_config()  # its settings are refused here, not at the first step, when the check was skipped
        self.policy_loss = PolicyLoss(config.policy_loss_name, config.policy_loss_config(), config.loss_agg_mode,
                                      config.loss_scale_factor, config.entropy_coeff,
                                      config.kl_loss_coef if config.use_kl_loss else 0.0, config.kl_loss_estimator,
                                      config.rollout_correction_name, config.rollout_correction_config())
        self.value_loss = ValueLoss(config.cliprange_value, config.loss_agg_mode, config.loss_scale_factor)
        self.kl_ctrl = (AdaptiveKLController(config.kl_reward_coef, config.kl_ctrl.target_kl, config.kl_ctrl.horizon)
                        if config.use_kl_in_reward and config.kl_ctrl.type == "adaptive" else None)
        self.signal_watch = SignalWatch(config.adv_estimator) if self.needs.groups else None
        # One update per batch is on-policy: the loss detaches the current log-probs instead (as TRL does).
        # Several epochs or mini-batches move the weights between updates, the KL reward penalty needs the
        # log-probs before the update, and stale samples measure how far the rollout's older weights are from the
        # actor's (rollout/logprob_diff); a rollout correction weighs the loss by them.
        self.corrected = config.rollout_correction_name != "none"
        self.needs_old_log_probs = (config.num_ppo_epochs > 1 or config.num_mini_batches_per_step > 1
                                    or config.use_kl_in_reward or stale or self.corrected)

    @property
    def needs_reference(self) -> bool:
        return self.config.use_kl_loss or self.config.use_kl_in_reward

    # --- the step -------------------------------------------------------------------------------

    @property
    def kl_coef(self) -> float:
        """The KL reward penalty's coefficient this step: the adaptive controller's, else the fixed one."""
        return self.kl_ctrl.value if self.kl_ctrl is not None else self.config.kl_reward_coef

    def advantage_columns(self, batch: DataProto) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """`token_level_rewards`, `advantages` and `returns` of a rewarded batch at this step's KL coefficient, and
        the KL penalty's metrics; the controller is not moved (see `observe_kl`)."""
        return advantage_columns(batch, self.config, self.reward_fn, self.kl_coef)

    def observe_kl(self, metrics: dict[str, float], num_rows: int) -> None:
        """verl: the observed KL of a batch's samples (`actor/reward_kl_penalty`) sets the next coefficient."""
        if self.kl_ctrl is not None:
            self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], num_steps=num_rows)

    def compute_advantages(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        columns, metrics = self.advantage_columns(batch)
        self.observe_kl(metrics, len(batch))
        batch.batch.update(columns)
        return batch, metrics

    def update(self, role, batch: DataProto, loss_fn) -> dict[str, float]:
        """num_ppo_epochs passes over num_mini_batches_per_step mini-batches; returns the last step's metrics."""
        config = self.config
        layout = getattr(role, "layout", None)  # a cluster's; a role run in this process has one rank
        num_ranks = layout.dp_size if layout is not None and config.balance_batch else 1
        for _ in range(config.num_ppo_epochs):
            for mini_batch in batch.chunk(config.num_mini_batches_per_step):
                mini_batch = balance_by_tokens(mini_batch, num_ranks)
                per_rank = role.train_step(mini_batch, loss_fn, loss_unit(config.loss_agg_mode))
        return {k: float(np.mean([m[k] for m in per_rank])) for k in per_rank[0]}

    def update_actor(self, actor, batch: DataProto) -> dict[str, float]:
        return prefixed(self.update(actor, batch, self.policy_loss), "actor/")

    def update_critic(self, critic, batch: DataProto) -> dict[str, float]:
        return prefixed(self.update(critic, batch, self.value_loss), "critic/")

    def train_on(self, batch: DataProto, roles: TrainingRoles, timer: Callable[[str], Any] = _untimed
                 ) -> tuple[DataProto, dict[str, float]]:
        """A rewarded batch's old/ref log-probs and values, advantages, and the critic's and actor's updates; returns
        the batch with those columns and the metrics (advantages', `actor/...`, `critic/...`). `timer(name)` times
        each phase (`timing_s/<name>`)."""
        if self.needs_old_log_probs:
            with timer("old_log_prob"):
                batch.batch["old_log_probs"] = roles.actor.compute_log_probs(batch).batch["log_probs"]
        if roles.reference is not None:
            with timer("ref"):
                batch.batch["ref_log_probs"] = roles.reference.compute_log_probs(batch).batch["log_probs"]
        if roles.critic is not None:
            with timer("values"):
                batch.batch["values"] = roles.critic.compute_values(batch).batch["values"]
        with timer("adv"):
            batch, metrics = self.compute_advantages(batch)
        if roles.critic is not None:
            with timer("update_critic"):
                metrics.update(self.update_critic(roles.critic, batch))
        with timer("update_actor"):
            metrics.update(self.update_actor(roles.actor, batch))
        return batch, metrics

    def batch_metrics(self, batch: DataProto) -> dict[str, float]:
        """The trained batch's metrics (`rl.metrics.batch_metrics`), the zero-variance group share for a group
        estimator."""
        return batch_metrics(batch, groups=self.needs.groups)

    def watch(self, step: int, metrics: dict[str, float]) -> None:
        """Warn when the group estimator's groups have long taught nothing (`SignalWatch`)."""
        if self.signal_watch is not None and "critic/frac_reward_zero_std" in metrics:
            self.signal_watch.update(step, metrics["critic/frac_reward_zero_std"], metrics["critic/score/mean"])

    # --- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"kl_coef": self.kl_ctrl.value if self.kl_ctrl is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = state["kl_coef"]


def advantage_columns(batch: DataProto, algo: AlgorithmConfig, reward_fn, kl_coef: float
                      ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """`token_level_rewards` (the scores, less the KL penalty with use_kl_in_reward at `kl_coef`), `advantages` and
    `returns` [rows, response_len] of a rewarded batch by `algo.adv_estimator`, and the KL penalty's metrics."""
    data, metrics, settings = batch.batch, {}, algo.advantage_config()
    rewards = data["token_level_scores"]
    if algo.use_kl_in_reward:
        rewards, metrics = apply_kl_penalty(rewards, data["old_log_probs"], data["ref_log_probs"], data["response_mask"],
                                            kl_coef, algo.kl_reward_estimator)
    advantages, returns = compute_advantages(
        algo.adv_estimator, token_level_rewards=rewards, response_mask=data["response_mask"],
        index=batch.non_tensor_batch["uid"], values=data.get("values"), reward_baselines=data.get("reward_baselines"),
        reward_components=reward_components(data, settings.gdpo_reward_keys, reward_fn),
        reward_weights=settings.gdpo_reward_weights, gamma=settings.gamma, lam=settings.lam,
        norm_adv_by_std=settings.norm_adv_by_std,
    )
    return {"token_level_rewards": rewards, "advantages": advantages, "returns": returns}, metrics


def add_model_scores(batch: DataProto, scored: DataProto, weight: float) -> tuple[DataProto, dict]:
    """`batch` with `weight` × the reward model's `rm_scores` added to `scores` and to the last response token of
    `token_level_scores` (kept as `reward_extra/reward_model`), and its metrics: the scores' distribution over the
    batch (reward_model/score/mean, std, min, max) and the judge's own counts (summed over its workers)."""
    data = batch.batch
    model_scores = scored.batch["rm_scores"].float()
    lengths = data["response_mask"].long().sum(-1)
    rows = torch.arange(len(batch))[lengths > 0]
    data["token_level_scores"] = data["token_level_scores"].clone()
    data["token_level_scores"][rows, lengths[lengths > 0] - 1] += weight * model_scores[lengths > 0]
    data["scores"] = data["scores"] + weight * model_scores
    data[REWARD_EXTRA_PREFIX + "reward_model"] = model_scores
    metrics = {"reward_model/score/mean": float(model_scores.mean()),
               "reward_model/score/std": float(model_scores.std(unbiased=False)),
               "reward_model/score/min": float(model_scores.min()), "reward_model/score/max": float(model_scores.max())}
    metrics.update({k: float(np.sum(v)) for k, v in scored.meta_info.get("metrics", {}).items()
                    if k.startswith("reward_model/")})
    return batch, metrics


def baseline_per_row(baseline: DataProto, baseline_rewards: DataProto, batch: DataProto) -> torch.Tensor:
    """ReMax's `reward_baselines` [rows]: for each row of `batch`, the reward of the greedy response (`baseline`, one
    per prompt, scored as `baseline_rewards`) to its prompt: its token-level scores summed (verl), matched by uid."""
    reward = baseline_rewards.batch["token_level_scores"].sum(-1)  # [prompts]
    by_uid = dict(zip(baseline.non_tensor_batch["uid"].tolist(), reward.tolist()))
    assert len(by_uid) == len(baseline), "one greedy response per prompt"
    return per_row(by_uid, batch)


def per_row(by_uid: dict, batch: DataProto) -> torch.Tensor:
    """A value per prompt (uid → value, e.g. its greedy baseline's reward) as one per row of `batch` [rows], each
    row taking its prompt's by its uid."""
    return torch.tensor([by_uid[uid] for uid in batch.non_tensor_batch["uid"].tolist()], dtype=torch.float32)


def reward_components(data: dict[str, torch.Tensor], keys: list[str] | None, reward_fn) -> torch.Tensor | None:
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
