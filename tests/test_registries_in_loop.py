"""The algorithm registries reach the RLVR loop: an estimator's declared needs, a policy loss by name, the KL
controller; a new estimator takes part without any change to pipeline code."""

from __future__ import annotations

import pytest

from baton.algorithms import ADV_ESTIMATORS, EstimatorNeeds, gae, grpo, register_adv_estimator
from baton.config import ConfigError
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import AlgorithmConfig, KLControlConfig, RoleConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.strategy import OptimizerConfig, StrategyConfig
from test_pipeline_paths import metrics_of, tiny_rlvr


@pytest.fixture
def registered():
    """Register estimators for one test and remove them after it."""
    names = []

    def register(name: str, fn, needs: EstimatorNeeds):
        register_adv_estimator(name, needs)(fn)
        names.append(name)

    yield register
    for name in names:
        ADV_ESTIMATORS.pop(name)


def test_a_new_estimator_that_needs_a_critic_gets_one(tmp_path, registered):
    calls = []

    def my_gae(token_level_rewards, values, response_mask, gamma=1.0, lam=1.0):
        calls.append(tuple(values.shape))
        return gae(token_level_rewards, values, response_mask, gamma, lam)

    registered("my_gae", my_gae, EstimatorNeeds(critic=True))
    with pytest.raises(ConfigError, match="'my_gae' needs a critic"):
        RLVRPipeline.dry_run(tiny_rlvr(tmp_path, algorithm=AlgorithmConfig(adv_estimator="my_gae")))
    critic = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", kind="value", optimizer=OptimizerConfig(lr=1e-3)))
    run_pipeline(RLVRPipeline, tiny_rlvr(tmp_path, num_steps=1, critic=critic,
                                         algorithm=AlgorithmConfig(adv_estimator="my_gae")))
    assert calls == [(16, 3)]  # called once, on the critic's values: 4 prompts × 4 samples, 3 response tokens
    assert metrics_of(tmp_path)[0]["critic/vf_loss"] > 0  # a critic was built, valued and trained


def test_a_new_estimator_that_needs_groups_is_checked_and_watched(tmp_path, registered):
    calls = []

    def my_grpo(token_level_rewards, response_mask, index):
        calls.append(len(set(index.tolist())))
        return grpo(token_level_rewards, response_mask, index)

    registered("my_grpo", my_grpo, EstimatorNeeds(groups=True))
    config = tiny_rlvr(tmp_path, num_steps=1, algorithm=AlgorithmConfig(adv_estimator="my_grpo"))
    config.sampling.num_samples_per_prompt = 1
    with pytest.raises(ConfigError, match="'my_grpo' compares each prompt's samples"):
        RLVRPipeline.dry_run(config)
    config.sampling.num_samples_per_prompt = 4
    run_pipeline(RLVRPipeline, config)
    assert calls == [4]  # called once, with the step's 4 groups
    assert "critic/frac_reward_zero_std" in metrics_of(tmp_path)[0]  # the group estimators' signal watch runs


def test_an_estimator_without_a_critic_refuses_a_critic_section(tmp_path):
    critic = RoleConfig(strategy=StrategyConfig(kind="value"))
    with pytest.raises(ConfigError, match="a `critic:` section is set but algorithm.adv_estimator 'grpo' uses no critic"):
        RLVRPipeline.dry_run(tiny_rlvr(tmp_path, critic=critic))


def test_the_policy_loss_is_chosen_by_name(tmp_path):
    losses = {}
    for name in ("vanilla", "gpg"):
        run_pipeline(RLVRPipeline, tiny_rlvr(tmp_path / name, num_steps=1, algorithm=AlgorithmConfig(policy_loss=name)))
        losses[name] = metrics_of(tmp_path / name)[0]["actor/pg_loss"]
    # On-policy the ratio is 1: PPO's loss is -mean(A), GPG's -mean(A log p); the same samples, other values.
    assert losses["vanilla"] != pytest.approx(losses["gpg"], abs=1e-4)
    with pytest.raises(ConfigError, match=r"algorithm.clip_ratio_high=0.28 is set, but algorithm.policy_loss 'gpg' "
                                          r"does not take it \(it takes no settings\); remove "
                                          r"algorithm.clip_ratio_high, or use a policy loss that takes it: cispo, "
                                          r"clip_cov, gspo, vanilla"):
        RLVRPipeline.dry_run(tiny_rlvr(tmp_path / "refused", num_steps=1,
                                       algorithm=AlgorithmConfig(policy_loss="gpg", clip_ratio_high=0.28)))


def test_the_adaptive_kl_coefficient_moves_and_resumes_exactly(tmp_path):
    def config(run_dir, num_steps, resume=None):
        # k3 is never negative (k1's batch mean can be, and would lower the coefficient whatever the policy did).
        algorithm = AlgorithmConfig(use_kl_in_reward=True, kl_reward_coef=0.1, kl_reward_estimator="k3",
                                    kl_ctrl=KLControlConfig(type="adaptive", target_kl=1e-6, horizon=100))
        return tiny_rlvr(run_dir, num_steps=num_steps, algorithm=algorithm, trainer=dict(resume=resume))

    run_pipeline(RLVRPipeline, config(tmp_path / "whole", 4))
    coefficients = [r["actor/reward_kl_penalty_coeff"] for r in metrics_of(tmp_path / "whole")]
    assert coefficients[0] == pytest.approx(0.1) and coefficients[-1] > coefficients[0]  # KL above target: raised
    run_pipeline(RLVRPipeline, config(tmp_path / "split", 2))
    run_pipeline(RLVRPipeline, config(tmp_path / "split", 4, resume="latest"))
    assert [r["actor/reward_kl_penalty_coeff"] for r in metrics_of(tmp_path / "split")] == coefficients
