"""The loss callables the pipelines hand to `train_step`: picklable, configured once, summed over their units."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.algorithms import agg_loss, entropy_loss, kl_penalty, num_loss_units, ppo_clip_loss, value_loss
from baton.data import DataProto


@dataclass(frozen=True)
class PolicyLoss:
    """PPO clipped policy loss (+ optional entropy bonus and KL-to-reference loss), in sum form."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0  # 0: no KL loss term
    kl_loss_estimator: str = "k3"

    @property
    def entropy_grad(self) -> bool:
        """Entropy needs a gradient only as a bonus term; otherwise it is a metric (see `LossFn`)."""
        return self.entropy_coeff != 0

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.batch["response_mask"]
        # On-policy (one epoch, one mini-batch) the pipeline skips the old log-prob pass: the weights that
        # produced the batch are the ones being trained, so the old log-probs are these, detached.
        old_log_probs = batch.batch.get("old_log_probs")
        if old_log_probs is None:
            old_log_probs = outputs["log_probs"].detach()
        loss, metrics = ppo_clip_loss(outputs["log_probs"], old_log_probs, batch.batch["advantages"], mask,
                                      self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c, self.loss_agg_mode)
        out = {"actor/pg_loss": float(loss.detach()), "actor/pg_clipfrac": metrics["pg_clipfrac"],
               "actor/ppo_kl": metrics["ppo_kl"], "actor/pg_clipfrac_lower": metrics["pg_clipfrac_lower"]}
        entropy = entropy_loss(outputs["entropy"], mask, self.loss_agg_mode)
        out["actor/entropy"] = float(entropy.detach())
        if self.entropy_coeff:
            loss = loss - self.entropy_coeff * entropy
        if self.kl_loss_coef:
            kl = agg_loss(kl_penalty(outputs["log_probs"], batch.batch["ref_log_probs"], self.kl_loss_estimator), mask,
                          self.loss_agg_mode)
            loss = loss + self.kl_loss_coef * kl
            out["actor/kl"] = float(kl.detach())
        return loss * num_loss_units(mask, self.loss_agg_mode), out


@dataclass(frozen=True)
class ValueLoss:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.batch["response_mask"]
        loss, metrics = value_loss(outputs["values"], batch.batch["values"], batch.batch["returns"], mask,
                                   self.cliprange_value, self.loss_agg_mode)
        return loss * num_loss_units(mask, self.loss_agg_mode), {"critic/vf_loss": float(loss.detach()),
                                                                  "critic/vf_clipfrac": metrics["vf_clipfrac"]}


@dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response (answer) tokens, summed over tokens."""

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.batch["response_mask"]
        return -(outputs["log_probs"] * mask).sum(), {}
