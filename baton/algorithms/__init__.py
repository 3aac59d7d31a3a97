"""Pure tensor functions of RL post-training: advantage estimators, policy and value losses, KL
estimators, distillation losses, loss aggregation, off-policy rollout corrections and masked statistics. Tensors are [batch, response_len];
`response_mask` is 1 on real response tokens; names and semantics follow verl."""

from baton.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageConfig,
    EstimatorNeeds,
    compute_advantages,
    estimator_needs,
    gae,
    gdpo,
    get_adv_estimator,
    gpg,
    grpo,
    grpo_passk,
    opo,
    register_adv_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from baton.algorithms.aggregation import (
    LOSS_AGG_UNITS,
    LOSS_UNITS,
    agg_loss,
    agg_loss_sum,
    count_loss_units,
    loss_unit,
    num_loss_units,
)
from baton.algorithms.distill import DISTILL_LOSSES, distillation_loss, get_distill_loss, register_distill_loss
from baton.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    apply_kl_penalty,
    get_kl_estimator,
    kl_penalty,
    register_kl_estimator,
)
from baton.algorithms.losses import (
    POLICY_LOSSES,
    ClipConfig,
    ClipCovConfig,
    DualClipConfig,
    KLCovConfig,
    PolicyLossSpec,
    cispo_loss,
    clip_cov_loss,
    compute_policy_loss,
    entropy_loss,
    get_policy_loss,
    gpg_loss,
    gspo_loss,
    kl_cov_loss,
    policy_loss_spec,
    ppo_clip_loss,
    register_policy_loss,
    value_loss,
)
from baton.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    CapConfig,
    MaskConfig,
    RolloutCorrectionSpec,
    compute_rollout_correction,
    get_rollout_correction,
    register_rollout_correction,
    rollout_correction_spec,
)
from baton.algorithms.settings import NoSettings
from baton.algorithms.utils import masked_mean, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS", "DISTILL_LOSSES", "KL_ESTIMATORS", "LOSS_AGG_UNITS", "LOSS_UNITS", "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS", "AdaptiveKLController", "AdvantageConfig", "CapConfig", "ClipConfig", "ClipCovConfig",
    "DualClipConfig", "EstimatorNeeds", "KLCovConfig", "MaskConfig", "NoSettings", "PolicyLossSpec",
    "RolloutCorrectionSpec", "agg_loss", "agg_loss_sum", "apply_kl_penalty", "cispo_loss", "clip_cov_loss",
    "compute_advantages", "compute_policy_loss", "compute_rollout_correction", "count_loss_units",
    "distillation_loss", "entropy_loss", "estimator_needs", "gae", "gdpo", "get_adv_estimator", "get_distill_loss",
    "get_kl_estimator", "get_policy_loss", "get_rollout_correction", "gpg", "gpg_loss", "grpo", "grpo_passk",
    "gspo_loss", "kl_cov_loss", "kl_penalty", "loss_unit", "masked_mean", "masked_var", "masked_whiten",
    "num_loss_units", "opo", "policy_loss_spec", "ppo_clip_loss", "register_adv_estimator", "register_distill_loss",
    "register_kl_estimator", "register_policy_loss", "register_rollout_correction", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "rloo", "rollout_correction_spec", "value_loss",
]
