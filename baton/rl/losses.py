"""The loss callables the pipelines hand to `train_step`: picklable, configured once, summed over their units.

Their metrics are (sum, count) pairs (see `baton.strategy.base.LossFn`): a loss term as its sum and
its units, a per-token statistic as its mean times the valid tokens and the valid tokens, so every
split of a batch over micro-batches and workers reports the value of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from baton.algorithms import (
    agg_loss, compute_policy_loss, compute_rollout_correction, count_loss_units, entropy_loss, kl_penalty, loss_unit,
    num_loss_units, value_loss,
)
from baton.algorithms.distill import check_top_k, forward_kl, reverse_kl, token_distill_loss, with_tail
from baton.algorithms.utils import masked_count, masked_mean
from baton.data import DataProto


def unit_metric(loss: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str) -> tuple[float, float]:
    """A term aggregated with `loss_agg_mode` as (its sum, its units): what the strategy normalises the loss by."""
    return (float(loss.detach() * num_loss_units(mask, loss_agg_mode)),
            float(count_loss_units(mask, loss_unit(loss_agg_mode))))


def token_metric(mean: float, mask: torch.Tensor) -> tuple[float, float]:
    """A mean over the valid tokens as (mean · tokens, tokens)."""
    tokens = float(masked_count(mask))
    return mean * tokens, tokens


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss by name (baton.algorithms.POLICY_LOSSES: vanilla PPO clip, gspo, cispo, gpg, clip_cov,
    kl_cov), + optional entropy bonus and KL-to-reference loss, in sum form. `settings`: an instance of the loss's
    config class (`AlgorithmConfig.policy_loss_config()`; None: its defaults). A `rollout_correction` other than
    "none" (baton.algorithms.ROLLOUT_CORRECTIONS) weighs the policy loss's tokens by the rollout log-probs against the
    old ones, with `correction_settings`, an instance of its config class (None: its defaults); the batch must then
    hold `old_log_probs` and `rollout_log_probs`."""

    policy_loss: str = "vanilla"
    settings: Any = None
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0  # 0: no KL loss term
    kl_loss_estimator: str = "k3"
    rollout_correction: str = "none"
    correction_settings: Any = None

    @property
    def entropy_grad(self) -> bool:
        """Entropy needs a gradient only as a bonus term; otherwise it is a metric (see `LossFn`)."""
        return self.entropy_coeff != 0

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto
                 ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
        mask = batch.batch["response_mask"]
        agg = {"loss_agg_mode": self.loss_agg_mode, "loss_scale_factor": self.loss_scale_factor}
        # On-policy (one epoch, one mini-batch) the pipeline skips the old log-prob pass: the weights that
        # produced the batch are the ones being trained, so the old log-probs are these, detached.
        old_log_probs = batch.batch.get("old_log_probs")
        if old_log_probs is None:
            old_log_probs = outputs["log_probs"].detach()
        token_weights, correction_metrics = None, {}
        if self.rollout_correction != "none":  # "none" needs neither column and leaves the loss as it is
            token_weights, correction_metrics = compute_rollout_correction(
                self.rollout_correction, self._column(batch, "old_log_probs"), self._column(batch, "rollout_log_probs"),
                mask, self.correction_settings)
        loss, metrics = compute_policy_loss(self.policy_loss, outputs["log_probs"], old_log_probs,
                                            batch.batch["advantages"], mask, token_weights=token_weights,
                                            settings=self.settings, **agg)
        # The policy losses' own metrics are means over the valid tokens; the correction's are (sum, count) already.
        out = {"actor/pg_loss": unit_metric(loss, mask, self.loss_agg_mode),
               **{f"actor/{k}": token_metric(float(v), mask) for k, v in metrics.items()}, **correction_metrics,
               **self._by_staleness(outputs, batch, old_log_probs, token_weights, agg, list(metrics))}
        entropy = entropy_loss(outputs["entropy"], mask, **agg)
        out["actor/entropy"] = unit_metric(entropy, mask, self.loss_agg_mode)
        if self.entropy_coeff:
            loss = loss - self.entropy_coeff * entropy
        if self.kl_loss_coef:
            kl = agg_loss(kl_penalty(outputs["log_probs"], batch.batch["ref_log_probs"], self.kl_loss_estimator), mask,
                          self.loss_agg_mode, self.loss_scale_factor)
            loss = loss + self.kl_loss_coef * kl
            out["actor/kl"] = unit_metric(kl, mask, self.loss_agg_mode)
        return loss * num_loss_units(mask, self.loss_agg_mode), out

    def _by_staleness(self, outputs: dict[str, torch.Tensor], batch: DataProto, old_log_probs: torch.Tensor,
                      token_weights: torch.Tensor | None, agg: dict, names: list[str]
                      ) -> dict[str, tuple[float, float]]:
        """The policy loss's metrics (`names`: clip fraction, ppo_kl, ...) over the tokens of each staleness s from 0
        to the bound, as `actor/<metric>/staleness_<s>` (0 where no token is that stale), where the batch says each
        token's weight version, the version it trains and the bound (`rollout_weight_versions`, meta_info
        `trained_version` and `max_staleness` > 0: the rollout system's overlapped modes). The same names on every
        rank, whatever its rows. Computed again per staleness, without gradients and with the random state restored
        (a loss that samples tokens draws the same as without them)."""
        versions, bound = batch.batch.get("rollout_weight_versions"), batch.meta_info.get("max_staleness", 0)
        if versions is None or not bound:
            return {}
        mask = batch.batch["response_mask"]
        real = mask.bool() & (versions >= 0)
        staleness = batch.meta_info["trained_version"] - versions
        log_probs = outputs["log_probs"].detach()
        devices = [log_probs.device.index] if log_probs.is_cuda else []
        out = {}
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for s in range(bound + 1):
                bucket = (real & (staleness == s)).to(mask.dtype)
                metrics = {}
                if bucket.any():
                    _, metrics = compute_policy_loss(self.policy_loss, log_probs, old_log_probs,
                                                     batch.batch["advantages"], bucket, token_weights=token_weights,
                                                     settings=self.settings, **agg)
                out.update({f"actor/{k}/staleness_{s}": token_metric(float(metrics[k]), bucket) if k in metrics
                            else (0.0, 0.0) for k in names})
        return out

    def _column(self, batch: DataProto, name: str) -> torch.Tensor:
        if name not in batch.batch:
            where = {"old_log_probs": "the actor's log-probs before the update, which the RLVR pipeline computes when "
                                      "a rollout correction is on",
                     "rollout_log_probs": "the rollout engine's log-probs of its samples, which its generate returns"}
            raise ValueError(f"rollout_correction {self.rollout_correction!r} needs the batch column {name!r} "
                             f"({where[name]}), and this batch has only {sorted(batch.batch.keys())}; add it, or set "
                             "algorithm.rollout_correction: none")
        return batch.batch[name]


@dataclass(frozen=True)
class ValueLoss:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto
                 ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
        mask = batch.batch["response_mask"]
        loss, metrics = value_loss(outputs["values"], batch.batch["values"], batch.batch["returns"], mask,
                                   self.cliprange_value, self.loss_agg_mode, self.loss_scale_factor)
        return loss * num_loss_units(mask, self.loss_agg_mode), {
            "critic/vf_loss": unit_metric(loss, mask, self.loss_agg_mode),
            "critic/vf_clipfrac": token_metric(metrics["vf_clipfrac"], mask)}


@dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response (answer) tokens, summed over tokens."""

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.batch["response_mask"]
        return -(outputs["log_probs"] * mask).sum(), {}


# The batch columns of the teacher's scores (`TeacherWorker.compute_top_k_log_probs`), [rows, response_len, k] each.
TEACHER_TOP_K_LOG_PROBS, TEACHER_TOP_K_IDS = "teacher_top_k_log_probs", "teacher_top_k_ids"


@dataclass(frozen=True)
class DistillLoss:
    """A token-level distillation loss (`baton.algorithms.distill`: forward_kl, reverse_kl, jsd with `beta`) of the
    student against the teacher's top-k log-probs and ids in the batch, aggregated with `loss_agg_mode`, in sum form.
    `log_probs_at` tells the strategy to return the student's log-probs at the teacher's ids ("log_probs_at").

    sft_weight w: the loss is (1 - w) * distillation + w * the responses' negative log-likelihood (Hinton's hard-label
    term; for responses that are right answers: the dataset's). distill/sft_nll reports that NLL whatever w.

    Metrics (token means but distill/loss): the loss; both KLs on the top-k + tail outcomes, whichever the loss;
    the mass the top-k covers of the teacher's and of the student's distribution; the share of tokens where the
    student's most likely of the k is the teacher's top-1; the student's entropy."""

    loss_type: str = "forward_kl"
    beta: float = 0.5
    loss_agg_mode: str = "token-mean"
    sft_weight: float = 0.0
    log_probs_at: str = TEACHER_TOP_K_IDS

    @property
    def entropy_grad(self) -> bool:
        return False  # the entropy is a metric here

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto
                 ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
        mask = batch.batch["response_mask"]
        for name in (TEACHER_TOP_K_LOG_PROBS, TEACHER_TOP_K_IDS):
            if name not in batch.batch:
                raise ValueError(f"the distillation loss needs the teacher's {name!r} in the batch (the teacher's "
                                 "compute_top_k_log_probs of these responses); compute them first")
        teacher, ids = batch.batch[TEACHER_TOP_K_LOG_PROBS], batch.batch[TEACHER_TOP_K_IDS]
        check_top_k(teacher, ids)
        if "log_probs_at" not in outputs:
            raise ValueError("the actor's strategy returned no log-probs at the teacher's top-k ids (outputs "
                             f"{sorted(outputs)}); it cannot distil: use actor.strategy.name hf or fsdp2")
        student = outputs["log_probs_at"]  # [rows, response_len, k], with gradients
        per_token = token_distill_loss(self.loss_type, student, teacher, self.beta)  # [rows, response_len]
        nll = -outputs["log_probs"]  # [rows, response_len]: the responses' own tokens
        if self.sft_weight:
            per_token = (1.0 - self.sft_weight) * per_token + self.sft_weight * nll
        loss = agg_loss(per_token, mask, self.loss_agg_mode)
        with torch.no_grad():
            s, t = with_tail(student.detach().float()), with_tail(teacher.float())
            stats = {"distill/forward_kl": forward_kl(s, t), "distill/reverse_kl": reverse_kl(s, t),
                     "distill/teacher_top_k_mass": teacher.float().exp().sum(-1),
                     "distill/student_top_k_mass": student.detach().float().exp().sum(-1),
                     "distill/top1_agreement": (student.detach().argmax(-1) == 0).float(),
                     "distill/sft_nll": nll.detach().float()}
        out = {"distill/loss": unit_metric(loss, mask, self.loss_agg_mode),
               **{name: token_metric(float(masked_mean(value, mask)), mask) for name, value in stats.items()},
               "actor/entropy": token_metric(float(masked_mean(outputs["entropy"].detach(), mask)), mask)}
        return loss * num_loss_units(mask, self.loss_agg_mode), out
