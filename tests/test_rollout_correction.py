"""Off-policy rollout corrections: each mode's weights and metrics against hand-computed values, their place in the
policy loss (detached, multiplying the per-token loss, "none" leaving it untouched), PolicyLoss's and the config's
errors, and a short RLVR run with a correction on."""

from __future__ import annotations

import math

import pytest
import torch

from baton.algorithms import (
    POLICY_LOSSES, ROLLOUT_CORRECTIONS, CapConfig, MaskConfig, NoSettings, compute_policy_loss,
    compute_rollout_correction, policy_loss_spec, register_policy_loss, rollout_correction_spec,
)
from baton.config import ConfigError
from baton.data import DataProto
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import AlgorithmConfig
from baton.rl.losses import PolicyLoss
from baton.rl.metrics import by_staleness, correction_diagnostics
from baton.pipelines.rlvr import RLVRPipeline
from baton.rl import StaleSamplesWarning
from test_pipeline_paths import metrics_of, tiny_rlvr

# Two rows; the second has one padding token, whose values (NaN included) must never matter.
OLD = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, float("nan")]])  # proximal
ROLLOUT = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, 0.2, 5.0]])  # behaviour
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# exp(old - rollout) per valid token: e, 1, 1/e | 1, exp(-0.7) ≈ 0.497; sequence sums of the log ratio: 0 and -0.7
E, R = math.e, math.exp(-0.7)


def correction(name: str, **settings):
    """The weights and metrics of correction `name` with `settings` over its config's defaults (a cap of 2.0, bounds
    0.5 and 2.0)."""
    return compute_rollout_correction(name, OLD, ROLLOUT, MASK, rollout_correction_spec(name).config(**settings))


EXPECTED = {  # name → (weights, metrics as (sum, count))
    "none": ([[1, 1, 1], [1, 1, 0]], {}),
    "token_tis": ([[2.0, 1, 1 / E], [1, R, 0]],
                  {"rollout_corr/is_weight/mean": (2 + 1 + 1 / E + 1 + R, 5), "rollout_corr/clipped_frac": (1, 5)}),
    "seq_tis": ([[1, 1, 1], [R, R, 0]],
                {"rollout_corr/is_weight/mean": (1 + R, 2), "rollout_corr/clipped_frac": (0, 2)}),
    "token_mask": ([[0, 1, 0], [1, 0, 0]],
                   {"rollout_corr/is_weight/mean": (2, 5), "rollout_corr/masked_frac": (3, 5)}),
    "seq_mask": ([[1, 1, 1], [0, 0, 0]],
                 {"rollout_corr/is_weight/mean": (1, 2), "rollout_corr/masked_frac": (1, 2)}),
    "geo_mask": ([[1, 1, 1], [1, 1, 0]],  # geometric means exp(0) and exp(-0.35) ≈ 0.70 both lie inside
                 {"rollout_corr/is_weight/mean": (2, 2), "rollout_corr/masked_frac": (0, 2)}),
    "decoupled": ([[0, 1, 1 / E], [1, R, 0]],  # e > the cap: that token is dropped, not truncated
                  {"rollout_corr/is_weight/mean": (1 + 1 / E + 1 + R, 5), "rollout_corr/masked_frac": (1, 5)}),
}


def assert_metrics(metrics, expected):
    assert set(metrics) == set(expected)
    for key, (total, count) in expected.items():
        assert metrics[key] == pytest.approx((total, count), abs=1e-6), key


def test_every_registered_mode_is_covered():
    assert set(ROLLOUT_CORRECTIONS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_weights_and_metrics_match_hand_computed_values(name):
    weights, metrics = correction(name)
    expected_weights, expected_metrics = EXPECTED[name]
    torch.testing.assert_close(weights, torch.tensor(expected_weights, dtype=torch.float32))
    assert_metrics(metrics, expected_metrics)


def test_caps_and_bounds():
    weights, metrics = correction("token_tis", rollout_is_cap=None)  # plain importance sampling
    torch.testing.assert_close(weights, torch.tensor([[E, 1, 1 / E], [1, R, 0]]))
    assert metrics["rollout_corr/clipped_frac"] == (0.0, 5.0)
    weights, _ = correction("decoupled", rollout_is_cap=None)  # AReaL's default: no cap
    torch.testing.assert_close(weights, torch.tensor([[E, 1, 1 / E], [1, R, 0]]))
    weights, metrics = correction("seq_tis", rollout_is_cap=1.0)
    torch.testing.assert_close(weights, torch.tensor([[1, 1, 1], [R, R, 0]]))  # 1 is not above the cap of 1
    weights, metrics = correction("seq_mask", rollout_mask_low=0.4)  # exp(-0.7) ≈ 0.497 is now inside
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1, 1], [1, 1, 0]]))
    weights, metrics = correction("geo_mask", rollout_mask_low=0.75)  # exp(-0.35) ≈ 0.705 is now outside
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1, 1], [0, 0, 0]]))
    assert metrics["rollout_corr/masked_frac"] == (1.0, 2.0)
    # The sequence ratio is clamped before exp: a huge sum gives the cap, not inf or NaN.
    weights, _ = compute_rollout_correction("seq_tis", torch.zeros(1, 2), torch.full((1, 2), -50.0), torch.ones(1, 2))
    torch.testing.assert_close(weights, torch.full((1, 2), 2.0))


def test_each_mode_declares_its_settings():
    assert rollout_correction_spec("token_tis").config is CapConfig
    assert rollout_correction_spec("decoupled").config is CapConfig
    assert rollout_correction_spec("geo_mask").config is MaskConfig
    assert rollout_correction_spec("none").config is NoSettings
    with pytest.raises(ValueError, match=r"unknown rollout correction 'tis'; valid: \['decoupled', "):
        correction("tis")
    with pytest.raises(TypeError, match="'token_tis' takes settings of type CapConfig, not MaskConfig"):
        compute_rollout_correction("token_tis", OLD, ROLLOUT, MASK, MaskConfig())


def policy_inputs(seed: int = 0):
    """log_probs (with a gradient) near OLD, advantages of both signs; the NaN padding replaced so grads are finite."""
    noise = torch.Generator().manual_seed(seed)
    old = torch.nan_to_num(OLD, nan=-1.0)
    log_probs = (old + 0.3 * torch.randn(old.shape, generator=noise)).requires_grad_(True)
    advantages = torch.tensor([[1.0], [-0.5]]).expand(2, 3)
    return log_probs, old, advantages


@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", ["token_tis", "seq_tis", "token_mask", "decoupled"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_the_gradient_is_the_weight_times_the_uncorrected_gradient(loss_name, mode, loss_agg_mode):
    rollout = torch.nan_to_num(ROLLOUT)
    grads = []
    for weighted in (False, True):
        log_probs, old, advantages = policy_inputs()
        weights, _ = compute_rollout_correction(mode, old.requires_grad_(True), rollout, MASK)
        assert not weights.requires_grad
        torch.manual_seed(0)  # clip_cov draws the tokens it detaches: the same draw both times
        loss, _ = compute_policy_loss(loss_name, log_probs, old, advantages, MASK,
                                      token_weights=weights if weighted else None, loss_agg_mode=loss_agg_mode)
        loss.backward()
        grads.append(log_probs.grad)
    torch.testing.assert_close(grads[1], weights * grads[0])


def test_decoupled_ppo_is_vanilla_ppo_against_the_proximal_policy_times_the_behaviour_weight():
    log_probs, old, advantages = policy_inputs(seed=1)
    rollout = torch.nan_to_num(ROLLOUT)
    weights, _ = compute_rollout_correction("decoupled", old, rollout, MASK, CapConfig(rollout_is_cap=None))
    loss, _ = compute_policy_loss("vanilla", log_probs, old, advantages, MASK, token_weights=weights)
    ratio = (log_probs - old).exp()
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    surrogate = torch.where(advantages < 0, torch.minimum(surrogate, -advantages * 3.0), surrogate)  # dual clip
    behaviour_weight = (old - rollout).exp()
    expected = (behaviour_weight * surrogate * MASK).sum() / MASK.sum()
    torch.testing.assert_close(loss, expected)


def batch_and_outputs(with_rollout: bool = True, with_old: bool = True):
    log_probs, old, advantages = policy_inputs()
    tensors = {"response_mask": MASK, "advantages": advantages.contiguous()}
    if with_old:
        tensors["old_log_probs"] = old
    if with_rollout:
        tensors["rollout_log_probs"] = torch.nan_to_num(ROLLOUT)
    outputs = {"log_probs": log_probs, "entropy": torch.full((2, 3), 0.5)}
    return outputs, DataProto.from_dict(tensors)


def test_none_leaves_the_policy_loss_bit_identical():
    outputs, batch = batch_and_outputs()
    plain_loss, plain_metrics = PolicyLoss(entropy_coeff=0.01)(outputs, batch)
    none_loss, none_metrics = PolicyLoss(entropy_coeff=0.01, rollout_correction="none",
                                         correction_settings=NoSettings())(outputs, batch)
    assert torch.equal(plain_loss, none_loss) and plain_metrics == none_metrics
    assert not any(k.startswith("rollout_corr/") for k in none_metrics)
    outputs, batch = batch_and_outputs(with_rollout=False, with_old=False)  # "none" needs neither column
    PolicyLoss(rollout_correction="none")(outputs, batch)


def test_policy_loss_weighs_its_tokens_and_reports_the_correction_metrics():
    outputs, batch = batch_and_outputs()
    loss_fn = PolicyLoss(rollout_correction="token_tis", correction_settings=CapConfig(rollout_is_cap=2.0))
    loss, metrics = loss_fn(outputs, batch)
    weights, expected_metrics = correction("token_tis")
    expected, _ = compute_policy_loss("vanilla", outputs["log_probs"], batch.batch["old_log_probs"],
                                      batch.batch["advantages"], MASK, token_weights=weights)
    torch.testing.assert_close(loss, expected * 5)  # sum form: times the 5 valid tokens
    assert_metrics({k: v for k, v in metrics.items() if k.startswith("rollout_corr/")}, EXPECTED["token_tis"][1])
    # (sum, count) metrics add up: the two rows as two micro-batches give the batch's values.
    halves = [loss_fn({k: v[i:i + 1] for k, v in outputs.items()}, batch[i:i + 1])[1] for i in range(2)]
    for key, (total, count) in expected_metrics.items():
        assert (halves[0][key][0] + halves[1][key][0], halves[0][key][1] + halves[1][key][1]) == pytest.approx(
            (total, count))


def test_the_diagnostics_of_a_correction_against_hand_computed_values():
    """Effective sample share and mismatch KL of the token ratios e, 1, 1/e, 1, exp(-0.7) (padding left out)."""
    ratios = torch.tensor([E, 1, 1 / E, 1, R], dtype=torch.float64)
    metrics = correction_diagnostics(OLD.nan_to_num(), ROLLOUT, MASK)
    assert metrics["rollout_corr/ess"] == pytest.approx(float(ratios.sum() ** 2 / (5 * (ratios ** 2).sum())))
    assert metrics["rollout_corr/seq_ess"] == pytest.approx((1 + R) ** 2 / (2 * (1 + R * R)))
    assert metrics["rollout/mismatch_kl"] == pytest.approx(float((ratios - 1 - ratios.log()).mean()))
    same = correction_diagnostics(ROLLOUT, ROLLOUT, MASK)  # on-policy: every weight 1, no mismatch
    assert same == {"rollout_corr/ess": 1.0, "rollout_corr/seq_ess": 1.0, "rollout/mismatch_kl": 0.0}
    one_dominates = correction_diagnostics(torch.tensor([[30.0, 0, 0, 0]]), torch.zeros(1, 4), torch.ones(1, 4))
    assert one_dominates["rollout_corr/ess"] == pytest.approx(0.25)  # 1/n: one weight carries the batch


def staleness_batch(max_staleness: int = 2):
    """`batch_and_outputs` as the rollout system's batch at trained version 5: row 0's tokens sampled by versions
    5, 4, 4 (staleness 0, 1, 1), row 1's by 3, 3 (staleness 2), its padding -1."""
    outputs, batch = batch_and_outputs()
    batch.batch["rollout_weight_versions"] = torch.tensor([[5, 4, 4], [3, 3, -1]])
    batch.meta_info.update(trained_version=5, max_staleness=max_staleness)
    return outputs, batch


def test_a_stale_batch_is_split_by_staleness_in_its_metrics_and_its_loss_metrics():
    outputs, batch = staleness_batch(max_staleness=3)
    unsplit = staleness_batch(max_staleness=0)[1]  # the bound 0 (sync mode): no split
    for each in (batch, unsplit):
        each.batch["advantages"] = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -3.0, 0.0]])
    metrics = by_staleness(batch)
    assert [metrics[f"staleness/{s}/token_frac"] for s in range(4)] == [0.2, 0.4, 0.4, 0.0]  # 3: none that stale
    assert [metrics[f"staleness/{s}/advantage_mean"] for s in range(4)] == [1.0, 2.5, -2.0, 0.0]
    assert metrics["staleness/2/mismatch_kl"] == pytest.approx(((1 - 1) + (R - 1 + 0.7)) / 2)

    loss_fn = PolicyLoss(rollout_correction="token_tis", correction_settings=CapConfig())
    loss, split = loss_fn(outputs, batch)
    plain, whole = loss_fn(outputs, unsplit)
    assert by_staleness(unsplit) == {}
    assert torch.equal(loss, plain) and set(split) - set(whole) == {
        f"actor/{k}/staleness_{s}" for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower") for s in range(4)}
    for key in ("pg_clipfrac", "ppo_kl"):  # the buckets' (sum, count) add up to the whole batch's
        parts = [split[f"actor/{key}/staleness_{s}"] for s in range(4)]
        assert (sum(p[0] for p in parts), sum(p[1] for p in parts)) == pytest.approx(whole[f"actor/{key}"])
    assert split["actor/ppo_kl/staleness_3"] == (0.0, 0.0)  # named on every rank, counted on none


def test_the_split_by_staleness_leaves_the_random_state_as_it_was():
    """clip_cov draws the tokens it detaches from the global generator: the loss's metrics per staleness, computed
    again, must not move it (the update would then differ from the one without them)."""
    settings = policy_loss_spec("clip_cov").config(clip_cov_lb=-1e9, clip_cov_ub=1e9)  # every token a candidate
    draws = []
    for bound in (2, 0):
        outputs, batch = staleness_batch(max_staleness=bound)
        torch.manual_seed(0)
        PolicyLoss(policy_loss="clip_cov", settings=settings)(outputs, batch)
        draws.append(torch.rand(4))
    assert torch.equal(*draws)


@pytest.mark.parametrize("missing", ["rollout_log_probs", "old_log_probs"])
def test_policy_loss_names_a_missing_column(missing):
    outputs, batch = batch_and_outputs(with_rollout=missing != "rollout_log_probs", with_old=missing != "old_log_probs")
    with pytest.raises(ValueError, match=f"rollout_correction 'seq_mask' needs the batch column '{missing}'"):
        PolicyLoss(rollout_correction="seq_mask", correction_settings=MaskConfig())(outputs, batch)


@pytest.fixture
def unweighted_loss():
    """A policy loss registered for one test that takes no token_weights."""
    @register_policy_loss("unweighted", token_weights=False)
    def unweighted(log_probs, old_log_probs, advantages, response_mask, loss_agg_mode="token-mean",
                   loss_scale_factor=None):
        return (-(advantages * log_probs) * response_mask).sum() / response_mask.sum(), {}

    yield "unweighted"
    POLICY_LOSSES.pop("unweighted")


def test_a_loss_without_token_weights_refuses_a_correction(tmp_path, unweighted_loss):
    log_probs, old, advantages = policy_inputs()
    compute_policy_loss(unweighted_loss, log_probs, old, advantages, MASK)  # uncorrected it runs
    with pytest.raises(ValueError, match="'unweighted' takes no token_weights"):
        compute_policy_loss(unweighted_loss, log_probs, old, advantages, MASK, token_weights=torch.ones(2, 3))
    config = tiny_rlvr(tmp_path, algorithm=AlgorithmConfig(policy_loss=unweighted_loss, rollout_correction="seq_tis"))
    with pytest.raises(ConfigError, match="'unweighted' takes no token_weights"):
        config.check()


@pytest.mark.parametrize("settings, message", [
    ({"rollout_correction": "tis"}, r"algorithm.rollout_correction 'tis' is not one of \['decoupled', 'geo_mask', "),
    ({"rollout_correction": "token_tis", "rollout_is_cap": 0.5}, "rollout_is_cap=0.5 is below 1"),
    ({"rollout_correction": "decoupled", "rollout_is_cap": 0.5}, "rollout_is_cap=0.5 is below 1"),
    ({"rollout_correction": "token_mask", "rollout_mask_low": 1.5}, "must satisfy 0 <= low <= 1 <= high"),
    ({"rollout_correction": "seq_mask", "rollout_mask_high": 0.9}, "must satisfy 0 <= low <= 1 <= high"),
    ({"rollout_correction": "geo_mask", "rollout_mask_low": 1.0, "rollout_mask_high": 1.0}, "low < high"),
    ({"rollout_correction": {"name": "geo_mask", "rollout_mask_low": -0.1}}, "must satisfy 0 <= low"),
])
def test_the_config_refuses_bad_settings(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        tiny_rlvr(tmp_path, algorithm=AlgorithmConfig(**settings)).check()
    tiny_rlvr(tmp_path, algorithm=AlgorithmConfig(rollout_correction="decoupled", rollout_is_cap=None)).check()


def test_a_setting_the_correction_does_not_take_is_refused_with_the_fix(tmp_path):
    config = tiny_rlvr(tmp_path, algorithm=AlgorithmConfig(rollout_correction="token_tis", rollout_mask_low=0.2))
    with pytest.raises(ConfigError, match=r"algorithm.rollout_mask_low=0.2 is set, but algorithm.rollout_correction "
                                          r"'token_tis' does not take it \(it takes rollout_is_cap\); remove "
                                          r"algorithm.rollout_mask_low, or use a rollout correction that takes it: "
                                          r"geo_mask, seq_mask, token_mask"):
        config.check()
    assert AlgorithmConfig(rollout_correction="token_tis", rollout_is_cap=3.0).rollout_correction_config() == \
        CapConfig(rollout_is_cap=3.0)


def test_rlvr_with_token_tis_computes_old_log_probs_and_logs_the_weights(tmp_path, recwarn):
    # Stale samples (sync every 2 steps) are what the correction is for: no warning that the loss ignores them.
    config = tiny_rlvr(tmp_path, num_steps=2, algorithm=AlgorithmConfig(rollout_correction="token_tis"),
                       trainer={"sync_every_steps": 2})
    run_pipeline(RLVRPipeline, config)
    assert not [w for w in recwarn if issubclass(w.category, StaleSamplesWarning)]
    records = metrics_of(tmp_path)
    assert len(records) == 2
    for record in records:
        assert 0 < record["rollout_corr/is_weight/mean"] <= 2.0
        assert 0 <= record["rollout_corr/clipped_frac"] <= 1
        assert "rollout/logprob_diff/mean" in record and "timing_s/old_log_prob" in record
    # Step 2 samples with the weights from before step 1's update: the weights move off 1.
    assert records[1]["rollout/logprob_diff/mean"] > 1e-3
    assert records[1]["rollout_corr/is_weight/mean"] != pytest.approx(1.0, abs=1e-4)
