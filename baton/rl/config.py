"""The RL algorithm's settings, by verl's names (the YAML keys users write under `algorithm:`), and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.config import ConfigError, Registry


@dataclass
class KLControlConfig:
    """The KL-in-reward coefficient: "fixed" at `algorithm.kl_reward_coef`, or "adaptive" (verl's
    AdaptiveKLController: moved each step towards `target_kl` over `horizon` samples)."""

    type: str = "fixed"
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    """verl's algorithm settings, by verl's names. `policy_loss` picks a loss from baton.algorithms.POLICY_LOSSES;
    the settings after it are passed to the losses that take them (`policy_loss_params`)."""

    adv_estimator: str = "grpo"  # a name in baton.algorithms.ADV_ESTIMATORS
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    policy_loss: str = "vanilla"  # PPO clip; gspo, cispo, gpg, clip_cov, kl_cov
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 1.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor (Dr.GRPO); None: the response length
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_estimator: str = "k3"
    use_kl_in_reward: bool = False
    kl_reward_coef: float = 0.001
    kl_reward_estimator: str = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    cliprange_value: float = 0.5
    num_ppo_epochs: int = 1
    num_mini_batches_per_step: int = 1
    # An estimator that takes reward components (GDPO): the reward function's dict fields that are its components,
    # and their weights (None: 1 each). Unset: the reward is the one component.
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None
    # Off-policy correction of the policy loss by the rollout engine's log-probs (a name in
    # baton.algorithms.ROLLOUT_CORRECTIONS): none; token_tis / seq_tis (weights capped at rollout_is_cap);
    # token_mask / seq_mask / geo_mask (weight 0 outside [rollout_mask_low, rollout_mask_high]); decoupled (AReaL:
    # weight proximal/behaviour, tokens above rollout_is_cap dropped). Any but none computes the old log-probs.
    rollout_correction: str = "none"
    rollout_is_cap: float | None = 2.0  # None: uncapped
    rollout_mask_low: float = 0.5
    rollout_mask_high: float = 2.0

    def check(self, num_samples_per_prompt: int, has_critic: bool) -> None:
        """Raise ConfigError for settings that cannot run together (before any worker starts): unknown names, a
        correction the loss cannot take, a group estimator with one sample per prompt, a critic missing or unused."""
        from baton.algorithms import (
            ADV_ESTIMATORS,
            KL_ESTIMATORS,
            LOSS_AGG_UNITS,
            POLICY_LOSSES,
            ROLLOUT_CORRECTIONS,
            estimator_needs,
            policy_loss_params,
        )

        check_choice("algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check_choice("algorithm.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_UNITS)
        check_choice("algorithm.kl_loss_estimator", self.kl_loss_estimator, KL_ESTIMATORS)
        check_choice("algorithm.kl_reward_estimator", self.kl_reward_estimator, KL_ESTIMATORS)
        check_choice("algorithm.policy_loss", self.policy_loss, POLICY_LOSSES)
        check_choice("algorithm.kl_ctrl.type", self.kl_ctrl.type, ("fixed", "adaptive"))
        check_choice("algorithm.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.rollout_is_cap is not None and self.rollout_is_cap < 1.0:
            raise ConfigError(f"algorithm.rollout_is_cap={self.rollout_is_cap} is below 1, so even on-policy tokens "
                              "(weight 1) would be capped or dropped; use 2.0 (verl) to 10.0, or null for no cap")
        if not 0.0 <= self.rollout_mask_low <= 1.0 <= self.rollout_mask_high or (
                self.rollout_mask_low == self.rollout_mask_high):
            raise ConfigError(f"algorithm.rollout_mask_low={self.rollout_mask_low} and rollout_mask_high="
                              f"{self.rollout_mask_high} must satisfy 0 <= low <= 1 <= high, low < high, so that "
                              "on-policy samples (ratio 1) are kept; e.g. 0.5 and 2.0")
        if self.rollout_correction != "none" and "token_weights" not in policy_loss_params(self.policy_loss):
            raise ConfigError(f"algorithm.policy_loss {self.policy_loss!r} takes no token_weights, so "
                              f"algorithm.rollout_correction {self.rollout_correction!r} cannot weigh it; use "
                              "rollout_correction: none, or a loss that takes them")
        if self.loss_scale_factor is not None and self.loss_agg_mode != "seq-mean-token-sum-norm":
            raise ConfigError(f"algorithm.loss_scale_factor applies to loss_agg_mode 'seq-mean-token-sum-norm' only, "
                              f"not {self.loss_agg_mode!r}; unset it or change the mode")
        needs = estimator_needs(self.adv_estimator)
        if needs.groups and num_samples_per_prompt < 2:
            raise ConfigError(f"algorithm.adv_estimator {self.adv_estimator!r} compares each prompt's samples with "
                              f"each other, but sampling.num_samples_per_prompt={num_samples_per_prompt}; use 2 or "
                              "more (e.g. 8)")
        if needs.critic and not has_critic:
            raise ConfigError(f"algorithm.adv_estimator {self.adv_estimator!r} needs a critic: add a `critic:` section "
                              "(strategy.kind: value), or use adv_estimator 'grpo'")
        if not needs.critic and has_critic:
            raise ConfigError(f"a `critic:` section is set but algorithm.adv_estimator {self.adv_estimator!r} uses no "
                              "critic; remove the section, or use adv_estimator 'gae'")
        _check_reward_components(self)


def check_choice(key: str, value: str, valid) -> None:
    """Raise ConfigError unless `value` is in `valid`; from a `Registry`, a registered name or an import path that
    imports (the user's own estimator, loss, ...)."""
    if isinstance(valid, Registry):
        valid.get(value, key=key)
    elif value not in valid:
        raise ConfigError(f"{key} {value!r} is not one of {sorted(valid)}")


def _check_reward_components(algo: AlgorithmConfig) -> None:
    from baton.algorithms import ADV_ESTIMATORS, estimator_params

    keys, weights = algo.gdpo_reward_keys, algo.gdpo_reward_weights
    if weights is not None and keys is None:
        raise ConfigError("algorithm.gdpo_reward_weights weighs the reward components named by "
                          "algorithm.gdpo_reward_keys, which is unset; set it too, or unset the weights")
    if keys is None:
        return
    if not keys:
        raise ConfigError("algorithm.gdpo_reward_keys is empty; list the reward function's fields that are the reward "
                          "components, or unset it")
    if "reward_components" not in estimator_params(algo.adv_estimator):
        takers = sorted(n for n in ADV_ESTIMATORS if "reward_components" in estimator_params(n))
        raise ConfigError(f"algorithm.gdpo_reward_keys is set, but algorithm.adv_estimator {algo.adv_estimator!r} "
                          f"takes no reward components; use an estimator that does ({', '.join(takers)}), or unset "
                          "gdpo_reward_keys")
    if weights is not None and len(weights) != len(keys):
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(weights)} entries for the {len(keys)} "
                          f"gdpo_reward_keys {keys}; give one weight per key")
