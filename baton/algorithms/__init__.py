"""Pure tensor functions of RL post-training: advantage estimators, policy and value losses, KL
estimators, loss aggregation and masked statistics. Tensors are [batch, response_len];
`response_mask` is 1 on real response tokens; names and semantics follow verl."""

from baton.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    gae,
    get_adv_estimator,
    grpo,
    register_adv_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from baton.algorithms.aggregation import LOSS_AGG_UNITS, agg_loss, agg_loss_sum, loss_unit, num_loss_units
from baton.algorithms.kl import KL_ESTIMATORS, apply_kl_penalty, get_kl_estimator, kl_penalty, register_kl_estimator
from baton.algorithms.losses import (
    POLICY_LOSSES,
    entropy_loss,
    get_policy_loss,
    ppo_clip_loss,
    register_policy_loss,
    value_loss,
)
from baton.algorithms.utils import masked_mean, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGG_UNITS", "POLICY_LOSSES", "agg_loss", "agg_loss_sum",
    "apply_kl_penalty", "compute_advantages", "entropy_loss", "gae", "get_adv_estimator", "get_kl_estimator",
    "get_policy_loss", "grpo", "kl_penalty", "loss_unit", "masked_mean", "masked_var", "masked_whiten",
    "num_loss_units", "ppo_clip_loss", "register_adv_estimator", "register_kl_estimator", "register_policy_loss",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "value_loss",
]
