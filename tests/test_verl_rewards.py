"""Coming from verl: reward functions with verl's compute_score signature, rewards routed by data_source, the
math-verify reward, scoring in processes with a per-row time limit, DAPO's overlong penalty, verl's "pred" field."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from baton.config import ConfigError, load_config
from baton.distributed import Cluster, WorkerConfig, WorkerSpec
from baton.pipelines.config import OverlongBufferConfig, RewardSettings, RLVRConfig, SFTConfig
from baton.rewards import (RewardError, RewardRoutes, ScoringPool, ScoringProcessError, math_reward, math_verify_reward,
                           overlong_penalty, score_rows, uses_verl_signature)
from baton.workers import RewardWorker
from test_data_validation import response_batch
from test_pipeline_paths import metrics_of
from test_remax_gdpo import run_captured
from test_run_ux import mock_grpo

CALLS: list[dict] = []  # what verl_score was called with, in this process


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature without **kwargs: any further keyword would be a TypeError."""
    CALLS.append(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info))
    correct = float(solution_str.strip() == ground_truth)
    return {"score": correct + extra_info.get("bonus", 0.0), "acc": correct, "pred": solution_str.strip()}


def verl_raises(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 / len(solution_str.strip("x"))


def verl_needs_more(data_source, solution_str, ground_truth, extra_info, tolerance):
    return 0.0


def length_score(response: str, ground_truth: str, **fields) -> dict:
    return {"score": float(len(response)), "length": float(len(response))}


# The rewards scored in processes live in a module of their own: a scoring process imports the module of its reward
# function, and this one imports torch and the pipelines (seconds per process on two cores).
POOL_REWARDS = """
import os
import time


def sleeps_on_zzz(response, ground_truth, **fields):
    if response == "zzz":
        time.sleep(3600)
    return float(response == ground_truth) + len(response) / 10


def exits_on_boom(response, ground_truth, **fields):
    if response == "boom":
        os._exit(3)
    return 1.0


def raises_on_x(response, ground_truth, **fields):
    if "x" in response:
        raise ValueError("no x here")
    return {"score": 1.0, "length": float(len(response)), "pred": response}


def verl_acc(data_source, solution_str, ground_truth, extra_info=None):
    correct = float(solution_str.strip() == ground_truth)
    return {"score": correct + extra_info.get("bonus", 0.0), "acc": correct, "pred": solution_str.strip()}
"""


@pytest.fixture(scope="module", autouse=True)
def pool_rewards(tmp_path_factory):
    """POOL_REWARDS importable as `poolrewards`, here and in the scoring processes (they take this sys.path)."""
    directory = tmp_path_factory.mktemp("pool_rewards")
    (directory / "poolrewards.py").write_text(POOL_REWARDS)
    sys.path.insert(0, str(directory))
    yield
    sys.path.remove(str(directory))


# --- verl's signature --------------------------------------------------------------------------------------------


def test_a_verl_compute_score_gets_verls_four_keywords_and_only_those():
    CALLS.clear()
    batch = response_batch(["42", "41"], ["42", "42"], data_source=["openai/gsm8k", "openai/gsm8k"],
                           extra_info=[{"bonus": 0.5}, {"split": "train"}], reward_model=[{"style": "rule"}] * 2,
                           uid=["a", "b"])
    out = RewardWorker(f"{__name__}:verl_score").compute_rewards(batch)
    assert out.batch["scores"].tolist() == [1.5, 0.0]
    assert out.batch["reward_extra/acc"].tolist() == [1.0, 0.0]
    assert list(out.non_tensor_batch["reward_extra/pred"]) == ["42", "41"]
    assert CALLS == [dict(data_source="openai/gsm8k", solution_str="42", ground_truth="42", extra_info={"bonus": 0.5}),
                     dict(data_source="openai/gsm8k", solution_str="41", ground_truth="42",
                          extra_info={"split": "train"})]


def test_a_verl_compute_score_on_rows_without_data_source_or_extra_info():
    CALLS.clear()
    RewardWorker(f"{__name__}:verl_score").compute_rewards(response_batch(["7"], ["7"]))
    assert CALLS == [dict(data_source="unknown", solution_str="7", ground_truth="7", extra_info={})]


def solution_first(solution_str, ground_truth, **kwargs):
    return float(solution_str == ground_truth) + 10 * float(kwargs["data_source"] == "b")


def test_the_signature_decides_the_convention():
    assert uses_verl_signature(verl_score) and uses_verl_signature(verl_raises)
    assert not uses_verl_signature(math_reward) and not uses_verl_signature(length_score)
    assert not uses_verl_signature(solution_first)  # no data_source: baton's convention serves it as it is
    out = RewardWorker(f"{__name__}:solution_first").compute_rewards(response_batch(["1", "2"], ["1", "1"],
                                                                                    data_source=["a", "b"]))
    assert out.batch["scores"].tolist() == [1.0, 10.0]


def test_a_raising_verl_function_is_named_with_its_row():
    batch = response_batch(["12", "xx"], ["12", "12"], data_source=["gsm8k", "math"])
    with pytest.raises(RewardError) as info:
        RewardWorker(f"{__name__}:verl_raises").compute_rewards(batch)
    message = str(info.value)
    assert f"reward function '{__name__}:verl_raises' raised ZeroDivisionError" in message
    assert "on row 1 of the batch" in message and "data_source:  'math'" in message and "response:     'xx'" in message


def test_a_verl_function_that_needs_more_than_verl_passes_is_refused():
    with pytest.raises(ValueError, match="requires 'tolerance', which verl does not pass"):
        RewardWorker(f"{__name__}:verl_needs_more").compute_rewards(response_batch(["1"], ["1"]))


# --- routing by data_source -------------------------------------------------------------------------------------


def test_rows_are_scored_by_their_data_sources_reward_and_the_default():
    routes = {"gsm8k": "exact_match", "lengths": f"{__name__}:length_score", "default": "math"}
    batch = response_batch(["12", "12 ", "abc", "so \\boxed{5}"], ["12"] * 3 + ["5"],
                           data_source=["gsm8k", "gsm8k", "lengths", "aime"])
    out = RewardWorker(routes).compute_rewards(batch)
    # exact_match: "12" yes, "12 " stripped yes; length_score: 3; math: the boxed 5
    assert out.batch["scores"].tolist() == [1.0, 1.0, 3.0, 1.0]
    assert out.batch["reward_extra/length"].tolist() == [0.0, 0.0, 3.0, 0.0]  # 0 where a function lacks the field


def test_a_data_source_without_a_reward_names_the_source_and_the_known_ones():
    batch = response_batch(["1", "2"], ["1", "2"], data_source=["gsm8k", "olympiad"])
    with pytest.raises(RewardError) as info:
        RewardWorker({"gsm8k": "exact_match", "math": "math"}, on_error="zero").compute_rewards(batch)
    message = str(info.value)
    assert "no reward for data_source 'olympiad': reward_fn maps ['gsm8k', 'math']" in message
    assert "'default'" in message and "on row 1 of the batch" in message
    with pytest.raises(RewardError, match="the row has no 'data_source' column"):
        RewardWorker({"gsm8k": "exact_match"}).compute_rewards(response_batch(["1"], ["1"]))


def test_the_config_takes_a_mapping_or_a_name_and_checks_every_entry(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("reward_fn:\n  openai/gsm8k: math_verify\n  default: exact_match\n"
                    "reward: {num_processes_per_worker: 2, timeout_s_per_row: 5}\noverlong_buffer: {len: 2}\n")
    config = load_config(RLVRConfig, path)
    assert config.reward_fn == {"openai/gsm8k": "math_verify", "default": "exact_match"}
    assert (config.reward.num_processes_per_worker, config.reward.timeout_s_per_row) == (2, 5.0)
    assert config.overlong_buffer == OverlongBufferConfig(len=2, penalty_factor=1.0)
    config.check()
    assert load_config(RLVRConfig, None, ["reward_fn=math"]).reward_fn == "math"
    assert load_config(RLVRConfig, None, ["reward_fn={gsm8k: math}"]).reward_fn == {"gsm8k": "math"}
    assert load_config(SFTConfig, None, ["reward_fn={gsm8k: math}"]).reward_fn == {"gsm8k": "math"}
    with pytest.raises(ConfigError, match="'reward_fn.gsm8k': expected str, got int 3"):
        load_config(RLVRConfig, None, ["reward_fn={gsm8k: 3}"])
    config.reward_fn = {"gsm8k": "math", "default": "exact_macth"}
    with pytest.raises(ConfigError, match=r"reward_fn: entry 'default': unknown reward 'exact_macth'"):
        config.check()
    config.reward_fn = {}
    with pytest.raises(ConfigError, match="reward_fn: the mapping from data_source to reward is empty"):
        config.check()


def test_reward_settings_and_the_overlong_buffer_are_checked():
    with pytest.raises(ConfigError, match=r"'reward': timeout_s_per_row=5.0 needs num_processes_per_worker >= 1"):
        load_config(RLVRConfig, None, ["reward.timeout_s_per_row=5"])
    with pytest.raises(ValueError, match="timeout_s_per_row must be > 0"):
        RewardSettings(num_processes_per_worker=1, timeout_s_per_row=0)
    config = load_config(RLVRConfig, None, ["overlong_buffer.len=8", "sampling.max_new_tokens=8"])
    with pytest.raises(ConfigError, match="overlong_buffer.len=8 must be below sampling.max_new_tokens=8"):
        config.check()
    with pytest.raises(ConfigError, match="len must be >= 0"):
        load_config(RLVRConfig, None, ["overlong_buffer.len=-1"])


# --- math-verify ------------------------------------------------------------------------------------------------

# (ground truth, response, whether the response is right)
EQUIVALENCES = [
    ("1/2", "The answer is 0.5", True),                        # fraction gold, decimal answer
    ("0.75", "\\boxed{\\frac{3}{4}}", True),                   # decimal gold, \frac answer
    ("\\frac{1}{2}", "so the answer is 1/2", True),            # \frac vs a/b
    ("-\\frac{1}{3}", "\\boxed{-1/3}", True),
    ("\\dfrac{3}{4}", "\\boxed{0.75}", True),
    ("42", "so \\boxed{42}", True),
    ("7", "The answer is $7$.", True),                         # $...$
    ("$\\frac{2}{3}$", "\\boxed{2/3}", True),                  # a LaTeX gold in $...$
    ("5", "The length is \\boxed{5 \\text{ cm}}", True),       # units
    ("5 cm", "It is 5 cm.", True),
    ("25\\%", "The answer is 25%.", True),                     # percentages
    ("50\\%", "\\boxed{0.5}", True),
    ("-3", "so x = -3", True),                                 # negative numbers
    ("72", "72.0", True),
    ("1000", "\\boxed{1,000}", True),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", True),
    ("2", "The answer is 2. Check: 2+2=4", True),
    ("72", "\\boxed{73}", False),                              # wrong answers
    ("1/2", "\\boxed{2}", False),
    ("3", "\\boxed{-3}", False),
    ("5", "I don't know", False),
]
MATH_VERIFY_RIGHT = 21  # of the 21: math-verify gets every one
RULE_RIGHT = {0, 5, 6, 12, 13, 14, 17, 18, 19, 20}  # the rule reward: plain numbers only, no LaTeX, units or %


def test_math_verify_gets_the_equivalences_the_rule_reward_misses():
    math_verify_right = [i for i, (gold, response, right) in enumerate(EQUIVALENCES)
                         if (math_verify_reward(response, gold)["score"] == 1.0) == right]
    rule_right = {i for i, (gold, response, right) in enumerate(EQUIVALENCES)
                  if (math_reward(response, gold) == 1.0) == right}
    assert len(math_verify_right) == MATH_VERIFY_RIGHT == len(EQUIVALENCES)
    assert rule_right == RULE_RIGHT and len(rule_right) == 10


def test_math_verify_gives_its_answer_as_pred():
    assert math_verify_reward("so \\boxed{\\frac{3}{4}}", "0.75") == {"score": 1.0, "pred": "3/4"}
    assert math_verify_reward("no answer here", "0.75") == {"score": 0.0, "pred": None}


def test_math_verify_runs_outside_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as threads:
        assert threads.submit(math_verify_reward, "\\boxed{1/2}", "0.5").result(timeout=120)["score"] == 1.0


# --- scoring in processes, with a time limit per row --------------------------------------------------------------


@pytest.fixture
def pool_of():
    pools = []

    def make(spec, num_processes=2, timeout_s_per_row=None):
        pools.append(ScoringPool(spec, num_processes, timeout_s_per_row))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


@pytest.mark.timeout(120)  # without the cut-off the sleeping row would hang here
def test_a_row_past_its_time_limit_is_cut_off_and_scored_zero(pool_of):
    responses = ["1", "zzz", "22", "3", "zzz", "4444"]
    truths = ["1", "1", "22", "9", "1", "4444"]
    columns = {"prompt": [f"p{i}" for i in range(6)]}
    pool = pool_of("poolrewards:sleeps_on_zzz", num_processes=2, timeout_s_per_row=2.0)
    result = score_rows("poolrewards:sleeps_on_zzz", responses, truths, columns, "zero", pool)
    here = score_rows("poolrewards:sleeps_on_zzz", [r for r in responses if r != "zzz"],
                      [t for r, t in zip(responses, truths) if r != "zzz"], {"prompt": ["p0", "p2", "p3", "p5"]})
    assert result.scores == [here.scores[0], 0.0, here.scores[1], here.scores[2], 0.0, here.scores[3]]
    assert result.scores == pytest.approx([1.1, 0.0, 1.2, 0.1, 0.0, 1.4])
    assert (result.num_errors, result.num_timeouts) == (2, 2)
    again = score_rows("poolrewards:sleeps_on_zzz", ["1", "22"], ["1", "22"], {}, "zero", pool)  # fresh processes
    assert again.scores == pytest.approx([1.1, 1.2]) and again.num_timeouts == 0


@pytest.mark.timeout(120)
def test_a_row_past_its_time_limit_stops_the_run_with_on_error_raise(pool_of):
    worker = RewardWorker("poolrewards:sleeps_on_zzz", num_processes=2, timeout_s_per_row=1.5)
    try:
        with pytest.raises(RewardError) as info:
            worker.compute_rewards(response_batch(["1", "2", "zzz"], ["1", "2", "3"]))
    finally:
        worker.pool.close()
    message = str(info.value)
    assert "reward function 'poolrewards:sleeps_on_zzz' timed out after 1.5 s (reward.timeout_s_per_row)" in message
    assert "on row 2 of the batch" in message and "response:     'zzz'" in message
    assert "reward_on_error: zero" in message


def test_the_pool_scores_as_the_worker_itself_does(pool_of):
    batch = response_batch(["42", "4x", "so \\boxed{7}", "x"], ["42", "4", "7", "1"],
                           data_source=["a", "a", "b", "a"], extra_info=[{"bonus": 1.0}, {}, {}, {}])
    spec = {"a": "poolrewards:verl_acc", "b": "math_verify"}
    here = RewardWorker(spec).compute_rewards(batch)
    worker = RewardWorker(spec, num_processes=3)
    pooled = worker.compute_rewards(batch)
    worker.pool.close()
    assert pooled.batch["scores"].tolist() == here.batch["scores"].tolist() == [2.0, 0.0, 1.0, 0.0]
    assert torch.equal(pooled.batch["reward_extra/acc"], here.batch["reward_extra/acc"])
    assert list(pooled.non_tensor_batch["reward_extra/pred"]) == ["42", "4x", "7", "x"]


def test_an_import_path_beside_the_config_resolves_in_the_processes(tmp_path, monkeypatch, pool_of):
    (tmp_path / "besidescore.py").write_text("def score(response, ground_truth, **fields):\n"
                                             "    return 0.25 + len(response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # what loading a config beside it does (baton.config.paths)
    result = score_rows("besidescore:score", ["a", "abc"], ["", ""], {}, pool=pool_of("besidescore:score"))
    assert result.scores == [1.25, 3.25]


def test_an_error_raised_in_a_process_and_a_process_that_dies_are_row_errors(pool_of):
    pool = pool_of("poolrewards:raises_on_x")
    with pytest.raises(RewardError, match=r"raised ValueError: no x here\n  on row 1") as info:
        score_rows("poolrewards:raises_on_x", ["a", "x"], ["", ""], {}, pool=pool)
    cause = info.value.__cause__  # the exception as text: the parent unpickles nothing a reward made
    assert isinstance(cause, ScoringProcessError) and cause.type_name == "ValueError"
    assert 'raise ValueError("no x here")' in "".join(cause.__notes__)
    result = score_rows("poolrewards:exits_on_boom", ["a", "boom", "b"], ["", "", ""], {}, "zero",
                        pool_of("poolrewards:exits_on_boom"))
    assert result.scores == [1.0, 0.0, 1.0] and (result.num_errors, result.num_timeouts) == (1, 0)


def test_a_pool_works_from_a_script_without_a_main_guard_and_lets_it_exit(tmp_path):
    # multiprocessing's spawn would run such a script again in each child; an open pool must not hold up the exit
    script = tmp_path / "score.py"
    script.write_text("from baton.rewards import ScoringPool, score_rows\n"
                      "pool = ScoringPool('exact_match', 2)\n"
                      "print(score_rows('exact_match', ['a', 'b', 'c'], ['a', 'x', 'c'], {}, pool=pool).scores)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1.0, 0.0, 1.0]"


# --- DAPO's overlong penalty ------------------------------------------------------------------------------------


def test_the_overlong_penalty_by_hand():
    # L = 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token (times the factor), -1 at the limit.
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_the_reward_worker_adds_the_penalty_to_training_batches_only():
    batch = response_batch(["a", "abcdefg", "abcdefghij"], ["a", "abcdefg", "abcdefghij"])  # 1, 7, 10 tokens
    worker = RewardWorker("exact_match", max_response_len=10, overlong_buffer_len=4, overlong_penalty_factor=2.0)
    out = worker.compute_rewards(batch, apply_overlong_penalty=True)
    assert out.batch["scores"].tolist() == [1.0, 0.5, -1.0]
    assert out.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.5, -1.0]
    assert out.batch["reward_extra/overlong_reward"].tolist() == [0.0, -0.5, -2.0]
    assert out.batch["reward_extra/overlong"].tolist() == [0.0, 1.0, 1.0]
    plain = worker.compute_rewards(batch)  # validation: the function's own score
    assert plain.batch["scores"].tolist() == [1.0, 1.0, 1.0] and "reward_extra/overlong" not in plain.batch


def test_the_loop_logs_the_overlong_penalty_and_the_timeouts(tmp_path):
    config = mock_grpo(tmp_path, num_steps=2)
    config.reward_fn = "exact_match"
    config.overlong_buffer = OverlongBufferConfig(len=2, penalty_factor=1.0)  # max_new_tokens 3: from 2 tokens on
    config.reward = RewardSettings(world_size=1, num_devices_per_worker=0, num_processes_per_worker=1,
                                   timeout_s_per_row=60.0)
    pipeline = run_captured(config)
    batch = pipeline.batch
    lengths = batch.batch["response_mask"].sum(-1).float()
    penalty = torch.clamp(-(lengths - 1) / 2, max=0.0)  # by hand: 1 token 0, 2 tokens -0.5, 3 tokens -1
    assert torch.equal(batch.batch["reward_extra/overlong_reward"], penalty) and (penalty < 0).any()
    texts = pipeline.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    truths = batch.non_tensor_batch["ground_truth"]
    correct = torch.tensor([float(t.strip() == str(g).strip()) for t, g in zip(texts, truths)])
    assert torch.equal(batch.batch["scores"], correct + penalty)
    record = metrics_of(tmp_path)[-1]
    assert record["reward/overlong_reward/mean"] == pytest.approx(float(penalty.mean()))
    assert record["reward/overlong/mean"] == pytest.approx(float((penalty < 0).float().mean()))
    assert record["critic/score/mean"] == pytest.approx(float(batch.batch["scores"].mean()))
    assert record["reward/num_timeouts"] == 0.0 and record["reward/num_errors"] == 0.0
    assert "val/reward/overlong/mean" not in record  # validation is not penalised


# --- several reward workers, and verl's "pred" -------------------------------------------------------------------


@pytest.mark.parametrize("where, num_processes", [("local", 0), ("ray", 1)])  # ray: processes spawned by a Ray worker
def test_a_share_whose_every_row_errored_still_joins_the_others(make_manager, where, num_processes):
    # verl_score raises AttributeError on an extra_info that is no dict: every row of the second worker's share
    cluster = Cluster(WorkerSpec(RewardWorker, (f"{__name__}:verl_score", None, "zero", num_processes)),
                      WorkerConfig("reward", world_size=2, num_devices_per_worker=0), make_manager(where))
    try:
        out = cluster.compute_rewards(response_batch(["42", "41", "x", "y"], ["42"] * 4,
                                                     extra_info=[{}, {}, "oops", "oops"]))  # 2 + 2 rows
    finally:
        cluster.shutdown()
    assert out.batch["scores"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.batch["reward_extra/acc"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert list(out.non_tensor_batch["reward_extra/pred"]) == ["42", "41", None, None]
    assert out.meta_info["metrics"]["reward/num_errors"] == [0, 2]


def list_pred(response: str, ground_truth: str, **fields) -> dict:
    return {"score": 1.0, "pred": [response]}


def test_pred_must_be_text():
    with pytest.raises(RewardError, match=r"returned field 'pred' \['1'\] \(a list\); 'pred' is the extracted answer"):
        score_rows(RewardRoutes(f"{__name__}:list_pred"), ["1"], ["1"], {})
