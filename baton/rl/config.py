"""The RL algorithm's settings (the YAML keys users write under `algorithm:`, by verl's names), the typed config each
component takes from them, and their checks.

The policy loss and the rollout correction each declare a config class where they register (`ClipConfig`,
`CapConfig`, ...; `baton.algorithms`). A setting reaches the component in one of two spellings, resolved by
`policy_loss_config()` / `rollout_correction_config()`:

    policy_loss: vanilla                                  # verl's flat keys beside the name...
    clip_ratio_high: 0.28
    policy_loss: {name: clip_cov, clip_cov_ratio: 1.0e-3}  # ...or the name with its settings (a user's own loss's)

A flat key goes to the chosen component's config, which must declare it: one set for another component is an error
naming the key and the fix. The estimator's settings are `AdvantageConfig` (`advantage_config()`), the KL
controller's `KLControlConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from baton.config import ConfigError, Registry, from_dict

# verl's flat keys of the policy losses' and the rollout corrections' settings, each a field of AlgorithmConfig below.
POLICY_LOSS_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "clip_cov_ratio", "clip_cov_lb",
                    "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
ROLLOUT_CORRECTION_KEYS = ("rollout_is_cap", "rollout_mask_low", "rollout_mask_high")


@dataclass
class KLControlConfig:
    """The KL-in-reward coefficient: "fixed" at `algorithm.kl_reward_coef`, or "adaptive" (verl's
    AdaptiveKLController: moved each step towards `target_kl` over `horizon` samples)."""

    type: str = "fixed"
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self):
        if self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(f"target_kl={self.target_kl} and horizon={self.horizon} must both be > 0; e.g. 0.1 and "
                             "10000 (verl)")


@dataclass
class AlgorithmConfig:
    """verl's algorithm settings, by verl's names. `policy_loss` picks a loss from baton.algorithms.POLICY_LOSSES and
    `rollout_correction` a correction from ROLLOUT_CORRECTIONS: each a name or import path, or a mapping of `name` and
    that component's settings. The flat settings after each are verl's spelling of those settings: one changed from
    its default goes to the chosen component's config (`policy_loss_config()`), which must take it."""

    adv_estimator: str = "grpo"  # a name in baton.algorithms.ADV_ESTIMATORS
    # The estimator's settings (AdvantageConfig; `advantage_config()`).
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    policy_loss: str | dict[str, Any] = "vanilla"  # vanilla (PPO clip), gspo, cispo, gpg, clip_cov, kl_cov
    # The policy losses' settings (POLICY_LOSS_KEYS): vanilla's DualClipConfig; gspo's and cispo's ClipConfig;
    # clip_cov's ClipCovConfig; kl_cov's KLCovConfig; gpg takes none.
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
    # Each mini-batch's rows reordered so that the data-parallel ranks get about equal real tokens (verl's
    # trainer.balance_batch; baton.data.balance). With one rank nothing changes.
    balance_batch: bool = True
    # An estimator that takes reward components (GDPO): the reward function's dict fields that are its components,
    # and their weights (None: 1 each). Unset: the reward is the one component.
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None
    # Off-policy correction of the policy loss by the rollout engine's log-probs (a name in
    # baton.algorithms.ROLLOUT_CORRECTIONS): none; token_tis / seq_tis (weights capped at rollout_is_cap);
    # token_mask / seq_mask / geo_mask (weight 0 outside [rollout_mask_low, rollout_mask_high]); decoupled (AReaL:
    # weight proximal/behaviour, tokens above rollout_is_cap dropped). Any but none computes the old log-probs.
    rollout_correction: str | dict[str, Any] = "none"
    # The corrections' settings (ROLLOUT_CORRECTION_KEYS): token_tis', seq_tis' and decoupled's CapConfig; the masks'
    # MaskConfig; none takes none.
    rollout_is_cap: float | None = 2.0  # None: uncapped
    rollout_mask_low: float = 0.5
    rollout_mask_high: float = 2.0

    def __post_init__(self):
        # A mapping of the name alone is the name: `rollout_correction == "none"` holds whichever way it was written.
        for key in ("policy_loss", "rollout_correction"):
            value = getattr(self, key)
            if isinstance(value, dict) and set(value) == {"name"} and isinstance(value["name"], str):
                setattr(self, key, value["name"])

    @property
    def policy_loss_name(self) -> str:
        return _split(self.policy_loss, "policy_loss")[0]

    @property
    def rollout_correction_name(self) -> str:
        return _split(self.rollout_correction, "rollout_correction")[0]

    def policy_loss_config(self) -> Any:
        """The chosen policy loss's settings: an instance of the config class it registered."""
        from baton.algorithms import POLICY_LOSSES, policy_loss_spec

        return _component_config(self, "policy_loss", POLICY_LOSS_KEYS, POLICY_LOSSES, policy_loss_spec)

    def rollout_correction_config(self) -> Any:
        """The chosen rollout correction's settings: an instance of the config class it registered."""
        from baton.algorithms import ROLLOUT_CORRECTIONS, rollout_correction_spec

        return _component_config(self, "rollout_correction", ROLLOUT_CORRECTION_KEYS, ROLLOUT_CORRECTIONS,
                                 rollout_correction_spec)

    def advantage_config(self) -> Any:
        """The estimator's settings (`baton.algorithms.AdvantageConfig`)."""
        from baton.algorithms import AdvantageConfig

        names = [f.name for f in dataclasses.fields(AdvantageConfig)]
        return from_dict(AdvantageConfig, {name: getattr(self, name) for name in names}, "algorithm")

    def check(self, num_samples_per_prompt: int, has_critic: bool) -> None:
        """Raise ConfigError for settings that cannot run together (before any worker starts): unknown names, a
        setting the chosen component does not take, a correction the loss cannot take, a group estimator with one
        sample per prompt, a critic missing or unused."""
        from baton.algorithms import (
            ADV_ESTIMATORS,
            KL_ESTIMATORS,
            LOSS_AGG_UNITS,
            POLICY_LOSSES,
            ROLLOUT_CORRECTIONS,
            estimator_needs,
            policy_loss_spec,
        )

        check_choice("algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check_choice("algorithm.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_UNITS)
        check_choice("algorithm.kl_loss_estimator", self.kl_loss_estimator, KL_ESTIMATORS)
        check_choice("algorithm.kl_reward_estimator", self.kl_reward_estimator, KL_ESTIMATORS)
        check_choice("algorithm.policy_loss", self.policy_loss_name, POLICY_LOSSES)
        check_choice("algorithm.kl_ctrl.type", self.kl_ctrl.type, ("fixed", "adaptive"))
        check_choice("algorithm.rollout_correction", self.rollout_correction_name, ROLLOUT_CORRECTIONS)
        self.policy_loss_config()
        self.rollout_correction_config()
        if self.rollout_correction_name != "none" and not policy_loss_spec(self.policy_loss_name).token_weights:
            raise ConfigError(f"algorithm.policy_loss {self.policy_loss_name!r} takes no token_weights, so "
                              f"algorithm.rollout_correction {self.rollout_correction_name!r} cannot weigh it; use "
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
        advantage = self.advantage_config()
        if advantage.gdpo_reward_keys is not None and not needs.reward_components:
            takers = sorted(n for n in ADV_ESTIMATORS if estimator_needs(n).reward_components)
            raise ConfigError(f"algorithm.gdpo_reward_keys is set, but algorithm.adv_estimator {self.adv_estimator!r} "
                              f"takes no reward components; use an estimator that does ({', '.join(takers)}), or "
                              "unset gdpo_reward_keys")


def check_choice(key: str, value: str, valid) -> None:
    """Raise ConfigError unless `value` is in `valid`; from a `Registry`, a registered name or an import path that
    imports (the user's own estimator, loss, ...)."""
    if isinstance(valid, Registry):
        valid.get(value, key=key)
    elif value not in valid:
        raise ConfigError(f"{key} {value!r} is not one of {sorted(valid)}")


def _split(choice: str | dict, key: str) -> tuple[str, dict]:
    """A component's choice as (its name or import path, the settings given with it)."""
    if isinstance(choice, str):
        return choice, {}
    settings = dict(choice)
    name = settings.pop("name", None)
    if not isinstance(name, str):
        raise ConfigError(f"algorithm.{key} is a mapping without a string `name` (got {sorted(choice)}); write the "
                          f"name alone, or e.g. {{name: vanilla, clip_ratio_high: 0.28}}")
    return name, settings


def _component_config(algo: AlgorithmConfig, key: str, flat_keys: tuple[str, ...], registry: Registry, spec_of
                      ) -> Any:
    """The config of the component `algo.<key>` names: its class's defaults, then the flat keys of `flat_keys`
    changed from their defaults, then the settings given in the mapping form. A changed flat key that the class does
    not declare, or one given both ways, is a ConfigError that says how to fix it."""
    from baton.algorithms.settings import setting_names

    name, given = _split(getattr(algo, key), key)
    registry.get(name, key=f"algorithm.{key}")  # the message with the key and the nearest name, for a typo
    config = spec_of(name).config
    taken = setting_names(config)
    defaults = _flat_defaults()
    changed = {k: getattr(algo, k) for k in flat_keys if getattr(algo, k) != defaults[k]}
    for k, value in changed.items():
        if k not in taken:
            takers = [n for n in registry if k in setting_names(spec_of(n).config)]
            its = f"it takes {', '.join(taken)}" if taken else "it takes no settings"
            raise ConfigError(f"algorithm.{k}={value!r} is set, but algorithm.{key} {name!r} does not take it ({its}); "
                              f"remove algorithm.{k}, or use a {registry.kind} that takes it: {', '.join(takers)}")
    twice = sorted(set(changed) & set(given))
    if twice:
        raise ConfigError(f"algorithm.{twice[0]} is set both flat and under algorithm.{key}; set it once")
    return from_dict(config, {**changed, **given}, f"algorithm.{key}" if given else "algorithm")


def _flat_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(AlgorithmConfig) if f.default is not dataclasses.MISSING}
