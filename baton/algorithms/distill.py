"""Token-level distillation losses on the teacher's top-k: forward KL, reverse KL and generalised JSD (TRL's GKD).

The teacher sends, for each response token, its k most likely next tokens: their log-probs and ids, each
[rows, response_len, k]. The student's log-softmax over the full vocabulary is gathered at those ids. Both
distributions are then read on the same k + 1 outcomes: the k tokens, and one tail bucket holding the rest of the
vocabulary (1 - the k tokens' mass, for teacher and student alike). Nothing is renormalised: the student is
charged for mass it puts outside the teacher's top-k, and each divergence on the k + 1 outcomes is a lower bound
of the full-vocabulary one (merging outcomes never raises a divergence), equal to it when k is the vocabulary
(the tail is empty on both sides).

With T the teacher's distribution, S the student's and M = β T + (1 - β) S, per token:

    forward_kl   KL(T ‖ S) = Σ T (log T - log S)         mass-covering: the student spreads over the teacher's support
    reverse_kl   KL(S ‖ T) = Σ S (log S - log T)         mode-seeking: the student settles on the teacher's modes
    jsd          β KL(T ‖ M) + (1 - β) KL(S ‖ M)         TRL's `generalized_jsd_loss` convention: β = 0 is defined as
                                                         forward_kl and β = 1 as reverse_kl (the mixture itself makes
                                                         the JSD vanish there; JSD_β / β → forward KL as β → 0 and
                                                         JSD_β / (1 - β) → reverse KL as β → 1)

The per-token values are aggregated over the response tokens (`response_mask`) with `baton.algorithms.aggregation`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from baton.algorithms.aggregation import agg_loss
from baton.config.registry import Registry

# The mass an empty tail (k = vocab) is given: 0 to float32 sums, but its log (-87) stays finite, so its
# 0 · log 0 terms are 0 and no gradient is infinite or NaN.
_EMPTY = 1e-38

DISTILL_LOSSES: Registry[Callable[..., torch.Tensor]] = Registry("distillation loss")


def register_distill_loss(name: str):
    """Decorator: make a distillation loss available by name."""
    return DISTILL_LOSSES.register(name)


def get_distill_loss(name: str) -> Callable[..., torch.Tensor]:
    """A registered distillation loss, or one given by import path "package.module:function"."""
    return DISTILL_LOSSES.get(name)


def check_beta(beta: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta={beta} is outside [0, 1]: beta is the teacher's weight in the mixture "
                         "M = beta·teacher + (1 - beta)·student (0: forward KL, 1: reverse KL, 0.5: the symmetric JSD)")


def with_tail(top_k_log_probs: torch.Tensor) -> torch.Tensor:
    """[..., k] log-probs of k distinct tokens → [..., k + 1]: the k, then the log of the rest's mass (1 - theirs)."""
    covered = torch.logsumexp(top_k_log_probs, dim=-1, keepdim=True)  # log of the k tokens' mass, <= 0
    rest = -torch.expm1(covered.clamp(max=0.0))  # 1 - mass, >= 0; 0 (to rounding) when the k are the vocabulary
    return torch.cat([top_k_log_probs, torch.log(rest.clamp(min=_EMPTY))], dim=-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last dim, from log-probs."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@register_distill_loss("forward_kl")
def forward_kl(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """KL(teacher ‖ student) per token; `student`, `teacher`: log-probs over the same outcomes [..., n]."""
    return _kl(teacher, student)


@register_distill_loss("reverse_kl")
def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """KL(student ‖ teacher) per token."""
    return _kl(student, teacher)


@register_distill_loss("jsd")
def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """β KL(T ‖ M) + (1 - β) KL(S ‖ M), M = β T + (1 - β) S; β = 0 is forward KL and β = 1 reverse KL (as TRL)."""
    check_beta(beta)
    if beta == 0.0:
        return forward_kl(student, teacher)
    if beta == 1.0:
        return reverse_kl(student, teacher)
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


def check_top_k(teacher_log_probs: torch.Tensor, teacher_ids: torch.Tensor, vocab_size: int | None = None) -> None:
    """The teacher's top-k log-probs and ids: the same shape [rows, response_len, k], k >= 1, and (with
    `vocab_size`) k <= vocab_size and every id a token of the vocabulary."""
    if teacher_log_probs.shape != teacher_ids.shape:
        raise ValueError(f"the teacher's top-k log-probs {tuple(teacher_log_probs.shape)} and token ids "
                         f"{tuple(teacher_ids.shape)} differ in shape; both are [rows, response_len, k], from the same "
                         "teacher call (compute_top_k_log_probs)")
    if teacher_log_probs.dim() != 3 or teacher_log_probs.shape[-1] < 1:
        raise ValueError(f"the teacher's top-k log-probs have shape {tuple(teacher_log_probs.shape)}; they must be "
                         "[rows, response_len, k] with k >= 1")
    k = teacher_log_probs.shape[-1]
    if vocab_size is not None:
        if k > vocab_size:
            raise ValueError(f"top-k k={k} is larger than the vocabulary ({vocab_size} tokens); use k <= {vocab_size} "
                             "(k = vocabulary is the full-vocabulary loss)")
        if teacher_ids.numel() and (int(teacher_ids.min()) < 0 or int(teacher_ids.max()) >= vocab_size):
            raise ValueError(f"the teacher's top-k token ids span [{int(teacher_ids.min())}, {int(teacher_ids.max())}], "
                             f"outside the student's vocabulary of {vocab_size}; teacher and student must share a "
                             "tokenizer")


def token_distill_loss(loss_type: str, student_top_k: torch.Tensor, teacher_top_k: torch.Tensor,
                       beta: float = 0.5) -> torch.Tensor:
    """The divergence `loss_type` (DISTILL_LOSSES) per token [rows, response_len] between the student's and the
    teacher's log-probs at the teacher's top-k ids (each [rows, response_len, k]), each with its tail bucket."""
    fn = get_distill_loss(loss_type)
    if student_top_k.shape != teacher_top_k.shape:
        raise ValueError(f"the student's log-probs at the teacher's top-k {tuple(student_top_k.shape)} and the "
                         f"teacher's {tuple(teacher_top_k.shape)} differ in shape; gather the student's log-softmax at "
                         "the teacher's top-k ids")
    check_beta(beta)
    return fn(with_tail(student_top_k.float()), with_tail(teacher_top_k.float()), beta=beta)


def gather_student_log_probs(student_log_probs: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """The student's full log-softmax [rows, response_len, vocab] at the teacher's top-k ids → [rows, response_len, k]."""
    if student_log_probs.shape[:-1] != teacher_ids.shape[:-1]:
        raise ValueError(f"the student's log-probs {tuple(student_log_probs.shape)} and the teacher's top-k ids "
                         f"{tuple(teacher_ids.shape)} cover different [rows, response_len]; score the same responses")
    return student_log_probs.gather(-1, teacher_ids)


def distillation_loss(loss_type: str, student_log_probs: torch.Tensor, teacher_top_k_log_probs: torch.Tensor,
                      teacher_top_k_ids: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                      beta: float = 0.5) -> torch.Tensor:
    """The scalar distillation loss of a batch: the student's full log-softmax [rows, response_len, vocab] against
    the teacher's top-k log-probs and ids [rows, response_len, k], per token (`token_distill_loss`), aggregated over
    the response tokens with `loss_agg_mode`. At k = vocab it is the full-vocabulary divergence."""
    check_top_k(teacher_top_k_log_probs, teacher_top_k_ids, student_log_probs.shape[-1])
    student = gather_student_log_probs(student_log_probs, teacher_top_k_ids)
    per_token = token_distill_loss(loss_type, student, teacher_top_k_log_probs, beta)
    return agg_loss(per_token, response_mask, loss_agg_mode)


__all__ = ["DISTILL_LOSSES", "check_beta", "check_top_k", "distillation_loss", "forward_kl", "gather_student_log_probs",
           "generalized_jsd", "get_distill_loss", "register_distill_loss", "reverse_kl", "token_distill_loss",
           "with_tail"]
