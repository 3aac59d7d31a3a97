"""The loss callables the pipelines hand to `train_step`: picklable, configured once, summed over their units."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.algorithms import agg_loss, compute_policy_loss, entropy_loss, kl_penalty, num_loss_units, value_loss
from baton.data import DataProto


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss by name (baton.algorithms.POLICY_LOSSES: vanilla PPO clip, gspo, cispo, gpg, clip_cov,
    kl_cov), + optional entropy bonus and KL-to-reference loss, in sum form. `settings` go to the loss that
    takes them (`policy_loss_params`)."""

    policy_loss: str = "vanilla"
    settings: dict = field(default_factory=dict)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0  # 0: no KL loss term
    kl_loss_estimator: str = "k3"

    @property
    def entropy_grad(self) -> bool:
        """Entropy needs a gradient only as a bonus term; otherwise it is a metric (see `LossFn`)."""
        return self.entropy_coeff != 0

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.batch["response_mask"]
        agg = {"loss_agg_mode": self.loss_agg_mode, "loss_scale_factor": self.loss_scale_factor}
        # On-policy (one epoch, one mini-batch) the pipeline skips the old log-prob pass: the weights that
        # produced the batch are the ones being trained, so the old log-probs are these, detached.
        old_log_probs = batch.batch.get("old_log_probs")
        if old_log_probs is None:
            old_log_probs = outputs["log_probs"].detach()
        loss, metrics = compute_policy_loss(self.policy_loss, outputs["log_probs"], old_log_probs,
                                            batch.batch["advantages"], mask, **self.settings, **agg)
        out = {"actor/pg_loss": float(loss.detach()), **{f"actor/{k}": float(v) for k, v in metrics.items()}}
        entropy = entropy_loss(outputs["entropy"], mask, **agg)
        out["actor/entropy"] = float(entropy.detach())
        if self.entropy_coeff:
            loss = loss - self.entropy_coeff * entropy
        if self.kl_loss_coef:
            kl = agg_loss(kl_penalty(outputs["log_probs"], batch.batch["ref_log_probs"], self.kl_loss_estimator), mask,
                          self.loss_agg_mode, self.loss_scale_factor)
            loss = loss + self.kl_loss_coef * kl
            out["actor/kl"] = float(kl.detach())
        return loss * num_loss_units(mask, self.loss_agg_mode), out


@dataclass(frozen=True)
class ValueLoss:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.batch["response_mask"]
        loss, metrics = value_loss(outputs["values"], batch.batch["values"], batch.batch["returns"], mask,
                                   self.cliprange_value, self.loss_agg_mode, self.loss_scale_factor)
        return loss * num_loss_units(mask, self.loss_agg_mode), {"critic/vf_loss": float(loss.detach()),
                                                                  "critic/vf_clipfrac": metrics["vf_clipfrac"]}


@dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response (answer) tokens, summed over tokens."""

    def __call__(self, outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.batch["response_mask"]
        return -(outputs["log_probs"] * mask).sum(), {}
