"""baton.algorithms against hand-computed values on tiny tensors; padding (mask 0) never changes a result."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from baton.algorithms import (
    ADV_ESTIMATORS,
    agg_loss,
    agg_loss_sum,
    apply_kl_penalty,
    compute_advantages,
    entropy_loss,
    gae,
    get_adv_estimator,
    get_kl_estimator,
    get_policy_loss,
    grpo,
    kl_penalty,
    loss_unit,
    masked_mean,
    masked_var,
    masked_whiten,
    num_loss_units,
    ppo_clip_loss,
    register_adv_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    value_loss,
)

T = torch.tensor
GARBAGE = [float("nan"), float("inf"), -1e6, 1e6, -float("inf")]


def close(actual, expected, atol=1e-4):
    actual, expected = torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def garbage_under(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` with NaN, inf and huge values wherever the mask is 0."""
    junk = torch.tensor(GARBAGE * x.numel())[: x.numel()].reshape(x.shape)
    return torch.where(mask.bool(), x, junk)


# ---- masked statistics ------------------------------------------------------------------------------

X = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1, 1, 0], [1, 0, 0]])


def test_masked_mean_over_all_and_along_dim():
    close(masked_mean(X, MASK), 7 / 3)  # (1 + 2 + 4) / 3
    close(masked_mean(X, MASK, dim=-1), [1.5, 4.0])
    close(masked_mean(X, torch.zeros_like(MASK)), 0.0)  # nothing valid → 0, not NaN


def test_masked_var_unbiased_and_biased():
    # values 1, 2, 4; mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9
    close(masked_var(X, MASK), 42 / 9 / 2)
    close(masked_var(X, MASK, unbiased=False), 42 / 9 / 3)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, T([[1, 0, 0], [0, 0, 0]]))


def _whiten_half(rank: int, init_file: str, x: torch.Tensor, mask: torch.Tensor, out: str) -> None:
    import torch.distributed as dist

    from baton.algorithms.utils import batch_statistics_over

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        rows = slice(0, 2) if rank == 0 else slice(2, 5)  # uneven shards, uneven token counts
        with batch_statistics_over():
            torch.save(masked_whiten(x[rows], mask[rows]), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_masked_whiten_over_two_ranks_equals_the_whole_batch(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    mask = (torch.rand(5, 6) > 0.3).long()
    out = str(tmp_path / "whitened")
    torch.multiprocessing.spawn(_whiten_half, args=(str(tmp_path / "init"), x, mask, out), nprocs=2)
    shards = torch.cat([torch.load(f"{out}.0"), torch.load(f"{out}.1")])
    assert torch.allclose(shards, masked_whiten(x, mask), atol=1e-6)
    assert not torch.allclose(torch.load(f"{out}.0"), masked_whiten(x[:2], mask[:2]), atol=1e-3)  # not per rank


def test_masked_whiten_shifted_and_unshifted():
    x, mask = T([[2.0, 4.0, 6.0, 0.0]]), T([[1, 1, 1, 0]])
    # mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    close(masked_whiten(x, mask), [[-1.0, 0.0, 1.0, 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[3.0, 4.0, 5.0, 0.0]])


def test_masked_statistics_ignore_padding():
    dirty = garbage_under(X, MASK)
    assert torch.equal(masked_mean(dirty, MASK), masked_mean(X, MASK))
    assert torch.equal(masked_mean(dirty, MASK, dim=-1), masked_mean(X, MASK, dim=-1))
    assert torch.equal(masked_var(dirty, MASK), masked_var(X, MASK))
    assert torch.equal(masked_whiten(dirty, MASK), masked_whiten(X, MASK))


# ---- advantage estimators ---------------------------------------------------------------------------

def test_gae_gamma_one_lambda_one_is_return_minus_value():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [0.2, 0.4, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    # row 0: A_t = 1 - V_t; row 1: A_1 = 1 - 0.4, A_0 = (0 + 0.4 - 0.2) + 0.6 = 0.8; padding 0
    close(adv, [[0.5, 0.4, 0.3], [0.8, 0.6, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_gae_discounted():
    rewards, values, mask = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    # t=2: δ = 1 - 0.7 = 0.3                    A = 0.3
    # t=1: δ = 0.5·0.7 - 0.6 = -0.25            A = -0.25 + 0.25·0.3 = -0.175
    # t=0: δ = 0.5·0.6 - 0.5 = -0.2             A = -0.2 + 0.25·(-0.175) = -0.24375
    close(adv, [[-0.24375, -0.175, 0.3]])
    close(ret, [[0.25625, 0.425, 1.0]])


def test_gae_skips_masked_positions_inside_the_response():
    # a masked observation token at t=1: value and advantage carry over it undiscounted (verl)
    adv, ret = gae(T([[0.0, 9.0, 1.0]]), T([[0.5, 9.0, 0.7]]), T([[1, 0, 1]]), gamma=0.5, lam=1.0, whiten=False)
    # t=2: A = 0.3; t=0: δ = 0.5·0.7 - 0.5 = -0.15, A = -0.15 + 0.5·0.3 = 0
    close(adv, [[0.0, 0.0, 0.3]])
    close(ret, [[0.5, 0.0, 1.0]])


def test_gae_whitens_advantages_by_default_but_not_returns():
    rewards, values, mask = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # raw [0.5, 0.4, 0.3]: mean 0.4, unbiased var (0.01 + 0 + 0.01) / 2 = 0.01, std 0.1
    close(adv, [[1.0, 0.0, -1.0]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_grpo_group_of_three_and_pair_and_singleton():
    # scores (sum of token rewards): [1, 0, 0] | [2, 4] | [5]
    rewards = T([[0.5, 0.5], [0.0, 0.0], [0.0, 0.0], [2.0, 0.0], [1.0, 3.0], [5.0, 0.0]])
    mask = T([[1, 1], [1, 1], [1, 0], [1, 0], [1, 1], [1, 0]])
    index = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    adv, ret = grpo(rewards, mask, index)
    # a: mean 1/3, std (unbiased) sqrt((4/9 + 1/9 + 1/9) / 2) = 0.57735
    # b: mean 3, std sqrt((1 + 1) / 1) = 1.41421;  c: alone → mean 0, std 1
    a, b = 2 / 3 / 0.57735, 1 / 1.41421
    close(adv, [[a, a], [-0.57735, -0.57735], [-0.57735, 0.0], [-b, 0.0], [b, b], [5.0, 0.0]])
    assert torch.equal(adv, ret)


def test_grpo_without_std_normalisation():
    rewards, mask = T([[1.0], [0.0], [0.0]]), T([[1], [1], [1]])
    adv, _ = grpo(rewards, mask, [7, 7, 7], norm_adv_by_std=False)
    close(adv, [[2 / 3], [-1 / 3], [-1 / 3]])


def test_rloo_group_of_three_and_singleton():
    rewards, mask = T([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [3.0, 0.0]]), T([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = rloo(rewards, mask, np.array([0, 0, 0, 1]))
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; the singleton keeps its score 3
    close(adv, [[1.0, 1.0], [-0.5, -0.5], [-0.5, 0.0], [3.0, 3.0]])
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_discounted_returns_whitened():
    rewards, mask = T([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]), T([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 0.0, 0.0]])
    # valid returns 0.25, 0.5, 1, 1, 0: mean 0.55; squared deviations sum 0.8; unbiased var 0.2, std 0.447214
    s = 0.447214
    close(adv, [[-0.3 / s, -0.05 / s, 0.45 / s], [0.45 / s, -0.55 / s, 0.0]])


def test_reinforce_plus_plus_skips_masked_positions_inside_the_response():
    adv, ret = reinforce_plus_plus(T([[0.0, 9.0, 1.0]]), T([[1, 0, 1]]), gamma=0.5)
    # the masked observation token at t=1 is neither counted nor discounted: R_0 = 0.5·1
    close(ret, [[0.5, 0.0, 1.0]])
    # 0.5 and 1: mean 0.75, unbiased var 2·0.25² = 0.125
    close(adv, [[-0.25 / math.sqrt(0.125), 0.0, 0.25 / math.sqrt(0.125)]])


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens_over_tokens():
    rewards, mask = T([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]), T([[1, 1], [1, 0], [1, 0]])
    adv, ret = reinforce_plus_plus_baseline(rewards, mask, ["p", "p", "p"])
    # centred scores 2/3, -1/3, -1/3 on 2, 1, 1 tokens: token mean 1/6, deviations ±1/2, unbiased var 1/3
    a = 0.5 / math.sqrt(1 / 3)
    close(adv, [[a, a], [-a, 0.0], [-a, 0.0]])
    assert torch.equal(adv, ret)


RAGGED_MASK = T([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
ESTIMATOR_INPUTS = dict(
    token_level_rewards=T([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.2, 0.0]]),
    values=T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0], [0.6, 0.0, 0.0], [0.7, 0.8, 0.0]]),
    response_mask=RAGGED_MASK, index=np.array(["u", "u", "v", "v"]), gamma=0.9, lam=0.95,
    reward_baselines=T([0.5, 0.5, 0.0, 0.0]),
)


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_estimators_ignore_padding_and_zero_it(name):
    clean = compute_advantages(name, **ESTIMATOR_INPUTS)
    dirty_inputs = dict(ESTIMATOR_INPUTS)
    for key in ("token_level_rewards", "values"):
        dirty_inputs[key] = garbage_under(ESTIMATOR_INPUTS[key], RAGGED_MASK)
    dirty = compute_advantages(name, **dirty_inputs)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)
        assert torch.all(c[RAGGED_MASK == 0] == 0) and torch.isfinite(c).all()


def test_compute_advantages_passes_only_what_the_estimator_takes():
    adv, _ = compute_advantages("rloo", **ESTIMATOR_INPUTS)  # values, gamma, lam are not rloo's
    assert torch.equal(adv, rloo(ESTIMATOR_INPUTS["token_level_rewards"], RAGGED_MASK, ESTIMATOR_INPUTS["index"])[0])
    with pytest.raises(ValueError, match=r"'gae' needs \['values'\]"):
        compute_advantages("gae", **{k: v for k, v in ESTIMATOR_INPUTS.items() if k != "values"})


def test_group_index_must_match_batch():
    with pytest.raises(ValueError, match="one id per row"):
        grpo(T([[1.0], [0.0]]), T([[1], [1]]), ["a"])


# ---- policy loss ------------------------------------------------------------------------------------

def ppo_case():
    """Per token (ratio, A): (1.5, +1) clipped at 1.2; (1, +1) unclipped; (0.5, -1) clipped at 0.8;
    (10, -1) dual clip at 3; then one padding token."""
    ratios = T([[1.5, 1.0, 0.5, 10.0, 1.0]])
    old = T([[-1.0, -2.0, -1.5, -3.0, 0.0]])
    log_probs = (old + ratios.log()).requires_grad_(True)
    advantages = T([[1.0, 1.0, -1.0, -1.0, 0.0]])
    mask = T([[1, 1, 1, 1, 0]])
    return log_probs, old, advantages, mask


def test_ppo_clip_loss_clip_both_sides_and_dual_clip():
    log_probs, old, advantages, mask = ppo_case()
    loss, metrics = ppo_clip_loss(log_probs, old, advantages, mask)
    # per-token losses: max(-1.5, -1.2) = -1.2; -1; max(0.5, 0.8) = 0.8; min(max(10, 1.2), 3) = 3
    close(loss, (-1.2 - 1.0 + 0.8 + 3.0) / 4)
    close(metrics["pg_clipfrac"], 2 / 4)
    close(metrics["pg_clipfrac_lower"], 1 / 4)
    close(metrics["ppo_kl"], (-math.log(1.5) - 0.0 - math.log(0.5) - math.log(10.0)) / 4)
    loss.backward()
    # only the unclipped token carries a gradient: d(-A·r)/dlogp = -A·r = -1, over 4 tokens
    close(log_probs.grad, [[0.0, -0.25, 0.0, 0.0, 0.0]])


def test_ppo_clip_higher_is_asymmetric():
    old, advantages, mask = T([[0.0, 0.0]]), T([[1.0, -1.0]]), T([[1, 1]])
    log_probs = T([[math.log(1.25), math.log(0.75)]])
    loss, metrics = ppo_clip_loss(log_probs, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # 1.25 < 1.28 stays unclipped: -1.25; 0.75 < 0.8 clips for A < 0: max(0.75, 0.8) = 0.8
    close(loss, (-1.25 + 0.8) / 2)
    close(metrics["pg_clipfrac"], 0.5)
    loss_sym, _ = ppo_clip_loss(log_probs, old, advantages, mask)
    close(loss_sym, (-1.2 + 0.8) / 2)


def test_ppo_clip_loss_ignores_padding_in_value_and_gradient():
    log_probs, old, advantages, mask = ppo_case()
    clean_loss, clean_metrics = ppo_clip_loss(log_probs, old, advantages, mask)
    clean_loss.backward()
    clean_grad = log_probs.grad.clone()
    dirty_lp = garbage_under(log_probs.detach(), mask).requires_grad_(True)
    dirty_loss, dirty_metrics = ppo_clip_loss(dirty_lp, garbage_under(old, mask), garbage_under(advantages, mask), mask)
    dirty_loss.backward()
    assert torch.equal(clean_loss, dirty_loss) and clean_metrics == dirty_metrics
    assert torch.equal(clean_grad, dirty_lp.grad)


def test_ppo_rejects_dual_clip_constant_at_most_one():
    log_probs, old, advantages, mask = ppo_case()
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        ppo_clip_loss(log_probs, old, advantages, mask, clip_ratio_c=1.0)


# ---- aggregation ------------------------------------------------------------------------------------

LOSS_MAT = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
AGG_MASK = T([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode, expected, expected_sum, unit", [
    ("token-mean", (6 + 4) / 4, 10.0, "token"),
    ("seq-mean-token-sum", (6 + 4) / 2, 10.0, "sequence"),
    ("seq-mean-token-mean", (2 + 4) / 2, 6.0, "sequence"),
])
def test_agg_loss_modes_on_ragged_mask(mode, expected, expected_sum, unit):
    close(agg_loss(LOSS_MAT, AGG_MASK, mode), expected)
    loss_sum, got_unit = agg_loss_sum(LOSS_MAT, AGG_MASK, mode)
    close(loss_sum, expected_sum)
    assert got_unit == unit == loss_unit(mode)
    # one worker, no micro-batching: sum / global units == mean
    close(loss_sum / num_loss_units(AGG_MASK, mode), agg_loss(LOSS_MAT, AGG_MASK, mode), atol=0)
    # two micro-batches (one row each), normalised by the global count, give the full-batch mean
    sums = [agg_loss_sum(LOSS_MAT[i : i + 1], AGG_MASK[i : i + 1], mode)[0] for i in range(2)]
    units = sum(num_loss_units(AGG_MASK[i : i + 1], mode) for i in range(2))
    close(sum(sums) / units, expected)
    assert torch.equal(agg_loss(garbage_under(LOSS_MAT, AGG_MASK), AGG_MASK, mode), agg_loss(LOSS_MAT, AGG_MASK, mode))


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="valid: .*'seq-mean-token-mean'.*'token-mean'"):
        agg_loss(LOSS_MAT, AGG_MASK, "seq-sum")
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        agg_loss_sum(LOSS_MAT, AGG_MASK, "mean")


def test_entropy_loss_aggregates_masked_entropy():
    close(entropy_loss(LOSS_MAT, AGG_MASK), 2.5)
    close(entropy_loss(garbage_under(LOSS_MAT, AGG_MASK), AGG_MASK, "seq-mean-token-mean"), 3.0)


# ---- KL -----------------------------------------------------------------------------------------------

def test_kl_estimators_on_known_values():
    log_probs, ref = T([[-1.0, -2.0, 0.0]]), T([[-2.0, -1.0, -30.0]])
    close(kl_penalty(log_probs, ref, "k1"), [[1.0, -1.0, 30.0]])
    close(kl_penalty(log_probs, ref, "abs"), [[1.0, 1.0, 30.0]])
    close(kl_penalty(log_probs, ref, "k2"), [[0.5, 0.5, 450.0]])
    # ref - logp = -1: e^-1 + 1 - 1 = 0.367879; = +1: e - 1 - 1 = 0.718282; = -30: huge → clamped to 10
    close(kl_penalty(log_probs, ref, "k3"), [[0.367879, 0.718282, 10.0]])


def test_apply_kl_penalty():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    ref = T([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    log_probs = ref + T([[0.1, 0.2, 0.3], [0.4, -0.2, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = apply_kl_penalty(scores, log_probs, ref, mask, kl_coef=0.5)
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.1, 0.0]])
    # per-sequence mean KL 0.2 and 0.1, averaged over sequences (verl)
    close(metrics["actor/reward_kl_penalty"], 0.15)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    dirty, dirty_metrics = apply_kl_penalty(garbage_under(scores, mask), garbage_under(log_probs, mask),
                                            garbage_under(ref, mask), mask, kl_coef=0.5)
    assert torch.equal(dirty, rewards) and dirty_metrics == metrics


# ---- value loss ---------------------------------------------------------------------------------------

def test_value_loss_clip_active_and_inactive():
    values = T([[1.0, 1.0, 1.0, 7.0]], requires_grad=True)
    old = T([[0.5, 0.95, 0.5, 0.0]])
    returns = T([[2.0, 0.0, 0.0, 0.0]])
    mask = T([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=0.2)
    # token 0: clip(1) = 0.7, max((1-2)², (0.7-2)²) = 1.69, clipped term wins
    # token 1: clip range [0.75, 1.15] leaves 1 alone: 1
    # token 2: clip(1) = 0.7, max(1², 0.7²) = 1, unclipped term wins
    close(loss, 0.5 * (1.69 + 1.0 + 1.0) / 3)
    close(metrics["vf_clipfrac"], 1 / 3)
    dirty_loss, dirty_metrics = value_loss(garbage_under(values.detach(), mask), garbage_under(old, mask),
                                           garbage_under(returns, mask), mask, cliprange_value=0.2)
    assert torch.equal(dirty_loss, loss.detach()) and dirty_metrics == metrics


# ---- registries ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("lookup, known", [
    (get_adv_estimator, ["gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]),
    (get_policy_loss, ["vanilla"]),
    (get_kl_estimator, ["abs", "k1", "k2", "k3"]),
])
def test_unknown_names_list_the_valid_ones(lookup, known):
    with pytest.raises(ValueError) as info:
        lookup("nope")
    assert "'nope'" in str(info.value) and all(repr(name) in str(info.value) for name in known)
    assert all(callable(lookup(name)) for name in known)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(T([0.0]), T([0.0]), "low_var")


def test_registering_a_name_twice_fails():
    assert get_policy_loss("vanilla") is ppo_clip_loss
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(lambda **_: None)
