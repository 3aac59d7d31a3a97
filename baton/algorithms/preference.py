"""Preference losses (DPO and its variants): pure functions of the sequence log-probs of chosen and rejected responses.

Names and formulas follow TRL's `DPOTrainer` (loss_type "sigmoid", "ipo", "hinge") and `CPOTrainer` ("simpo").
Every loss is a function of one logit per pair, h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected):

    sigmoid  -(1 - ε) log σ(β h) - ε log σ(-β h)            (DPO; ε = label_smoothing, the conservative DPO)
    hinge    max(0, 1 - β h)                                  (SLiC)
    ipo      (h - 1 / (2 β))²                                 (IPO; log-probs are per-token means, as in TRL)
    simpo    -(1 - ε) log σ(β h - γ) - ε log σ(-(β h - γ))    (SimPO; no reference: its log-probs are 0;
                                                               per-token means; γ = simpo_gamma)

The implicit rewards are β (policy - ref) of each response, as TRL logs them (`rewards/chosen`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from baton.config.registry import Registry


@dataclass(frozen=True)
class PreferenceLossSpec:
    """A registered preference loss: `fn(logits, beta, label_smoothing, simpo_gamma) -> losses [pairs]`; whether it
    compares with a reference model; whether its log-probs are per-token means instead of sums; and whether it
    reads label_smoothing."""

    fn: Callable[..., torch.Tensor]
    needs_reference: bool
    length_normalised: bool
    uses_label_smoothing: bool


PREFERENCE_LOSSES: Registry[PreferenceLossSpec] = Registry("preference loss")


def register_preference_loss(name: str, *, needs_reference: bool = True, length_normalised: bool = False,
                             uses_label_smoothing: bool = False):
    """Decorator: make a preference loss available by name, with what it needs."""
    def decorator(fn):
        PREFERENCE_LOSSES[name] = PreferenceLossSpec(fn, needs_reference, length_normalised, uses_label_smoothing)
        return fn
    return decorator


def get_preference_loss(name: str) -> PreferenceLossSpec:
    """A registered preference loss, or a `PreferenceLossSpec` given by import path "package.module:NAME"."""
    spec = PREFERENCE_LOSSES.get(name)
    if not isinstance(spec, PreferenceLossSpec):
        raise ValueError(f"preference loss {name!r} is a {type(spec).__name__}, not a PreferenceLossSpec; register the "
                         "function with @register_preference_loss, or name a PreferenceLossSpec")
    return spec


def _smoothed_sigmoid(scaled: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -(1.0 - label_smoothing) * F.logsigmoid(scaled) - label_smoothing * F.logsigmoid(-scaled)


@register_preference_loss("sigmoid", uses_label_smoothing=True)
def sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.0):
    return _smoothed_sigmoid(beta * logits, label_smoothing)


@register_preference_loss("hinge")
def hinge_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.0):
    return torch.relu(1.0 - beta * logits)


@register_preference_loss("ipo", length_normalised=True)
def ipo_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.0):
    return (logits - 1.0 / (2.0 * beta)) ** 2


@register_preference_loss("simpo", needs_reference=False, length_normalised=True, uses_label_smoothing=True)
def simpo_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5):
    return _smoothed_sigmoid(beta * logits - simpo_gamma, label_smoothing)


def sequence_log_probs(log_probs: torch.Tensor, response_mask: torch.Tensor, length_normalised: bool) -> torch.Tensor:
    """Each row's response log-prob [rows] from token log-probs [rows, response_len]: the sum over its valid tokens,
    or (length_normalised) their mean. A row without a valid token gets 0."""
    mask = response_mask.to(log_probs.dtype)
    total = (log_probs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if length_normalised else total


@dataclass
class PreferenceOutput:
    """Per-pair tensors [pairs] of one preference loss: the losses, the implicit rewards β (policy - ref) of the
    chosen and rejected responses, and the policy's log-probs of each (per-token means where the loss normalises)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def preference_loss(loss_type: str, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                    ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None, beta: float,
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> PreferenceOutput:
    """The loss `loss_type` (PREFERENCE_LOSSES) of pairs given the sequence log-probs [pairs] of their responses
    (`sequence_log_probs`, normalised as the loss's `length_normalised` says) under the policy and the reference.
    A reference-free loss takes None for the reference's (and a given one is an error: it would be ignored)."""
    spec = get_preference_loss(loss_type)
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("give the reference log-probs of both the chosen and the rejected responses, or neither")
    if spec.needs_reference and ref_chosen_logps is None:
        raise ValueError(f"preference loss {loss_type!r} compares with a reference model: pass its log-probs")
    if not spec.needs_reference and ref_chosen_logps is not None:
        raise ValueError(f"preference loss {loss_type!r} is reference-free; it takes no reference log-probs")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    ref_chosen = ref_chosen_logps if ref_chosen_logps is not None else torch.zeros_like(chosen_logps)
    ref_rejected = ref_rejected_logps if ref_rejected_logps is not None else torch.zeros_like(rejected_logps)
    chosen_logratios, rejected_logratios = chosen_logps - ref_chosen, rejected_logps - ref_rejected
    losses = spec.fn(chosen_logratios - rejected_logratios, beta, label_smoothing=label_smoothing,
                     simpo_gamma=simpo_gamma)
    return PreferenceOutput(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach(),
                            chosen_logps.detach(), rejected_logps.detach())


__all__ = ["PREFERENCE_LOSSES", "PreferenceLossSpec", "PreferenceOutput", "get_preference_loss", "hinge_loss",
           "ipo_loss", "preference_loss", "register_preference_loss", "sequence_log_probs", "sigmoid_loss",
           "simpo_loss"]
