"""ReMax and GDPO in the RLVR loop: the greedy baseline rollout, dict rewards with further fields, and the reward
components GDPO normalises one by one."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from baton.algorithms import compute_advantages
from baton.config import ConfigError
from baton.data import DataProto
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import AlgorithmConfig
from baton.datasets.prompts import SAMPLE_SEEDS
from baton.pipelines.rlvr import RLVRPipeline
from baton.rl import baseline_per_row, reward_components
from baton.rewards import RewardError
from baton.strategy import SamplingParams
from baton.workers import RewardWorker
from test_data_validation import response_batch
from test_pipeline_paths import metrics_of, tiny_rlvr
from test_run_ux import mock_grpo


def char_sum_reward(response: str, ground_truth: str, **fields) -> float:
    """Differs between most responses, so a baseline taken from the wrong response shows."""
    return float(sum(map(ord, response)) % 11)


def two_parts(response: str, ground_truth: str, **fields) -> dict:
    long, odd = float(len(response) >= 2), float(bool(response) and ord(response[0]) % 2 == 1)
    return {"score": long + odd, "long": long, "odd": odd}


def parts(response: str, ground_truth: str, **fields) -> dict:
    if response == "x":
        raise ValueError("not a number")
    return {"score": float(response == ground_truth), "length": len(response), "digit": response.isdigit()}


def parts_missing_on_7(response: str, ground_truth: str, **fields) -> dict:
    return {"score": 1.0} if response == "7" else {"score": 0.0, "length": float(len(response))}


def parts_without_score(response: str, ground_truth: str, **fields) -> dict:
    return {"correct": 1.0}


def parts_with_text(response: str, ground_truth: str, **fields) -> dict:
    return {"score": 1.0, "note": response}  # of text fields only verl's "pred" is taken


class Captured(RLVRPipeline):
    """Keeps each step's prompts and its batch after the advantages."""

    def next_prompts(self) -> DataProto:
        self.prompts = super().next_prompts()
        return self.prompts

    def __init__(self, config):
        super().__init__(config)
        compute = self.algorithm.compute_advantages

        def capture(batch):
            self.before_advantages(batch)
            self.batch, metrics = compute(batch)
            return self.batch, metrics

        self.algorithm.compute_advantages = capture

    def before_advantages(self, batch) -> None:
        pass


class Probed(Captured):
    """Also generates, during the step (before the update), each prompt's greedy response twice and its samples
    twice more (without the prompts' own sampling seeds, so from the rollout's generator), with settings written
    here, not the pipeline's."""

    def before_advantages(self, batch) -> None:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=self.config.sampling.max_new_tokens, n=1)
        self.greedy = [self.rollout.generate(self.prompts, greedy) for _ in range(2)]
        unseeded = self.prompts.select(None, [k for k in self.prompts.non_tensor_batch if k != SAMPLE_SEEDS], [])
        self.sampled = [self.rollout.generate(unseeded, self.config.sampling.params()) for _ in range(2)]


def run_captured(config, cls=Captured) -> Captured:
    pipeline = cls(config)
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    return pipeline


def remax_config(run_dir, **settings):
    config = mock_grpo(run_dir, num_steps=1, **settings)
    config.algorithm = AlgorithmConfig(adv_estimator="remax")
    config.reward_fn = f"{__name__}:char_sum_reward"
    return config


def greedy_scores(pipeline: Probed) -> torch.Tensor:
    """Each prompt's greedy response scored by the run's reward function, computed here, not by the pipeline."""
    texts = pipeline.tokenizer.batch_decode(pipeline.greedy[0].batch["responses"], skip_special_tokens=True)
    return torch.tensor([char_sum_reward(text, None) for text in texts])


# --- ReMax -----------------------------------------------------------------------------------------------------


def test_remax_advantages_are_the_sample_reward_minus_the_greedy_reward_of_its_prompt(tmp_path):
    config = remax_config(tmp_path)
    RLVRPipeline.dry_run(config)  # no longer refused
    pipeline = run_captured(config, Probed)
    batch, num_samples = pipeline.batch.batch, config.sampling.num_samples_per_prompt
    baseline = greedy_scores(pipeline).repeat_interleave(num_samples)  # [rows]
    assert torch.equal(batch["reward_baselines"], baseline)
    assert len(set(baseline.tolist())) > 1 and not torch.equal(batch["scores"], baseline)  # the check has teeth
    mask = batch["response_mask"].bool()
    expected = (batch["scores"] - baseline).unsqueeze(-1).expand(mask.shape)
    assert torch.allclose(batch["advantages"][mask], expected[mask]) and not batch["advantages"][~mask].any()
    record = metrics_of(tmp_path)[0]
    assert record["critic/baseline_score/mean"] == pytest.approx(float(baseline.mean()))
    assert "timing_s/gen_max" in record


def test_the_baseline_is_matched_to_rows_by_prompt_uid():
    baseline = DataProto.from_dict({"responses": torch.zeros(2, 3, dtype=torch.long)}, {"uid": np.array([11, 10])})
    rewards = DataProto.from_dict({"token_level_scores": torch.tensor([[0.0, 0.0, 2.0], [0.5, 0.0, 0.25]])})
    batch = DataProto.from_dict({"responses": torch.zeros(4, 3, dtype=torch.long)}, {"uid": np.array([10, 10, 11, 11])})
    assert baseline_per_row(baseline, rewards, batch).tolist() == [0.75, 0.75, 2.0, 2.0]  # summed token rewards


def test_the_greedy_baseline_of_a_real_model_is_deterministic_and_is_what_the_run_used(tmp_path):
    config = tiny_rlvr(tmp_path, num_steps=1, algorithm=AlgorithmConfig(adv_estimator="remax"),
                       reward_fn=f"{__name__}:char_sum_reward")
    pipeline = run_captured(config, Probed)
    params = pipeline.baseline_sampling
    assert (params.temperature, params.n, params.max_new_tokens) == (0.0, 1, config.sampling.max_new_tokens)
    assert torch.equal(*(out.batch["responses"] for out in pipeline.greedy))
    assert not torch.equal(*(out.batch["responses"] for out in pipeline.sampled))  # temperature 1, no seeds: others
    assert torch.equal(pipeline.batch.batch["reward_baselines"],
                       greedy_scores(pipeline).repeat_interleave(config.sampling.num_samples_per_prompt))


# --- dict rewards ----------------------------------------------------------------------------------------------


def test_a_dict_reward_gives_its_fields_as_columns_and_errored_rows_zero():
    batch = response_batch(["19", "x", "7a"], ["19", "19", "7"])
    out = RewardWorker(f"{__name__}:parts", on_error="zero").compute_rewards(batch)
    assert out.batch["scores"].tolist() == [1.0, 0.0, 0.0]
    assert out.batch["reward_extra/length"].tolist() == [2.0, 0.0, 2.0]
    assert out.batch["reward_extra/digit"].tolist() == [1.0, 0.0, 0.0]
    assert out.batch["reward_extra/length"].dtype == torch.float32
    assert out.meta_info["metrics"]["reward/num_errors"] == 1
    assert set(RewardWorker("exact_match").compute_rewards(batch).batch) == {"scores", "token_level_scores"}


def test_a_field_missing_on_a_row_names_the_function_the_row_and_the_field():
    with pytest.raises(RewardError) as info:
        RewardWorker(f"{__name__}:parts_missing_on_7").compute_rewards(response_batch(["1", "2", "7"], ["1"] * 3))
    message = str(info.value)
    assert f"reward function '{__name__}:parts_missing_on_7' returned the fields [] on row 2" in message
    assert "it lacks 'length'" in message and "on row 2 of the batch" in message and "response:     '7'" in message


@pytest.mark.parametrize("fn, says", [("parts_without_score", "returned a dict without a 'score' key"),
                                      ("parts_with_text", "returned field 'note' '1' (a str)")])
def test_a_dict_reward_needs_a_score_and_numbers(fn, says):
    with pytest.raises(RewardError, match=rf"'{__name__}:{fn}' {re.escape(says)}"):
        RewardWorker(f"{__name__}:{fn}").compute_rewards(response_batch(["1"], ["1"]))


def test_the_loop_logs_the_mean_of_each_reward_field(tmp_path):
    config = mock_grpo(tmp_path, num_steps=2)
    config.reward_fn = f"{__name__}:two_parts"
    pipeline = run_captured(config)
    texts = pipeline.tokenizer.batch_decode(pipeline.batch.batch["responses"], skip_special_tokens=True)
    fields = [two_parts(t, None) for t in texts]
    record = metrics_of(tmp_path)[-1]
    assert record["reward/long/mean"] == pytest.approx(np.mean([f["long"] for f in fields]))
    assert record["reward/odd/mean"] == pytest.approx(np.mean([f["odd"] for f in fields]))
    assert 0 < record["reward/long/mean"] < 1 or 0 < record["reward/odd/mean"] < 1  # not a constant field
    assert "val/reward/long/mean" in record


# --- GDPO ------------------------------------------------------------------------------------------------------


def test_gdpo_normalises_each_component_within_its_group():
    # Two prompts of three one-token responses; format and correct, weighted 1 and 2.
    mask = torch.tensor([[1, 0]] * 6)
    data = {"reward_extra/format": torch.tensor([1.0, 1, 0, 1, 1, 1]),
            "reward_extra/correct": torch.tensor([1.0, 0, 0, 0, 1, 0]), "response_mask": mask}
    components = reward_components(data, ["format", "correct"], "my_reward")
    assert components.shape == (6, 2)
    advantages, _ = compute_advantages("gdpo", token_level_rewards=torch.zeros(6, 2), response_mask=mask,
                                       index=np.array([0, 0, 0, 1, 1, 1]), reward_components=components,
                                       reward_weights=[1.0, 2.0])
    # By hand, in units of 1/sqrt(3): format → group 0 (1, 1, -2), group 1 all equal → 0;
    # correct → group 0 (2, -1, -1), group 1 (-1, 2, -1). Weighted sum: (5, -1, -4, -2, 4, -2), mean 0,
    # unbiased variance 66/5 in these units; whitened: v / sqrt(13.2).
    expected = torch.tensor([5.0, -1, -4, -2, 4, -2]) / math.sqrt(13.2)
    assert torch.allclose(advantages[:, 0], expected, rtol=1e-4) and not advantages[:, 1].any()


def test_gdpo_in_the_loop_uses_the_reward_fields_named_by_gdpo_reward_keys(tmp_path):
    config = mock_grpo(tmp_path, num_steps=1)
    config.sampling.num_samples_per_prompt = 4
    config.reward_fn = f"{__name__}:two_parts"
    config.algorithm = AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=["odd", "long"],
                                       gdpo_reward_weights=[0.5, 2.0])
    batch = run_captured(config).batch
    data = batch.batch
    advantages, _ = compute_advantages("gdpo", token_level_rewards=data["token_level_scores"],
                                       response_mask=data["response_mask"], index=batch.non_tensor_batch["uid"],
                                       reward_components=torch.stack([data["reward_extra/odd"],
                                                                      data["reward_extra/long"]], -1),
                                       reward_weights=[0.5, 2.0])
    assert torch.allclose(data["advantages"], advantages) and data["advantages"].abs().sum() > 0
    unweighted, _ = compute_advantages("gdpo", token_level_rewards=data["token_level_scores"],
                                       response_mask=data["response_mask"], index=batch.non_tensor_batch["uid"])
    assert not torch.allclose(data["advantages"], unweighted)  # not the summed score as one component


def test_a_gdpo_key_the_reward_does_not_return_names_it_and_the_fields_returned(tmp_path):
    config = mock_grpo(tmp_path, num_steps=1)
    config.reward_fn = "exact_match_parts"
    config.algorithm = AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=["format", "length"])
    with pytest.raises(RewardError, match=r"gdpo_reward_keys names 'length', which reward function "
                                          r"'exact_match_parts' does not return; the fields it returned beside "
                                          r"'score': \['correct', 'format'\]"):
        run_pipeline(RLVRPipeline, config)


@pytest.mark.parametrize("algorithm, says", [
    (AlgorithmConfig(adv_estimator="grpo", gdpo_reward_keys=["format"]),
     "gdpo_reward_keys is set, but algorithm.adv_estimator 'grpo' takes no reward components; use an estimator that "
     "does (gdpo), or unset gdpo_reward_keys"),
    (AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_weights=[1.0]), "gdpo_reward_keys, which is unset"),
    (AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=["a", "b"], gdpo_reward_weights=[1.0]),
     "gdpo_reward_weights has 1 entries for the 2 gdpo_reward_keys"),
    (AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=[]), "gdpo_reward_keys is empty"),
])
def test_the_gdpo_settings_are_checked_before_the_run(tmp_path, algorithm, says):
    config = mock_grpo(tmp_path)
    config.algorithm = algorithm
    with pytest.raises(ConfigError, match=re.escape(says)):
        RLVRPipeline.dry_run(config)


def test_the_shipped_parts_reward_scores_exact_match_with_format_and_correct():
    out = RewardWorker("exact_match_parts").compute_rewards(response_batch(["42", "41", "4 2"], ["42", "42", "42"]))
    assert out.batch["scores"].tolist() == [1.0, 0.0, 0.0]
    assert out.batch["reward_extra/format"].tolist() == [1.0, 1.0, 0.0]
    assert out.batch["reward_extra/correct"].tolist() == [1.0, 0.0, 0.0]
