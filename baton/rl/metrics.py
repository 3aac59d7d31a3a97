"""The RL step's metrics, by verl's names: a trained batch's, the reward's, and validation's one metric set.

Every driver (the loop, the rollout system, the workflow nodes) logs these, so a run's metrics mean the same thing
whichever drove it.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from baton.data import DataProto
from baton.rewards import REWARD_EXTRA_PREFIX
from baton.rl.val_metrics import pass_at_k, sample_sizes, validation_metrics


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
        metrics.update(correction_diagnostics(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"]))
        if "rollout_weight_versions" in data:
            metrics.update(by_staleness(batch))
    if groups:  # group estimators: the share of groups that teach nothing
        metrics["critic/frac_reward_zero_std"] = zero_std_group_fraction(data["scores"].numpy(),
                                                                         batch.non_tensor_batch["uid"])
    return metrics


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


def correction_diagnostics(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                           mask: torch.Tensor) -> dict[str, float]:
    """How well the engines' samples stand for the actor's policy (before the update), over response tokens, with
    r = p_actor / p_rollout per token: the importance weights' effective sample size as a share of the tokens,
    (sum r)^2 / (n sum r^2) (`rollout_corr/ess`; 1 where every weight is equal), the same over sequences (each
    sequence's r the product of its tokens', `rollout_corr/seq_ess`), and the mismatch KL(rollout || actor) by the
    k3 estimator mean(r - 1 - log r) (`rollout/mismatch_kl`, >= 0)."""
    real = mask.bool()
    log_ratio = (actor_log_probs - rollout_log_probs).masked_fill(~real, 0.0).clamp(-20.0, 20.0)
    if not real.any():
        return {}
    token = log_ratio[real].double()
    rows = real.any(-1)
    return {"rollout_corr/ess": effective_sample_share(token), "rollout_corr/seq_ess":
            effective_sample_share(log_ratio.sum(-1)[rows].double().clamp(-20.0, 20.0)),
            "rollout/mismatch_kl": float((token.exp() - 1 - token).mean())}


def effective_sample_share(log_weights: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) of the weights exp(log_weights): 1 for equal weights, 1/n for one weight alone."""
    w = (log_weights - log_weights.max()).exp()  # the share is scale-free: no overflow
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


def by_staleness(batch: DataProto) -> dict[str, float]:
    """The trained batch's tokens by staleness s from 0 to the bound (its meta_info `trained_version` less each
    token's weight version; `max_staleness` > 0: the rollout system's overlapped modes): their share of the response
    tokens (`staleness/s/token_frac`), advantage mean (`staleness/s/advantage_mean`) and mismatch KL against the actor
    (`staleness/s/mismatch_kl`, as `correction_diagnostics`), so that stale tokens can be told from fresh ones; 0 where
    no token is that stale."""
    data, bound = batch.batch, batch.meta_info.get("max_staleness", 0)
    if not bound:
        return {}
    versions = data["rollout_weight_versions"]
    real = data["response_mask"].bool() & (versions >= 0)
    staleness = batch.meta_info["trained_version"] - versions
    log_ratio = (data["old_log_probs"] - data["rollout_log_probs"]).clamp(-20.0, 20.0).double()
    metrics, total = {}, max(float(real.sum()), 1.0)
    for s in range(bound + 1):
        bucket = real & (staleness == s)
        some = bool(bucket.any())
        metrics[f"staleness/{s}/token_frac"] = float(bucket.sum()) / total
        metrics[f"staleness/{s}/mismatch_kl"] = float((log_ratio[bucket].exp() - 1 - log_ratio[bucket]).mean()) \
            if some else 0.0
        if "advantages" in data:
            metrics[f"staleness/{s}/advantage_mean"] = float(data["advantages"][bucket].mean()) if some else 0.0
    return metrics


def zero_std_group_fraction(scores: np.ndarray, uids: np.ndarray) -> float:
    """The share of prompt groups (rows with one uid) whose samples all got the same reward; TRL logs it as
    `frac_reward_zero_std`. For a group estimator such a group's advantages are zero: it teaches nothing."""
    _, group = np.unique(uids, return_inverse=True)
    low, high = np.full(group.max() + 1, np.inf), np.full(group.max() + 1, -np.inf)
    np.minimum.at(low, group, scores)
    np.maximum.at(high, group, scores)
    return float(np.mean(np.isclose(low, high)))


def reward_error_count(rewards: DataProto, prefix: str = "") -> dict[str, float]:
    """`reward/num_errors`: the rows the reward function raised on or ran past reward.timeout_s_per_row on, scored 0
    (reward_on_error: zero); `reward/num_timeouts`: those of them that ran past the limit."""
    counts = rewards.meta_info.get("metrics", {})
    return {f"{prefix}reward/{name}": float(np.sum(counts.get(f"reward/{name}", 0)))
            for name in ("num_errors", "num_timeouts")}


def reward_extra_metrics(rewards: DataProto, prefix: str = "") -> dict[str, float]:
    """`reward/<key>/mean`: the batch mean of each further field of a reward function that returns a dict."""
    return {f"{prefix}reward/{name.removeprefix(REWARD_EXTRA_PREFIX)}/mean": float(values.mean())
            for name, values in rewards.batch.items() if name.startswith(REWARD_EXTRA_PREFIX)}


def model_score_metrics(rewards: DataProto) -> dict[str, float]:
    """The reward model's metrics that scoring put in `rewards.meta_info["metrics"]` (`reward_model/...`)."""
    return {k: float(np.sum(v)) for k, v in rewards.meta_info.get("metrics", {}).items() if k.startswith("reward_model/")}


def validation_set_metrics(scores: np.ndarray, uids: Sequence, response_lengths: np.ndarray, truncated: np.ndarray,
                           fields: dict[str, np.ndarray], data_sources: Sequence | None, votes: Sequence,
                           num_samples_per_prompt: int, num_errors: float, num_timeouts: float,
                           prefix: str = "val/") -> dict[str, float]:
    """One held-out set's metrics, the same whichever driver generated them: `{prefix}accuracy` (share of responses
    with reward >= 1), `{prefix}pass@{k}` (the unbiased pass@k of reward >= 1, averaged over prompts, for verl's
    k = 2, 4, … n), `{prefix}reward/mean`, `{prefix}response_length/mean`, `{prefix}truncated_ratio` (the share that
    hit max_new_tokens: `truncated` [rows] bool), `{prefix}reward/<key>/mean` for each further
    numeric field of a dict reward (`fields`), `{prefix}reward/num_errors` and `/num_timeouts`; and verl's
    `val-core/{data_source}/{variable}/{metric}` and `val-aux/...` (see `validation_metrics`) of the score ("reward")
    and of each field ("acc", ...), under `prefix` unless it is "val/". maj@k votes over `votes` (a dict reward's
    "pred", or each decoded response stripped of surrounding whitespace: verl logs no maj@k without "pred")."""
    if "reward" in fields:
        raise ValueError("a dict reward's field 'reward' would clash with validation's name for the score "
                         "(verl's val-core/<data_source>/reward/...); rename the field")
    correct = scores >= 1.0
    verl = validation_metrics({"reward": scores, **fields}, uids, data_sources, votes)
    return {f"{prefix}accuracy": float(np.mean(correct)),
            **{f"{prefix}pass@{k}": pass_at_k(correct, uids, k) for k in sample_sizes(num_samples_per_prompt)},
            f"{prefix}reward/mean": float(scores.mean()),
            f"{prefix}response_length/mean": float(np.mean(response_lengths)),
            f"{prefix}truncated_ratio": float(np.mean(truncated)),
            f"{prefix}reward/num_errors": float(num_errors), f"{prefix}reward/num_timeouts": float(num_timeouts),
            **{f"{prefix}reward/{name}/mean": float(values.mean()) for name, values in fields.items()},
            **{(key if prefix == "val/" else prefix + key): value for key, value in verl.items()}}


def prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """Metric names as verl users know them: keys that already carry a role prefix keep it."""
    return {(k if "/" in k else prefix + k): v for k, v in metrics.items()}


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
