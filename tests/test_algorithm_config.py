"""The algorithm's components each take a typed config: a setting reaches the policy loss or rollout correction that
declares it, by verl's flat key or by the `{name: ..., <settings>}` form; a flat key the chosen component does not
take is refused with the fix; a user's loss given by import path declares its own config class."""

from __future__ import annotations

import glob
import os
import sys
import textwrap

import pytest
import torch

from baton.algorithms import (
    AdvantageConfig,
    CapConfig,
    ClipConfig,
    ClipCovConfig,
    DualClipConfig,
    KLCovConfig,
    NoSettings,
)
from baton.config import ConfigError, apply_overrides, from_dict, load_yaml
from baton.data import DataProto
from baton.rl import AlgorithmConfig, RLAlgorithm

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
ALGORITHM_KEYS = set(AlgorithmConfig.__dataclass_fields__)


def algorithm(**section) -> AlgorithmConfig:
    """An `algorithm:` section as the YAML loader builds it."""
    return from_dict(AlgorithmConfig, section, "algorithm")


# ---- the built-in components' settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("section, expected", [
    ({}, DualClipConfig()),
    ({"clip_ratio_high": 0.28}, DualClipConfig(clip_ratio_high=0.28)),  # DAPO's clip-higher, verl's flat key
    ({"policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, ClipConfig(3e-4, 4e-4)),
    ({"policy_loss": "clip_cov", "clip_cov_ratio": 1e-3, "clip_ratio_high": 0.3},
     ClipCovConfig(clip_ratio_high=0.3, clip_cov_ratio=1e-3)),
    ({"policy_loss": {"name": "clip_cov", "clip_cov_ratio": 1e-3, "clip_cov_ub": 4}},
     ClipCovConfig(clip_cov_ratio=1e-3, clip_cov_ub=4.0)),
    ({"policy_loss": "kl_cov", "ppo_kl_coef": 0.1}, KLCovConfig(ppo_kl_coef=0.1)),
    ({"policy_loss": "gpg"}, NoSettings()),
])
def test_a_setting_reaches_the_loss_that_declares_it(section, expected):
    config = algorithm(**section)
    assert config.policy_loss_config() == expected
    assert type(config.policy_loss_config()) is type(expected)
    loss = RLAlgorithm(config).policy_loss
    assert loss.policy_loss == config.policy_loss_name and loss.settings == expected


def test_the_correction_and_the_estimator_take_their_settings():
    config = algorithm(rollout_correction="token_tis", rollout_is_cap=3.0, gamma=0.99, lam=0.95,
                       norm_adv_by_std=False)
    assert config.rollout_correction_config() == CapConfig(3.0)
    assert config.advantage_config() == AdvantageConfig(gamma=0.99, lam=0.95, norm_adv_by_std=False)
    assert RLAlgorithm(config).policy_loss.correction_settings == CapConfig(3.0)
    nested = algorithm(rollout_correction={"name": "decoupled", "rollout_is_cap": None})
    assert nested.rollout_correction_config() == CapConfig(None) and nested.rollout_correction_name == "decoupled"
    assert algorithm(rollout_correction={"name": "none"}).rollout_correction == "none"  # what pipelines compare


@pytest.mark.parametrize("section, message", [
    ({"policy_loss": "gpg", "clip_ratio_high": 0.28},
     ("algorithm.clip_ratio_high=0.28 is set, but algorithm.policy_loss 'gpg' does not take it (it takes no settings); "
      "remove algorithm.clip_ratio_high, or use a policy loss that takes it: cispo, clip_cov, gspo, vanilla")),
    ({"policy_loss": "gspo", "clip_ratio_c": 2.0},
     ("algorithm.clip_ratio_c=2.0 is set, but algorithm.policy_loss 'gspo' does not take it (it takes clip_ratio_low, "
      "clip_ratio_high); remove algorithm.clip_ratio_c, or use a policy loss that takes it: vanilla")),
    ({"kl_cov_ratio": 1e-3},
     "algorithm.kl_cov_ratio=0.001 is set, but algorithm.policy_loss 'vanilla' does not take it"),
    ({"rollout_correction": "seq_mask", "rollout_is_cap": 4.0},
     "or use a rollout correction that takes it: decoupled, seq_tis, token_tis"),
    ({"policy_loss": {"name": "clip_cov", "clip_cov_ration": 1e-3}},
     "unknown key 'algorithm.policy_loss.clip_cov_ration'; did you mean 'algorithm.policy_loss.clip_cov_ratio'?"),
    ({"policy_loss": {"name": "vanilla", "clip_ratio_high": 0.3}, "clip_ratio_high": 0.28},
     "algorithm.clip_ratio_high is set both flat and under algorithm.policy_loss; set it once"),
    ({"policy_loss": {"clip_ratio_high": 0.3}}, "algorithm.policy_loss is a mapping without a string `name`"),
    ({"policy_loss": "vanilla", "clip_ratio_c": 0.5}, "clip_ratio_c must be > 1.0 for dual-clip PPO"),
    ({"policy_loss": "kl_cov", "kl_cov_ratio": 0.0}, "kl_cov_ratio must be > 0"),
    ({"gamma": 1.5}, "gamma=1.5 must lie in [0, 1]"),
])
def test_a_setting_for_another_component_is_refused_with_the_fix(section, message):
    config = algorithm(**section)
    with pytest.raises(ConfigError) as refused:
        config.check(num_samples_per_prompt=4, has_critic=False)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError):
        RLAlgorithm(config)  # a driver that skips the check cannot build the wrong loss either


def test_a_flat_verl_key_given_on_the_command_line_reaches_the_loss():
    data = apply_overrides({"policy_loss": "cispo"}, ["clip_ratio_high=0.4"], AlgorithmConfig)
    assert from_dict(AlgorithmConfig, data).policy_loss_config() == ClipConfig(0.2, 0.4)
    data = apply_overrides({}, ["policy_loss={name: kl_cov, kl_cov_ratio: 0.01}"], AlgorithmConfig)
    assert from_dict(AlgorithmConfig, data).policy_loss_config() == KLCovConfig(kl_cov_ratio=0.01)


def example_algorithm_sections():
    """Every RL `algorithm:` section of the shipped examples (DPO's and distillation's are other configs)."""
    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "algorithm" and isinstance(value, dict) and set(value) <= ALGORITHM_KEYS and (
                        {"adv_estimator", "policy_loss"} & set(value) or not set(value) & {"beta", "loss_type"}):
                    yield value
                yield from walk(value)
    for path in sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml"))):
        for section in walk(load_yaml(path)):
            yield os.path.basename(path), section


def test_every_example_algorithm_section_resolves_to_its_components_configs():
    sections = list(example_algorithm_sections())
    assert len(sections) >= 10  # the walk finds the examples' sections
    for name, section in sections:
        config = algorithm(**section)
        config.check(num_samples_per_prompt=4, has_critic=config.adv_estimator == "gae")
        for key in ("clip_ratio_low", "clip_ratio_high", "rollout_is_cap"):
            if key in section:  # each flat key the example sets is in the component's settings
                settings = (config.rollout_correction_config() if key.startswith("rollout")
                            else config.policy_loss_config())
                assert getattr(settings, key) == section[key], (name, key)


# ---- a user's own loss by import path, with its own config class --------------------------------------------------

USER_MODULE = "user_loss_with_config"
USER_SOURCE = '''
from dataclasses import dataclass

from baton.algorithms import PolicyLossSpec, agg_loss, register_policy_loss


@dataclass(frozen=True)
class ScaledConfig:
    """The user's loss's settings: its scale and a name for its metric."""
    scale: float = 1.0
    tag: str = "scaled"


def scaled_loss(log_probs, old_log_probs, advantages, response_mask, loss_agg_mode, loss_scale_factor, scale, tag,
                token_weights=None):
    loss = agg_loss(-scale * advantages * log_probs, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, {f"{tag}/scale": scale}


SCALED = PolicyLossSpec(scaled_loss, ScaledConfig)


@register_policy_loss("user.registered", ScaledConfig, token_weights=False)
def registered_loss(log_probs, old_log_probs, advantages, response_mask, loss_agg_mode, loss_scale_factor, scale,
                    tag):
    return scaled_loss(log_probs, old_log_probs, advantages, response_mask, loss_agg_mode, loss_scale_factor, scale,
                       tag)
'''


@pytest.fixture
def user_module(tmp_path):
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_SOURCE))
    sys.path.insert(0, str(tmp_path))
    yield USER_MODULE
    sys.path.remove(str(tmp_path))
    sys.modules.pop(USER_MODULE, None)
    from baton.algorithms import POLICY_LOSSES

    POLICY_LOSSES.pop("user.registered")


def one_row_batch() -> tuple[dict, DataProto]:
    log_probs = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    batch = DataProto.from_dict({"response_mask": torch.ones(1, 2), "advantages": torch.ones(1, 2)})
    return {"log_probs": log_probs, "entropy": torch.zeros(1, 2)}, batch


def test_a_user_loss_by_import_path_takes_its_own_config(user_module):
    module = sys.modules.get(user_module) or __import__(user_module)
    config = algorithm(policy_loss={"name": f"{user_module}:SCALED", "scale": 2, "tag": "mine"})
    config.check(num_samples_per_prompt=4, has_critic=False)
    assert config.policy_loss_config() == module.ScaledConfig(scale=2.0, tag="mine")
    loss_fn = RLAlgorithm(config).policy_loss
    outputs, batch = one_row_batch()
    loss, metrics = loss_fn(outputs, batch)
    assert metrics["actor/mine/scale"][0] / metrics["actor/mine/scale"][1] == pytest.approx(2.0)
    assert float(loss.detach()) == pytest.approx(2.0 * 1.5)  # -2 · A · log p summed over the two tokens (sum form)
    # Its config's own defaults stand where it is given no settings; a setting it lacks has the nearest-name hint.
    assert algorithm(policy_loss=f"{user_module}:SCALED").policy_loss_config() == module.ScaledConfig()
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm.policy_loss.scael'; did you mean "
                                          r"'algorithm.policy_loss.scale'\?"):
        algorithm(policy_loss={"name": f"{user_module}:SCALED", "scael": 2}).policy_loss_config()
    with pytest.raises(ConfigError, match="'user_loss_with_config:SCALED' does not take it"):
        algorithm(policy_loss=f"{user_module}:SCALED", clip_ratio_high=0.3).policy_loss_config()


def test_a_registered_user_loss_named_by_path_finds_its_registration(user_module):
    by_path = algorithm(policy_loss={"name": f"{user_module}:registered_loss", "scale": 3})
    by_name = algorithm(policy_loss={"name": "user.registered", "scale": 3})
    assert by_path.policy_loss_config() == by_name.policy_loss_config()
    assert by_path.policy_loss_config().scale == 3.0
    with pytest.raises(ConfigError, match=f"algorithm.policy_loss '{user_module}:registered_loss' takes no "
                                          "token_weights, so algorithm.rollout_correction 'token_tis' cannot weigh it"):
        algorithm(policy_loss=f"{user_module}:registered_loss", rollout_correction="token_tis").check(4, False)

