"""Validation with several samples per prompt: mean@n, std@n, exact best@k / worst@k (pass@k), verl's bootstrapped
maj@k, grouped by data source and prompt and named as verl logs them; in an RLVR run and in `baton eval`."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from baton.cli import main
from baton.data import DataProto
from baton.datasets import PromptDataset
from baton.models import load_tokenizer
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.policy import validate
from baton.pipelines.rlvr import RLVRPipeline
from baton.rl.val_metrics import (
    expected_best,
    expected_worst,
    majority_draws,
    pass_at_k,
    prompt_metrics,
    sample_sizes,
    validation_metrics,
)
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.mock import MockStrategy
from baton.tracking.plot import choose_panels
from baton.tracking.tracker import read_metrics


def test_sample_sizes_are_verls_powers_of_two_then_n():
    assert [sample_sizes(n) for n in (1, 2, 3, 4, 5, 8, 12)] == [
        [], [2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 8], [2, 4, 8, 12]]


def test_mean_and_std_over_a_prompts_samples():
    metrics = prompt_metrics({"reward": np.array([0.2, 0.5, 0.8])})["reward"]
    assert metrics["mean@3"] == pytest.approx(0.5)
    assert metrics["std@3"] == pytest.approx(math.sqrt(0.06))  # numpy's std, ddof 0: (0.09 + 0 + 0.09) / 3
    assert "maj@2/mean" not in metrics  # no votes, no maj@k
    assert prompt_metrics({"reward": np.array([0.7])}) == {"reward": {"mean@1": pytest.approx(0.7)}}  # n = 1


@pytest.mark.parametrize("n", [1, 4, 7])
def test_best_of_k_of_a_0_1_score_is_the_unbiased_pass_at_k(n):
    for correct, k in itertools.product(range(n + 1), range(1, n + 1)):
        values = np.array([1.0] * correct + [0.0] * (n - correct))
        closed_form = 1 - math.comb(n - correct, k) / math.comb(n, k)  # Chen et al. 2021
        assert expected_best(values, k) == pytest.approx(closed_form)
    assert expected_best(np.array([0.0, 1.0, 0.0, 0.0]), 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6


def test_best_and_worst_of_k_of_a_graded_score_over_every_subset():
    values = np.array([0.1, 0.7, 0.4, 0.9])
    # The six pairs' maxima are .7 .4 .9 .7 .9 .9 and minima .1 .1 .1 .4 .7 .4.
    assert expected_best(values, 2) == pytest.approx(4.5 / 6)
    assert expected_worst(values, 2) == pytest.approx(1.8 / 6)
    assert expected_best(values, 4) == pytest.approx(0.9)  # k = n: the best sample (the only subset)
    assert expected_best(values, 1) == expected_worst(values, 1) == pytest.approx(values.mean())
    assert expected_worst(np.array([1.0, 1.0, 0.0]), 2) == pytest.approx(1 / 3)  # ties: minima 1, 0, 0
    with pytest.raises(ValueError, match="k=5 of 4"):
        expected_best(values, 5)


def test_majority_vote_draws_are_verls_and_a_tie_goes_to_the_answer_drawn_first():
    draws = np.random.RandomState(42).choice(2, size=(1000, 2), replace=True)  # verl: np.random.seed(42); choice
    assert (majority_draws(["x", "y"], 2) == draws[:, 0]).all()  # two answers, two draws: a tie or the same twice

    draws = np.random.RandomState(42).choice(3, size=(1000, 3), replace=True)
    values = np.array([1.0, 1.0, 0.0])
    maj = values[majority_draws(["a", "a", "b"], 3)]
    assert (maj == ((draws == 2).sum(1) <= 1)).all()  # "b" (sample 2) wins only when drawn twice or more
    assert maj.mean() == pytest.approx(20 / 27, abs=0.05)  # P(at most one "b" in 3 draws with p = 1/3)


def test_maj_at_k_of_four_samples_keeps_its_recorded_values():
    # Recorded as verl's bootstrap_metric(..., reduce_fns=[calc_maj_val]) on these four samples (verl is not installed
    # here to rerun it); test_maj_at_k_equals_a_draw_by_draw_reference_on_random_prompts checks the semantics.
    metrics = prompt_metrics({"reward": np.array([1.0, 0.0, 1.0, 0.0])}, votes=["a", "b", "a", "c"])["reward"]
    assert (metrics["maj@2/mean"], metrics["maj@2/std"]) == pytest.approx((0.513, 0.49983097))
    assert (metrics["maj@4/mean"], metrics["maj@4/std"]) == pytest.approx((0.598, 0.49030195))


def bootstrap_majority_reference(values: list[float], votes: list, k: int, num_draws: int = 1000,
                                 seed: int = 42) -> tuple[float, float]:
    """verl's documented maj@k, written out one draw at a time as an independent check of the vectorised code: with
    numpy's generator seeded (seed 42), each of `num_draws` draws picks k sample indices with replacement; the vote
    groups the drawn samples by answer, the answer with the most samples wins (on a tie, the answer first seen in
    the draw), and the draw's value is the value of the first drawn sample with that answer. Returns the mean and
    the (population) standard deviation of the draws' values."""
    rng = np.random.RandomState(seed)
    results = []
    for _ in range(num_draws):
        picked = rng.choice(len(values), size=k, replace=True)
        by_answer: dict = {}
        for index in picked:
            by_answer.setdefault(votes[index], []).append(values[index])
        top = max(len(group) for group in by_answer.values())
        winner = next(answer for answer, group in by_answer.items() if len(group) == top)
        results.append(by_answer[winner][0])
    return float(np.mean(results)), float(np.std(results))


def test_maj_at_k_equals_a_draw_by_draw_reference_on_random_prompts():
    rng = np.random.default_rng(0)
    num_checked = 0
    for _ in range(40):
        n = int(rng.integers(2, 9))
        votes = [str(v) for v in rng.integers(0, int(rng.integers(1, 4)) + 1, size=n)]  # 1 to 4 answers: ties happen
        values = rng.random(n).round(3)
        metrics = prompt_metrics({"score": values}, votes=votes)["score"]
        for k in sample_sizes(n):
            mean, std = bootstrap_majority_reference(list(values), votes, k)
            assert metrics[f"maj@{k}/mean"] == pytest.approx(mean, rel=1e-12, abs=1e-12), (votes, values, k)
            assert metrics[f"maj@{k}/std"] == pytest.approx(std, rel=1e-12, abs=1e-12), (votes, values, k)
            num_checked += 1
    assert num_checked > 80


def test_grouped_by_data_source_and_uid_with_uneven_groups_and_verls_core_split():
    sources = ["a", "b", "a", "b", "b", "a"]
    uids = [0, 1, 0, 1, 1, 2]  # a: prompt 0 (2 samples) and 2 (1 sample); b: prompt 1 (3 samples)
    reward = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    votes = ["p", "q", "p", "r", "r", "p"]
    logged = validation_metrics({"reward": reward}, uids, sources, votes)
    assert logged["val-core/a/reward/mean@2"] == pytest.approx(0.5)
    assert logged["val-aux/a/reward/mean@1"] == pytest.approx(0.5)  # prompt 2 alone; not at a's largest n
    assert logged["val-core/b/reward/mean@3"] == pytest.approx(2 / 3)
    assert logged["val-aux/b/reward/std@3"] == pytest.approx(np.std([0.0, 1.0, 1.0]))
    assert logged["val-core/b/reward/best@3/mean"] == 1.0 and logged["val-aux/b/reward/worst@3/mean"] == 0.0
    assert logged["val-aux/b/reward/best@2/mean"] == pytest.approx(1.0)  # every pair holds a 1
    assert logged["val-aux/b/reward/worst@2/mean"] == pytest.approx(1 / 3)
    assert logged["val-core/a/reward/maj@2/mean"] == pytest.approx(0.5, abs=0.06)  # a tie: the first drawn's score
    core = {key for key in logged if key.startswith("val-core/")}
    assert core == {f"val-core/a/reward/{m}" for m in ("mean@2", "best@2/mean", "maj@2/mean", "maj@2/std")} \
        | {f"val-core/b/reward/{m}" for m in ("mean@3", "best@3/mean", "maj@3/mean", "maj@3/std")}
    assert {key.removeprefix("val-aux/b/reward/") for key in logged if key.startswith("val-aux/b/")} == {
        "std@3", "best@2/mean", "worst@2/mean", "worst@3/mean", "maj@2/mean", "maj@2/std"}

    with_acc = validation_metrics({"reward": reward, "acc": reward >= 1}, uids, sources)
    assert with_acc["val-core/b/acc/mean@3"] == pytest.approx(2 / 3)  # "acc", when there is one, is the core variable
    assert "val-aux/b/reward/mean@3" in with_acc and not any(k.startswith("val-core/b/reward") for k in with_acc)


def test_one_sample_per_prompt_and_rows_without_a_data_source():
    logged = validation_metrics({"reward": np.array([1.0, 0.0, 1.0])}, [0, 1, 2], votes=["1", "2", "3"])
    assert logged == {"val-core/unknown/reward/mean@1": pytest.approx(2 / 3)}  # verl: only mean@1


def test_pass_at_k_averages_over_prompts():
    correct = np.array([1, 0, 0, 0, 1, 1, 0, 0])
    uids = [0] * 4 + [1] * 4
    assert pass_at_k(correct, uids, 2) == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    assert pass_at_k(correct, uids, 4) == 1.0 and pass_at_k(correct, uids, 1) == pytest.approx(3 / 8)


def test_the_plot_draws_pass_at_the_largest_n_beside_accuracy():
    logged = [{"step": 0, "val/accuracy": 0.1, "val/pass@2": 0.2, "val/pass@4": 0.3, "critic/score/mean": 0.1}]
    assert dict(choose_panels({"run": logged}))["validation accuracy"] == ["val/accuracy", "val/pass@4"]


class AnswerReward:
    """A dict reward's columns, as the reward worker writes them: each row's answer `pred` (7, 7, 7, 5 for a
    prompt's four samples), scored 1 for the answer 7, and "acc" the same."""

    def __init__(self, with_pred: bool):
        self.with_pred = with_pred

    def compute_rewards(self, batch: DataProto) -> DataProto:
        preds = np.array(["7", "7", "7", "5"] * (len(batch) // 4), dtype=object)
        scores = torch.tensor(preds == "7", dtype=torch.float32)
        texts = np.array([f" answer {i} " for i in range(len(batch))], dtype=object)  # every sample a different text
        non_tensors = {"response_text": texts, **({"reward_extra/pred": preds} if self.with_pred else {})}
        tensors = {"scores": scores, "token_level_scores": scores[:, None], "reward_extra/acc": scores}
        return DataProto.from_dict(tensors, non_tensors)


@pytest.mark.parametrize("with_pred", [True, False])
def test_validate_votes_over_pred_else_over_the_stripped_response(with_pred):
    data = PromptDataset([{"prompt": "1+6=", "answer": "7", "data_source": "gsm"}, {"prompt": "2+5=", "answer": "7"}])
    tokenizer = load_tokenizer()
    logged = validate(MockStrategy(StrategyConfig(name="mock")), AnswerReward(with_pred), data, tokenizer,
                      SamplingConfig(temperature=1.0, max_new_tokens=3, num_samples_per_prompt=4), 64)
    scores = np.array([1.0, 1.0, 1.0, 0.0])
    votes = ["7", "7", "7", "5"] if with_pred else [f"answer {i}" for i in range(4)]  # prompt 1's rows
    assert logged["val-core/gsm/acc/maj@4/mean"] == pytest.approx(scores[majority_draws(votes, 4)].mean())
    assert logged["val-core/gsm/acc/mean@4"] == logged["val-core/unknown/acc/mean@4"] == 0.75  # no data_source: verl's
    assert logged["val-aux/gsm/reward/best@4/mean"] == 1.0  # acc is the core variable, the score goes to val-aux
    assert (logged["val/accuracy"], logged["val/pass@2"], logged["val/pass@4"]) == (0.75, 1.0, 1.0)
    assert logged["val/reward/acc/mean"] == 0.75  # baton's own figures stay


# --- in a run and in `baton eval` ----------------------------------------------------------------------------------

SCORED: list[tuple[str, int, float]] = []  # (data_source, uid, score) of each held-out row the reward scored


def graded_reward(response: str, ground_truth: str, data_source: str, split: str, uid, **fields) -> float:
    """0, 0.5 or 1 by the response's length: varies between an untrained model's samples."""
    score = (len(response.strip()) % 3) / 2
    if split == "val":
        SCORED.append((data_source, int(uid), score))
    return score


def write_rows(path, split: str, num_rows: int) -> str:
    sources = ["math", "logic"]
    rows = [{"prompt": f"{i}+{i % 3}=", "answer": str(i + i % 3), "data_source": sources[i % 2], "split": split}
            for i in range(num_rows)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One GRPO step of tiny-qwen2 on a file with two data sources, validated with 4 samples per prompt at
    temperature 1 (5 held-out prompts: 3 of "math", 2 of "logic") and saved."""
    root = tmp_path_factory.mktemp("val")
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3)))
    data = DataConfig(task="files", train_path=write_rows(root / "train.jsonl", "train", 8),
                      val_path=write_rows(root / "val.jsonl", "val", 5))
    config = RLVRConfig(actor=role, rollout=role, data=data, reward_fn=f"{__name__}:graded_reward",
                        sampling=SamplingConfig(max_new_tokens=4, num_samples_per_prompt=4),
                        val_sampling=SamplingConfig(temperature=1.0, max_new_tokens=4, num_samples_per_prompt=4),
                        trainer=TrainerConfig(backend="local", run_dir=str(root / "rlvr"), num_steps=1,
                                              num_prompts_per_step=4, val_before_train=False, progress_bar=False))
    SCORED.clear()
    run_pipeline(RLVRPipeline, config)
    scored = list(SCORED)
    SCORED.clear()
    return root / "rlvr", read_metrics(str(root / "rlvr" / "metrics.jsonl"))[-1], scored


def test_a_run_logs_verls_metrics_of_each_data_source(run):
    _, logged, scored = run
    assert len(scored) == 5 * 4
    for source in ("math", "logic"):
        by_prompt: dict[int, list[float]] = {}
        for s, uid, score in scored:
            if s == source:
                by_prompt.setdefault(uid, []).append(score)
        assert len(by_prompt) == (3 if source == "math" else 2) and all(len(v) == 4 for v in by_prompt.values())
        core, aux = f"val-core/{source}/reward", f"val-aux/{source}/reward"
        assert logged[f"{core}/mean@4"] == pytest.approx(np.mean([s for v in by_prompt.values() for s in v]))
        assert logged[f"{core}/best@4/mean"] == pytest.approx(np.mean([max(v) for v in by_prompt.values()]))
        assert logged[f"{aux}/worst@4/mean"] == pytest.approx(np.mean([min(v) for v in by_prompt.values()]))
        assert logged[f"{aux}/worst@4/mean"] <= logged[f"{core}/maj@4/mean"] <= logged[f"{core}/best@4/mean"]
        assert f"{aux}/best@2/mean" in logged and f"{aux}/std@4" in logged
    assert logged["val/reward/mean"] == pytest.approx(np.mean([s for _, _, s in scored]))
    prompts = Counter()
    for source, uid, score in scored:
        prompts[uid] = max(prompts[uid], int(score >= 1))
    assert logged["val/pass@4"] == pytest.approx(sum(prompts.values()) / 5)  # k = n: a prompt with any correct sample
    assert logged["val/accuracy"] <= logged["val/pass@2"] <= logged["val/pass@4"]


def test_eval_reports_the_runs_pass_at_k_and_val_core_metrics(run, capsys):
    run_dir, logged, _ = run
    assert main(["eval", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_samples_per_prompt"] == 4 and result["temperature"] == 1.0  # the run's val_sampling
    assert (result["pass@2"], result["pass@4"]) == (logged["val/pass@2"], logged["val/pass@4"])  # the same samples
    assert result["val-core"] == {key.removeprefix("val-core/"): value for key, value in logged.items()
                                  if key.startswith("val-core/")}
    assert main(["eval", str(run_dir), "--num-samples", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert "pass@2" in two and "pass@4" not in two and "math/reward/mean@2" in two["val-core"]
    SCORED.clear()
