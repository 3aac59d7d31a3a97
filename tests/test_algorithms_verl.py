"""The verl-named algorithm options against hand-computed values: aggregation modes, KL "+"
estimators, the adaptive KL controller, estimator needs and the extra estimators and policy losses."""

from __future__ import annotations

import math

import pytest
import torch

from baton.algorithms import (
    ADV_ESTIMATORS,
    LOSS_AGG_UNITS,
    POLICY_LOSSES,
    AdaptiveKLController,
    ClipConfig,
    ClipCovConfig,
    DualClipConfig,
    EstimatorNeeds,
    KLCovConfig,
    agg_loss,
    agg_loss_sum,
    cispo_loss,
    clip_cov_loss,
    compute_advantages,
    compute_policy_loss,
    count_loss_units,
    estimator_needs,
    gdpo,
    get_policy_loss,
    gpg,
    grpo,
    gpg_loss,
    grpo_passk,
    gspo_loss,
    kl_cov_loss,
    kl_penalty,
    loss_unit,
    masked_whiten,
    num_loss_units,
    opo,
    policy_loss_spec,
    ppo_clip_loss,
    remax,
)

T = torch.tensor


def close(actual, expected, atol=1e-4):
    actual, expected = torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def garbage_under(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    junk = torch.tensor([float("nan"), float("inf"), -1e6] * x.numel())[: x.numel()].reshape(x.shape)
    return torch.where(mask.bool(), x, junk)


def split_step(loss_sums: list[torch.Tensor], masks: list[torch.Tensor], mode: str) -> torch.Tensor:
    """What a strategy does with micro-batch sums: divide by the global unit count (1 for "none")."""
    unit = loss_unit(mode)
    units = sum(count_loss_units(m, unit) for m in masks)
    return sum(loss_sums) / (1.0 if unit == "none" else max(float(units), 1.0))


# ---- aggregation ------------------------------------------------------------------------------------

LOSS_MAT = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row is fully masked: no sequence


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (6 + 4) / 4),
    ("token-sum", 6 + 4),
    ("seq-mean-token-sum", (6 + 4) / 2),
    ("seq-mean-token-mean", (2 + 4) / 2),
    ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),  # divided by response_len 3, then by 2 sequences
])
def test_agg_modes_leave_a_fully_masked_row_out(mode, expected):
    close(agg_loss(LOSS_MAT, MASK, mode), expected)
    close(agg_loss(garbage_under(LOSS_MAT, MASK), MASK, mode), expected)
    loss_sum, _ = agg_loss_sum(LOSS_MAT, MASK, mode)
    close(loss_sum / num_loss_units(MASK, mode), expected)
    # micro-batches {row 0} and {rows 1, 2} give the full batch's value
    sums = [agg_loss_sum(LOSS_MAT[:1], MASK[:1], mode)[0], agg_loss_sum(LOSS_MAT[1:], MASK[1:], mode)[0]]
    close(split_step(sums, [MASK[:1], MASK[1:]], mode), expected)


def test_sequence_units_count_only_rows_with_a_valid_token():
    close(count_loss_units(MASK, "sequence"), 2.0)
    close(count_loss_units(MASK, "token"), 4.0)
    close(count_loss_units(MASK, "none"), 0.0)
    close(num_loss_units(MASK, "token-sum"), 1.0)
    assert {loss_unit(m) for m in LOSS_AGG_UNITS} == {"token", "sequence", "none"}
    empty = torch.zeros(2, 3)
    close(agg_loss(LOSS_MAT[:2], empty, "seq-mean-token-mean"), 0.0)
    with pytest.raises(ValueError, match="unknown loss unit"):
        count_loss_units(MASK, "row")


def test_seq_mean_token_sum_norm_loss_scale_factor():
    close(agg_loss(LOSS_MAT, MASK, "seq-mean-token-sum-norm", loss_scale_factor=4), (6 / 4 + 4 / 4) / 2)
    # a constant factor keeps micro-batches padded to different lengths consistent
    sums = [agg_loss_sum(LOSS_MAT[:1], MASK[:1], "seq-mean-token-sum-norm", 4)[0],
            agg_loss_sum(LOSS_MAT[1:2, :1], MASK[1:2, :1], "seq-mean-token-sum-norm", 4)[0]]
    close(split_step(sums, [MASK[:1], MASK[1:2, :1]], "seq-mean-token-sum-norm"), 1.25)
    with pytest.raises(ValueError, match="only to loss_agg_mode 'seq-mean-token-sum-norm'"):
        agg_loss(LOSS_MAT, MASK, "token-mean", loss_scale_factor=4)
    with pytest.raises(ValueError, match="must be > 0"):
        agg_loss(LOSS_MAT, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0)


# ---- KL "+" estimators and the adaptive controller -----------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("k1+", lambda d: d),
    ("abs+", lambda d: d.abs()),
    ("k2+", lambda d: d.square() / 2),
    ("k3+", lambda d: (-d).exp() + d - 1),
])
def test_plus_estimators_have_their_value_and_k2_gradient(name, value):
    log_probs = T([0.5, -0.3, 0.0], requires_grad=True)
    ref = T([0.0, 0.2, 0.0], requires_grad=True)
    d = T([0.5, -0.5, 0.0])
    kl = kl_penalty(log_probs, ref, name)
    close(kl, value(d))
    kl.sum().backward()
    close(log_probs.grad, d)  # d(d²/2)/d log_probs
    close(ref.grad, -d)


def test_adaptive_kl_controller_moves_towards_the_target_with_a_clipped_error():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    close(ctrl.update(current_kl=9.0, num_steps=1000), 0.1 * (1 + 0.2 * 0.1))  # error 0.5 clipped to 0.2
    close(ctrl.update(current_kl=6.0, num_steps=1000), 0.102)  # on target: unchanged
    close(ctrl.update(current_kl=5.4, num_steps=1000), 0.102 * (1 - 0.1 * 0.1))  # error -0.1
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKLController(0.1, target_kl=6.0, horizon=0)


# ---- estimator needs ----------------------------------------------------------------------------------

def test_estimator_needs():
    assert estimator_needs("gae") == EstimatorNeeds(critic=True)
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg"):
        assert estimator_needs(name) == EstimatorNeeds(groups=True)
    assert estimator_needs("gdpo") == EstimatorNeeds(groups=True, reward_components=True)
    assert estimator_needs("remax") == EstimatorNeeds(baseline_rollout=True)
    assert estimator_needs("reinforce_plus_plus") == EstimatorNeeds()
    assert all(isinstance(estimator_needs(n), EstimatorNeeds) for n in ADV_ESTIMATORS)
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        estimator_needs("nope")


# ---- advantage estimators ------------------------------------------------------------------------------

def outcome(scores: list[float], mask: torch.Tensor) -> torch.Tensor:
    """Rewards with each row's score on its last valid token."""
    rewards = torch.zeros(mask.shape)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(len(scores)), last.clamp(min=0)] = T(scores)
    return rewards * mask


def test_grpo_passk_only_the_best_gets_best_minus_second():
    mask = torch.ones(5, 2)
    rewards = outcome([1.0, 0.0, 0.5, 0.2, 0.2], mask)
    index = ["u", "u", "u", "v", "v"]  # v has a constant score
    adv, returns = grpo_passk(rewards, mask, index)
    close(adv[:, 0], [0.5 / (0.5 + 1e-6), 0, 0, 0, 0])  # std of {1, 0, 0.5} is 0.5
    assert torch.equal(adv, returns) and torch.equal(adv[:, 0], adv[:, 1])
    adv, _ = grpo_passk(rewards, mask, index, norm_adv_by_std=False)
    close(adv[:, 0], [0.5, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        grpo_passk(rewards, mask, ["u", "u", "u", "v", "w"])


def test_gdpo_normalises_each_component_in_its_group_then_whitens_the_weighted_sum():
    mask = torch.ones(4, 2)
    components = T([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])  # [batch, 2]; u varies in c1, v in c2
    index = ["u", "u", "v", "v"]
    adv, returns = gdpo(torch.zeros(4, 2), mask, index, reward_components=components, reward_weights=[1.0, 0.5])
    z = 1 / math.sqrt(2)  # a two-sample group's (score - mean) / std
    weighted = T([z, -z, -0.5 * z, 0.5 * z])
    close(adv[:, 0], weighted / weighted.repeat(2).std())  # whitened over the 8 valid tokens (mean is 0)
    assert torch.equal(adv, returns) and torch.equal(adv[:, 0], adv[:, 1])
    # one component: GRPO, then whitened
    rewards = outcome([1.0, 0.0, 0.3, 0.3], mask)
    close(gdpo(rewards, mask, index)[0], masked_whiten(grpo(rewards, mask, index)[0], mask))
    with pytest.raises(ValueError, match="2 entries for 3 reward components"):
        gdpo(rewards, mask, index, reward_components=torch.zeros(4, 3), reward_weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="one score per row and reward component"):
        gdpo(rewards, mask, index, reward_components=torch.zeros(4))


def test_opo_baseline_is_the_length_weighted_group_mean():
    mask = T([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    rewards = outcome([1.0, 0.0, 0.4, 0.3, 0.3], mask)
    adv, returns = opo(rewards, mask, ["u", "u", "v", "w", "w"])
    # u: baseline (3·1 + 1·0) / 4 = 0.75; v alone: baseline 0; w constant: 0
    expected = T([0.25, -0.75, 0.4, 0.0, 0.0]).unsqueeze(-1) * mask
    close(adv, expected)
    assert torch.equal(adv, returns)


def test_gpg_scales_by_batch_over_nonzero_scores():
    mask = torch.ones(5, 1)
    rewards = outcome([1.0, 0.0, 1.0, 1.0, 0.0], mask)
    index = ["u", "u", "v", "v", "w"]  # v constant, w alone
    alpha = 5 / 3
    adv, _ = gpg(rewards, mask, index)
    close(adv[:, 0], [0.5 * alpha, -0.5 * alpha, 0, 0, 0])
    adv, _ = gpg(rewards, mask, index, f_norm=2.0)
    close(adv[:, 0], [0.25 * alpha, -0.25 * alpha, 0, 0, 0])
    adv, _ = gpg(torch.zeros(2, 1), torch.ones(2, 1), ["u", "u"])  # no reward anywhere: alpha = 2, adv 0
    close(adv, torch.zeros(2, 1))


def test_remax_subtracts_the_greedy_reward_from_the_reward_to_go():
    mask = T([[1, 1, 1], [1, 1, 0]])
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    adv, returns = remax(garbage_under(rewards, mask), mask, reward_baselines=T([0.5, 1.0]))
    close(returns, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    close(adv, [[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="one greedy-rollout reward per row"):
        remax(rewards, mask, reward_baselines=T([[0.5], [1.0]]))
    with pytest.raises(ValueError, match=r"'remax' needs \['reward_baselines'\]"):
        compute_advantages("remax", token_level_rewards=rewards, response_mask=mask)


# ---- policy losses --------------------------------------------------------------------------------------

def test_policy_loss_registry_has_verl_names():
    assert {"vanilla", "gspo", "cispo", "gpg", "clip_cov", "kl_cov"} <= set(POLICY_LOSSES)
    assert get_policy_loss("vanilla") is ppo_clip_loss


def test_compute_policy_loss_calls_a_loss_with_its_config_fields():
    log_probs, old, adv, mask = T([[0.1, -0.5]]), torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2)
    assert policy_loss_spec("vanilla").config is DualClipConfig and policy_loss_spec("gspo").config is ClipConfig
    assert policy_loss_spec("clip_cov").config is ClipCovConfig and policy_loss_spec("kl_cov").config is KLCovConfig
    close(compute_policy_loss("cispo", log_probs, old, adv, mask, settings=ClipConfig(0.1, 0.3))[0],
          cispo_loss(log_probs, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.3)[0])
    close(compute_policy_loss("vanilla", log_probs, old, adv, mask)[0], ppo_clip_loss(log_probs, old, adv, mask)[0])
    with pytest.raises(TypeError, match="'gspo' takes settings of type ClipConfig, not DualClipConfig"):
        compute_policy_loss("gspo", log_probs, old, adv, mask, settings=DualClipConfig())
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        compute_policy_loss("ppo", log_probs, old, adv, mask)


def test_gspo_uses_the_sequence_ratio_for_every_token():
    log_probs = T([[0.1, 0.3]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    s = math.exp(0.2)  # exp(mean log ratio)
    loss, metrics = gspo_loss(log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=1.0)
    close(loss, -s)
    loss.backward()
    close(log_probs.grad, [[-s / 2, -s / 2]])  # same for both tokens, unlike per-token PPO
    assert metrics["pg_clipfrac"] == 0.0
    log_probs.grad = None
    loss, metrics = gspo_loss(log_probs, old, adv, mask)  # paper clip: s > 1 + 4e-4 binds
    close(loss, -(1 + 4e-4))
    loss.backward()
    close(log_probs.grad, [[0.0, 0.0]])
    assert metrics["pg_clipfrac"] == 1.0


def test_cispo_keeps_a_gradient_through_log_prob_with_a_clipped_weight():
    log_probs = T([[0.1, -0.5]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2)
    w0, w1 = math.exp(0.1), 0.8  # exp(-0.5) = 0.61 is clipped to 0.8
    loss, metrics = cispo_loss(log_probs, old, adv, mask)
    close(loss, (-w0 * 0.1 - w1 * 0.5) / 2)
    loss.backward()
    close(log_probs.grad, [[-w0 / 2, w1 / 2]])
    close(metrics["pg_clipfrac"], 0.5)


def test_gpg_loss_is_the_plain_policy_gradient():
    log_probs = T([[0.1, -0.5]], requires_grad=True)
    loss, metrics = gpg_loss(log_probs, torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2))
    close(loss, (-0.1 - 0.5) / 2)
    loss.backward()
    close(log_probs.grad, [[-0.5, 0.5]])
    assert metrics == {}


def cov_case(log_probs: list[float]):
    lp = T([log_probs], requires_grad=True)
    return lp, T([log_probs]), T([[3.0, -3.0, 1.0, -1.0]]), torch.ones(1, 4)


def test_clip_cov_detaches_tokens_with_covariance_in_bounds():
    # mean A = 0, mean log π = -1: covariance [1.5, 1.5, 0, 0]; only tokens 0 and 1 are in (1, 5)
    log_probs, old, adv, mask = cov_case([-0.5, -1.5, -1.0, -1.0])
    loss, metrics = clip_cov_loss(log_probs, old, adv, mask, clip_cov_ratio=0.5)  # 2 tokens
    close(loss, 0.0)
    loss.backward()
    close(log_probs.grad, [[0.0, 0.0, -0.25, 0.25]])
    close(metrics["pg_clipfrac"], 0.5)
    log_probs.grad = None
    loss, metrics = clip_cov_loss(log_probs, old, adv, mask, clip_cov_ratio=0.25,
                                  generator=torch.Generator().manual_seed(0))  # 1 token, drawn from {0, 1}
    loss.backward()
    close(metrics["pg_clipfrac"], 0.25)
    kept_grads = [round(g, 4) for g in log_probs.grad[0, :2].tolist()]
    assert kept_grads in ([0.0, 0.75], [-0.75, 0.0])  # exactly one of tokens 0, 1 lost its gradient


def test_kl_cov_penalises_the_largest_covariance_tokens():
    # mean log π = -1: covariance [1.5, 1.8, 0, -0.1]; token 1 is the top one
    log_probs, _, adv, mask = cov_case([-0.5, -1.6, -1.0, -0.9])
    old = log_probs.detach() - 0.1
    r = math.exp(0.1)
    loss, metrics = kl_cov_loss(log_probs, old, adv, mask, kl_cov_ratio=0.25)
    close(loss, 0.1 / 4)  # Σ -A·r = 0, plus ppo_kl_coef·|0.1| on token 1
    loss.backward()
    close(log_probs.grad, [[-3 * r / 4, (3 * r + 1) / 4, -r / 4, r / 4]])
    close(metrics["ppo_kl"], 0.1)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses_leave_a_fully_masked_row_out_and_split_into_micro_batches(name):
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    log_probs = T([[-0.5, -1.0, -0.2], [-0.7, -0.3, 0.0], [0.0, 0.0, 0.0]])
    old = log_probs + T([[0.05, -0.1, 0.02], [0.1, -0.05, 0.0], [0.0, 0.0, 0.0]])
    adv = T([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    mode = "seq-mean-token-mean"
    fn = get_policy_loss(name)
    full, _ = fn(log_probs, old, adv, mask, loss_agg_mode=mode)
    two_rows, _ = fn(log_probs[:2], old[:2], adv[:2], mask[:2], loss_agg_mode=mode)
    dirty, _ = fn(garbage_under(log_probs, mask), garbage_under(old, mask), garbage_under(adv, mask), mask,
                  loss_agg_mode=mode)
    close(full, two_rows)
    close(dirty, two_rows)
    if name in ("clip_cov", "kl_cov"):  # they pick tokens by per-micro-batch covariance, as in verl
        return
    parts = [slice(0, 1), slice(1, 3)]
    sums = [fn(log_probs[p], old[p], adv[p], mask[p], loss_agg_mode=mode)[0] * num_loss_units(mask[p], mode)
            for p in parts]
    close(split_step(sums, [mask[p] for p in parts], mode), full)
