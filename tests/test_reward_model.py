"""Model-judged rewards: a scalar reward model (a value-head model's value at the last response token) and a
generative judge (template, greedy answer, parse function), each checked against a direct computation, and RLVR
training two steps with each, its score the reward function's plus the weighted model score."""

from __future__ import annotations

import pytest
import torch

from baton.config import ConfigError
from baton.datasets import collate_prompts
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import (DataConfig, RewardModelSettings, RLVRConfig, RoleConfig, SamplingConfig,
                                    TrainerConfig)
from baton.pipelines.rlvr import RLVRPipeline
from baton.datasets.load import load_datasets
from baton.strategy import SamplingParams, StrategyConfig, create_strategy
from baton.tracking import run_metrics
from baton.workers.reward_model import JudgeWorker, RewardModelWorker, first_number, last_token_values

THIS = "test_reward_model"
VALUE = StrategyConfig(model="tiny-qwen2", kind="value", seed=3)
JUDGED: list[str] = []  # what the recording parse function saw


def length_score(text: str) -> float:
    """A parse function for the tests: records the judge's answer, scores its length."""
    JUDGED.append(text)
    return float(len(text))


def generated_batch(num_prompts=3, n=2):
    train, _, tokenizer = load_datasets(DataConfig(max_operand=9, num_val_examples=4), None)
    prompts = collate_prompts(train, range(num_prompts), tokenizer, 64)
    policy = create_strategy(StrategyConfig(model="tiny-qwen2", seed=0))
    return policy.generate(prompts, SamplingParams(n=n, max_new_tokens=4, seed=0)), tokenizer


def test_first_number_and_last_token_values():
    assert first_number("score: 0.75 of 1") == 0.75 and first_number("-2") == -2.0
    with pytest.raises(ValueError, match="no number"):
        first_number("good")
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert last_token_values(values, mask).tolist() == [2.0, 6.0, 0.0]


def test_the_scalar_reward_model_scores_each_response_at_its_last_token():
    batch, _ = generated_batch()
    scores = RewardModelWorker(VALUE).score(batch).batch["rm_scores"]
    values = create_strategy(VALUE).forward(batch).batch["values"]  # the same weights (seed), computed directly
    lengths = batch.batch["response_mask"].sum(-1)
    assert torch.allclose(scores, values[torch.arange(len(batch)), lengths - 1])
    with pytest.raises(ValueError, match="set reward_model.strategy.kind=value"):
        RewardModelWorker(StrategyConfig(model="tiny-qwen2"))


def test_the_judge_renders_the_template_answers_greedily_and_parses():
    batch, tokenizer = generated_batch(num_prompts=2, n=1)
    judge = JudgeWorker(StrategyConfig(model="tiny-qwen2", seed=1), "Q{prompt}A{response}T{ground_truth}=",
                        f"{THIS}:length_score", max_new_tokens=3, max_score=100.0)
    texts = judge.render(batch)
    responses = tokenizer.batch_decode(batch.batch["responses"] * batch.batch["response_mask"], skip_special_tokens=True)
    boundary = texts[0].split("<response ", 1)[1].split(">", 1)[0]  # random, one per call
    assert texts == [f"Q{p}A<response {boundary}>\n{r}\n</response {boundary}>T{t}="
                     for p, r, t in zip(batch.non_tensor_batch["prompt"], responses, batch.non_tensor_batch["ground_truth"])]
    JUDGED.clear()
    scored = judge.score(batch)
    assert list(scored.non_tensor_batch["judge_answer"]) == JUDGED and len(JUDGED) == 2
    assert scored.batch["rm_scores"].tolist() == [float(len(a)) for a in JUDGED]
    assert judge.score(batch).batch["rm_scores"].tolist() == scored.batch["rm_scores"].tolist()  # greedy
    unparsed = JudgeWorker(StrategyConfig(model="tiny-qwen2", seed=1), "{response}", f"{THIS}:never_parses", 3)
    result = unparsed.score(batch)
    assert result.batch["rm_scores"].tolist() == [0.0, 0.0] and result.meta_info["metrics"] == {
        "reward_model/num_unparsed": 2, "reward_model/judge/num_unparsed": 2, "reward_model/judge/num_out_of_range": 0}


def never_parses(text: str) -> float:
    raise ValueError("unparseable")


def length_reward(response: str, ground_truth: str, **fields) -> dict[str, float]:
    """A reward function that is not 0 on the untrained model; its score is logged again as reward/length/mean."""
    length = 1.0 + len(response.strip())
    return {"score": length, "length": length}


def tiny(run_dir, reward_model, settings=None, **fields) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"))
    return RLVRConfig(actor=role, rollout=role, colocate_actor_rollout=True, reward_model=reward_model,
                      reward_model_settings=settings or RewardModelSettings(),
                      data=DataConfig(max_operand=9, num_val_examples=4),
                      sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                      trainer=TrainerConfig(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, num_steps=2,
                                            val_every_steps=2, save_every_steps=2, progress_bar=False), **fields)


@pytest.mark.parametrize("kind", ["scalar", "generative"])
def test_rlvr_trains_on_the_reward_function_plus_the_weighted_model_score(tmp_path, kind):
    if kind == "scalar":
        config = tiny(tmp_path, RoleConfig(strategy=VALUE), RewardModelSettings(weight=0.5),
                      reward_fn=f"{THIS}:length_reward")
    else:
        config = tiny(tmp_path, RoleConfig(strategy=StrategyConfig(model="tiny-qwen2")),
                      RewardModelSettings(type="generative", weight=0.5, parse_fn=f"{THIS}:length_score",
                                          max_new_tokens=2, max_score=100.0), reward_fn=f"{THIS}:length_reward")
    run_pipeline(RLVRPipeline, config)
    last = run_metrics(str(tmp_path))[2]
    assert "actor/pg_loss" in last
    assert last["reward/length/mean"] >= 1.0  # the reward function's term, not 0
    assert last["critic/score/mean"] == pytest.approx(last["reward/length/mean"] + 0.5 * last["reward_model/score/mean"],
                                                      abs=1e-5)
    low, mean, high = (last[f"reward_model/score/{k}"] for k in ("min", "mean", "max"))
    assert low <= mean <= high and last["reward_model/score/std"] >= 0
    if kind == "generative":  # an answer's length, within [min_score, max_score]
        assert 0 <= low and high <= 100


def test_reward_model_settings_are_checked():
    with pytest.raises(ConfigError, match="reward_model.strategy.kind is 'causal_lm', but a scalar reward model"):
        RLVRPipeline.dry_run(tiny("unused", RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"))))
    with pytest.raises(ValueError, match=r"template must contain \{response\}"):
        RewardModelSettings(template="no slot")
    with pytest.raises(ValueError, match="type 'pairwise' is not one of"):
        RewardModelSettings(type="pairwise")
