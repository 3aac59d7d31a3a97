"""DPO: the preference losses and metrics against hand-computed values, pair collation, preference data errors, the
shipped arithmetic pairs, and the pipeline for 2 steps (with exact resume) on the local backend."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from baton.algorithms.preference import preference_loss, sequence_log_probs
from baton.cli import resolve
from baton.config import ConfigError
from baton.data import DataProto
from baton.datasets import DataError, arithmetic_splits
from baton.datasets.arith_prefs import SHIPPED_PAIRS, arithmetic_pairs, write_pairs
from baton.datasets.preference import (COMPLETION, IS_CHOSEN, PAIR_INDEX, PreferenceDataset, check_pairs_together,
                                       collate_pairs)
from baton.models import load_tokenizer
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.dpo import DPOConfig, DPOLoss, DPOPipeline, PairDataConfig, PreferenceConfig
from baton.strategy import StrategyConfig
from baton.tracking import read_metrics, run_metrics
from test_pipeline_paths import weights

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
X = 99.0  # on masked tokens: a value that must not count

# Two pairs, rows chosen0, rejected0, chosen1, rejected1. Sums (means) of the valid tokens:
# policy  -1.5 (-0.75), -6 (-2), -3 (-3), -1.5 (-0.75);  reference  -2 (-1), -3 (-1), -2 (-2), -2 (-1).
POLICY = torch.tensor([[-0.5, -1.0, X], [-2.0, -1.0, -3.0], [-3.0, X, X], [-1.0, -0.5, X]])
REFERENCE = torch.tensor([[-1.0, -1.0, X], [-1.0, -1.0, -1.0], [-2.0, X, X], [-1.0, -1.0, X]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def pair_batch(policy=POLICY, reference=REFERENCE, mask=MASK) -> tuple[dict, DataProto]:
    rows = len(mask)
    batch = DataProto.from_dict({"response_mask": mask, "ref_log_probs": reference,
                                 PAIR_INDEX: torch.arange(rows // 2).repeat_interleave(2),
                                 IS_CHOSEN: torch.tensor([1, 0]).repeat(rows // 2)})
    return {"log_probs": policy.clone().requires_grad_(True)}, batch


# (loss, settings, per-pair losses, mean chosen reward, mean rejected reward), worked out by hand above:
# sigmoid/hinge: h = (chosen - ref) - (rejected - ref) of the sums = 0.5 - (-3) = 3.5 and -1 - 0.5 = -1.5;
# ipo: of the means, 0.25 - (-1) = 1.25 and -1 - 0.25 = -1.25; simpo: no reference, means: 1.25 and -2.25.
CASES = [
    ("sigmoid", dict(beta=0.5), [softplus(-1.75), softplus(0.75)], (0.25 - 0.5) / 2, (-1.5 + 0.25) / 2),
    ("sigmoid", dict(beta=0.5, label_smoothing=0.1),
     [0.9 * softplus(-1.75) + 0.1 * softplus(1.75), 0.9 * softplus(0.75) + 0.1 * softplus(-0.75)],
     (0.25 - 0.5) / 2, (-1.5 + 0.25) / 2),
    ("hinge", dict(beta=0.5), [0.0, 1.75], (0.25 - 0.5) / 2, (-1.5 + 0.25) / 2),
    ("ipo", dict(beta=0.5), [(1.25 - 1.0) ** 2, (-1.25 - 1.0) ** 2], (0.125 - 0.5) / 2, (-0.5 + 0.125) / 2),
    ("simpo", dict(beta=2.0, simpo_gamma=0.5), [softplus(-2.0), softplus(5.0)], (-1.5 - 6.0) / 2, (-4.0 - 1.5) / 2),
]


@pytest.mark.parametrize("loss_type, settings, losses, chosen_reward, rejected_reward", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_preference_loss_and_its_metrics_match_the_hand_computed_values(loss_type, settings, losses,
                                                                              chosen_reward, rejected_reward):
    outputs, batch = pair_batch()
    loss_sum, metrics = DPOLoss(loss_type, **settings)(outputs, batch)
    mean = sum(losses) / 2
    assert float(loss_sum.detach()) == pytest.approx(2 * sum(losses), abs=1e-5)  # counted once per row: 2 rows per pair
    value = {k: total / count for k, (total, count) in metrics.items()}
    assert value["dpo/loss"] == pytest.approx(mean, abs=1e-5)
    assert value["rewards/chosen"] == pytest.approx(chosen_reward, abs=1e-5)
    assert value["rewards/rejected"] == pytest.approx(rejected_reward, abs=1e-5)
    assert value["rewards/margins"] == pytest.approx(chosen_reward - rejected_reward, abs=1e-5)
    assert value["rewards/accuracies"] == 0.5  # the first pair's chosen wins, the second's loses
    normalised = loss_type in ("ipo", "simpo")
    assert value["logps/chosen"] == pytest.approx((-0.75 - 3.0) / 2 if normalised else (-1.5 - 3.0) / 2)
    assert value["logps/rejected"] == pytest.approx((-2.0 - 0.75) / 2 if normalised else (-6.0 - 1.5) / 2)
    loss_sum.backward()  # the loss reaches the policy's log-probs, and only its valid tokens
    assert outputs["log_probs"].grad is not None and bool((outputs["log_probs"].grad[MASK == 0] == 0).all())


def test_the_dpo_gradient_moves_chosen_up_and_rejected_down():
    outputs, batch = pair_batch()
    DPOLoss("sigmoid", beta=0.5)(outputs, batch)[0].backward()
    grad = outputs["log_probs"].grad  # d loss / d log p: descent raises a chosen token's log-prob, lowers a rejected's
    assert bool((grad[0::2][MASK[0::2] == 1] < 0).all()) and bool((grad[1::2][MASK[1::2] == 1] > 0).all())
    # pair 0's chosen already wins by β·h = 1.75: its pull is β σ(-1.75), pair 1's β σ(0.75); twice, as the loss sum
    # counts each pair once per row
    assert float(grad[0, 0]) == pytest.approx(-2 * 0.5 / (1 + math.exp(1.75)), abs=1e-6)
    assert float(grad[2, 0]) == pytest.approx(-2 * 0.5 / (1 + math.exp(-0.75)), abs=1e-6)


def test_the_loss_functions_refuse_missing_or_unwanted_reference_log_probs():
    logps = sequence_log_probs(POLICY, MASK, False)
    assert logps.tolist() == [-1.5, -6.0, -3.0, -1.5]
    with pytest.raises(ValueError, match="compares with a reference model"):
        preference_loss("sigmoid", logps[0::2], logps[1::2], None, None, beta=0.1)
    with pytest.raises(ValueError, match="reference-free"):
        preference_loss("simpo", logps[0::2], logps[1::2], logps[0::2], logps[1::2], beta=0.1)
    with pytest.raises(ValueError, match="unknown preference loss 'dpo'"):
        preference_loss("dpo", logps[0::2], logps[1::2], None, None, beta=0.1)
    outputs, batch = pair_batch()
    with pytest.raises(ValueError, match="no 'ref_log_probs'"):
        DPOLoss("sigmoid")(outputs, batch.select(batch_keys=["response_mask", PAIR_INDEX, IS_CHOSEN]))


def pairs(n: int = 3) -> PreferenceDataset:
    return PreferenceDataset([{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 11)} for i in range(n)])


def test_pair_collation_keeps_each_pair_side_by_side_and_any_even_split_keeps_it_whole():
    tokenizer = load_tokenizer()
    rows = pairs(4).to_rows(tokenizer, max_prompt_len=16, max_response_len=8)
    batch = collate_pairs(rows, [2, 0, 3, 1], tokenizer)
    texts = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    assert texts == ["3", "13", "1", "11", "4", "14", "2", "12"]
    assert list(batch.non_tensor_batch["prompt"]) == ["2+1=", "2+1=", "0+1=", "0+1=", "3+1=", "3+1=", "1+1=", "1+1="]
    assert batch.batch[PAIR_INDEX].tolist() == [2, 2, 0, 0, 3, 3, 1, 1]
    assert batch.batch[IS_CHOSEN].tolist() == [1, 0] * 4
    for part in [*batch.split(2), *batch.split(4), *batch.chunk(2)]:  # micro-batches, two data-parallel workers
        check_pairs_together(part)
    with pytest.raises(ValueError, match=r"holds part of a preference pair \(pairs \[0, 2\]\).*even "
                                         "micro_batch_size_per_worker"):
        check_pairs_together(batch.split(3)[0])
    with pytest.raises(ValueError, match="holds part of a preference pair"):
        check_pairs_together(batch[1:5])  # whole rows count, but rejected-then-chosen is not a pair


def test_a_strategy_that_would_split_a_pair_stops_and_an_even_split_gives_the_whole_batchs_update():
    from baton.strategy.hf import HFStrategy

    tokenizer = load_tokenizer()
    rows = pairs(4).to_rows(tokenizer, max_prompt_len=16, max_response_len=8)
    batch = collate_pairs(rows, [0, 1, 2, 3], tokenizer)
    batch.batch["ref_log_probs"] = torch.zeros(batch.batch["responses"].shape)
    results = []
    for micro_batch_size in (None, 2, 4):
        strategy = HFStrategy(StrategyConfig(model="tiny-qwen2", micro_batch_size_per_worker=micro_batch_size))
        results.append(strategy.train_step(batch, DPOLoss("sigmoid", beta=0.1), "sequence"))
    for result in results[1:]:  # the loss is the mean over pairs, whatever the split into whole pairs
        assert result["loss"] == pytest.approx(results[0]["loss"], abs=1e-5)
        assert result["rewards/margins"] == pytest.approx(results[0]["rewards/margins"], abs=1e-5)
        assert result["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-4)
    assert results[0]["loss"] == pytest.approx(results[0]["dpo/loss"], abs=1e-6)
    odd = HFStrategy(StrategyConfig(model="tiny-qwen2", micro_batch_size_per_worker=3))
    with pytest.raises(ValueError, match="holds part of a preference pair"):
        odd.train_step(batch, DPOLoss(), "sequence")


@pytest.mark.parametrize("change, message", [
    (dict(micro_batch_size_per_worker=3), "micro_batch_size_per_worker=3 would part a preference pair.*use an even"),
    (dict(max_tokens_per_microbatch=64), "max_tokens_per_microbatch=64 splits micro-batches by tokens"),
    (dict(world_size=2, num_prompts_per_step=5), "num_prompts_per_step=5 pairs do not split evenly over the 2 actor"),
    (dict(loss_type="dpo"), "algorithm.loss_type 'dpo' is not one of"),
    (dict(loss_type="simpo", reference=True), "reference-free; remove the section"),
    (dict(beta=0.0), "algorithm.beta=0.0 must be > 0"),
])
def test_a_config_that_would_split_a_pair_or_cannot_run_fails_before_anything_starts(tmp_path, change, message):
    strategy = StrategyConfig(name="fsdp2" if change.get("world_size") else "hf",
                              micro_batch_size_per_worker=change.get("micro_batch_size_per_worker"),
                              max_tokens_per_microbatch=change.get("max_tokens_per_microbatch"))
    config = DPOConfig(actor=RoleConfig(strategy=strategy, world_size=change.get("world_size")),
                       reference=RoleConfig() if change.get("reference") else None,
                       algorithm=PreferenceConfig(loss_type=change.get("loss_type", "sigmoid"),
                                                  beta=change.get("beta", 0.1)),
                       trainer=TrainerConfig(run_dir=str(tmp_path), num_prompts_per_step=change.get(
                           "num_prompts_per_step", 4), backend="local"))
    with pytest.raises(ConfigError, match=message):
        config.check()


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1=", "chosen": "2"}, r"line 2: no 'rejected' field \(fields: \['chosen', 'prompt'\]\); set "
                                        "pairs.rejected_key"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": 3}, "line 2: the response 'rejected' is a number \\(3\\); it must be a "
                                                       "non-empty string or a list of chat messages"),
    ({"prompt": "", "chosen": "2", "rejected": "3"}, "line 2: the prompt 'prompt' is a string \\(''\\); it must be a "
                                                     "non-empty string"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "line 2: 'chosen' and 'rejected' are the same"),
    ({"prompt": "1+1=", "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"},
     "line 2: the response 'chosen' is chat messages but the prompt is text"),
    ({"prompt": [{"role": "user", "content": "1+1="}], "chosen": [{"role": "robot", "content": "2"}], "rejected": "3"},
     "line 2: the response 'chosen' is a list, so chat messages, but message 0 has the role 'robot'"),
    ('["1+1=", "2", "3"]', "line 2: a row must be a JSON object such as"),
])
def test_a_bad_row_of_a_preference_file_is_named_with_the_fix(tmp_path, row, message):
    path = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}, row])
    with pytest.raises(DataError, match=rf"prefs.jsonl, {message}"):
        PreferenceDataset.from_file(path)


def test_chat_pairs_are_rendered_with_the_chat_template_or_named_without_one(tmp_path):
    tokenizer = load_tokenizer()
    row = {"prompt": [{"role": "user", "content": "2+2="}], "chosen": [{"role": "assistant", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [row, {"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    rows = PreferenceDataset.from_file(path).to_rows(tokenizer, max_prompt_len=32, max_response_len=8)
    assert [(r["prompt"], r[COMPLETION]) for r in rows.examples[:2]] == [
        ("user: 2+2=\nassistant: ", "4\n"), ("user: 2+2=\nassistant: ", "5\n")]
    assert rows[2]["prompt"] == "1+1=" and rows[3][COMPLETION] == "3"
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="chat.jsonl, line 1: the row holds chat messages, but the tokenizer .* has no "
                                        "chat template"):
        PreferenceDataset.from_file(path).to_rows(tokenizer, max_prompt_len=32, max_response_len=8)
    with pytest.raises(DataError, match="line 2: the response 'rejected' has 3 tokens with its eos, more than "
                                        "pairs.max_response_len=2"):
        PreferenceDataset.from_file(write_jsonl(tmp_path / "long.jsonl", [
            {"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "5+5=", "chosen": "1", "rejected": "10"}]),
        ).to_rows(tokenizer, max_prompt_len=32, max_response_len=2)


def test_a_parquet_file_of_pairs_loads_as_its_jsonl_twin_does(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": None}]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "ok.parquet")
    assert PreferenceDataset.from_file(str(tmp_path / "ok.parquet")).examples == rows[:1]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet, row 1: the response 'rejected' is null"):
        PreferenceDataset.from_file(str(tmp_path / "bad.parquet"))


def _sum(prompt: str) -> int:
    a, b = prompt.rstrip("=").split("+")
    return int(a) + int(b)


def test_the_shipped_pairs_hold_no_held_out_problem_and_prefer_the_exact_sum_to_a_near_miss():
    assert os.path.getsize(SHIPPED_PAIRS) < 1 << 20
    shipped = [json.loads(line) for line in open(SHIPPED_PAIRS)]
    assert shipped == arithmetic_pairs()  # the generator makes the file, to the byte of every field
    train, val = arithmetic_splits(30, "+", 200, seed=0)
    held_out = {e["prompt"] for e in val.examples}
    assert not held_out & {p["prompt"] for p in shipped}
    assert {p["prompt"] for p in shipped} == {e["prompt"] for e in train.examples}
    for pair in shipped:
        right = _sum(pair["prompt"])
        assert pair["chosen"] == str(right)
        assert pair["rejected"].isdigit() and int(pair["rejected"]) != right and abs(int(pair["rejected"]) - right) <= 81
    # Every sum that carries is paired with the teacher's slip, the carry dropped.
    a_carry = [p for p in shipped if p["slip"] == "dropped_carry"]
    assert a_carry and all(int(p["rejected"]) == _sum(p["prompt"]) - 10 for p in a_carry)
    assert len(a_carry) == sum(1 for e in train.examples if sum(int(x) % 10 for x in e["prompt"][:-1].split("+")) >= 10)


def tiny_dpo(tmp_path, pairs_path, loss_type="sigmoid", **trainer) -> DPOConfig:
    settings = dict(backend="local", run_dir=str(tmp_path / "run"), num_steps=2, num_prompts_per_step=4,
                    val_every_steps=2, save_every_steps=2, progress_bar=False)
    return DPOConfig(actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", micro_batch_size_per_worker=4)),
                     pairs=PairDataConfig(train_path=pairs_path),
                     algorithm=PreferenceConfig(loss_type=loss_type, beta=0.5 if loss_type == "simpo" else 0.1),
                     data=DataConfig(max_operand=9, num_val_examples=8),
                     val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                     trainer=TrainerConfig(**{**settings, **trainer}))


@pytest.fixture
def small_pairs(tmp_path) -> str:
    """Pairs on the task a+b for a, b <= 9, its 8 held-out problems left out."""
    path = str(tmp_path / "pairs.jsonl")
    write_pairs(path, max_operand=9, num_val=8)
    return path


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_the_pipeline_runs_two_steps_and_writes_both_accuracies(tmp_path, small_pairs, loss_type):
    pipeline = DPOPipeline(tiny_dpo(tmp_path, small_pairs, loss_type))
    try:
        assert ("reference" in pipeline.clusters) == (loss_type == "sigmoid")  # simpo runs no reference model
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    run_dir = tmp_path / "run"
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected", "actor/grad_norm", "actor/lr", "timing_s/update_actor"):
        assert key in records[1] and math.isfinite(records[1][key]), key
    assert ("timing_s/ref" in records[1]) == (loss_type == "sigmoid")
    if loss_type == "sigmoid":  # the first step's policy is the reference: every log-ratio, so every reward, is 0
        assert records[1]["rewards/chosen"] == pytest.approx(0.0, abs=1e-5)
        assert records[1]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    written = json.load(open(run_dir / "summary.json"))
    assert written["start_val_accuracy"] == records[0]["val/accuracy"]
    assert written["final_val_accuracy"] == records[-1]["val/accuracy"] == summary["final_val_accuracy"]
    assert os.path.isdir(run_dir / "checkpoints" / "step_2" / "actor")


def test_a_resumed_run_continues_exactly_as_the_uninterrupted_one(tmp_path, small_pairs):
    def dpo(name: str, num_steps: int, **trainer) -> str:
        run_pipeline(DPOPipeline, tiny_dpo(tmp_path / name, small_pairs, num_steps=num_steps, val_every_steps=3,
                                           save_every_steps=1, **trainer))
        return str(tmp_path / name / "run")

    straight = dpo("a", num_steps=3)
    dpo("b", num_steps=1)
    resumed = dpo("b", num_steps=3, resume="latest")
    expected, got = run_metrics(straight), run_metrics(resumed)
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3]
    assert "dpo/loss" in expected[3] and "val/accuracy" in expected[3]
    # Every metric, bit for bit; at step 1 the stopped run also validated (its last step), the straight one did not.
    assert {k: got[1][k] for k in expected[1]} == expected[1] and set(got[1]) - set(expected[1]) == {
        k for k in got[1] if k.startswith(("val/", "val-core/"))}
    assert [got[step] for step in (0, 2, 3)] == [expected[step] for step in (0, 2, 3)]
    for step in (2, 3):  # the weights the steps after the resume saved
        before, after = weights(straight, step, "actor"), weights(resumed, step, "actor")
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), step


def test_pairs_on_held_out_prompts_are_refused(tmp_path):
    _, val = arithmetic_splits(9, "+", 8, seed=0)
    prompt = val[0]["prompt"]
    path = write_jsonl(tmp_path / "leak.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                                 {"prompt": prompt, "chosen": str(_sum(prompt)), "rejected": "99"}])
    with pytest.raises(DataError, match=re.escape(f"leak.jsonl, line 2: the prompt '{prompt}' is one of the held-out prompts")):
        DPOPipeline.dry_run(tiny_dpo(tmp_path, path))


def test_the_example_chains_sft_then_dpo_takes_run_dir_and_fits_a_two_core_machine():
    _, config = resolve(os.path.join(EXAMPLES, "dpo.yaml"), ["run_dir=out/x", "seed=2"])
    assert config.sft.trainer.run_dir == "out/x/sft" and config.dpo.trainer.run_dir == "out/x/dpo"
    assert {config.sft.trainer.seed, config.dpo.trainer.seed, config.dpo.actor.strategy.seed} == {2}
    dpo = config.stage("dpo")
    assert dpo.data.num_val_examples == 200 and dpo.pairs.train_path is None  # the shipped pairs' task
    cpu_only = dpo.reward.num_cpus_per_worker * (dpo.reward.world_size or 1)
    slots = {d for role in (dpo.actor, dpo.reference) if role is not None for d in (role.device_mapping or [0])}
    assert len(slots) + cpu_only <= 2
    with pytest.raises(ConfigError, match="set run_dir instead"):
        resolve(os.path.join(EXAMPLES, "dpo.yaml"), ["dpo.trainer.run_dir=elsewhere"])


def test_the_demo_runs_sft_then_dpo_from_its_checkpoint_and_a_resume_skips_the_finished_sft(tmp_path, small_pairs):
    from baton.recipes.dpo import DPODemoPipeline

    example = os.path.join(EXAMPLES, "dpo.yaml")
    settings = [f"run_dir={tmp_path / 'demo'}", "data.max_operand=9", "data.num_val_examples=8",
                f"dpo.pairs.train_path={small_pairs}", "sft.trainer.num_steps=2", "dpo.trainer.num_steps=2"]
    for stage in ("sft", "dpo"):
        settings += [f"{stage}.trainer.backend=local", f"{stage}.trainer.progress_bar=false",
                     f"{stage}.trainer.num_prompts_per_step=4", f"{stage}.trainer.save_every_steps=2",
                     f"{stage}.trainer.val_every_steps=2", f"{stage}.val_sampling.max_new_tokens=3"]
    summary = DPODemoPipeline(resolve(example, settings)[1]).run()
    written = json.load(open(tmp_path / "demo" / "summary.json"))
    assert written["start_val_accuracy"] == written["sft_val_accuracy"] == summary["sft"]["final_val_accuracy"]
    assert written["final_val_accuracy"] == summary["dpo"]["final_val_accuracy"] is not None
    first = read_metrics(str(tmp_path / "demo" / "dpo" / "metrics.jsonl"))[0]  # the DPO stage's first record
    assert first["step"] == 0 and first["val/accuracy"] == written["sft_val_accuracy"]
    dpo_model = resolve(os.path.join(tmp_path, "demo", "dpo", "config.yaml"), [])[1].actor.strategy.model
    assert dpo_model.endswith(os.path.join("sft", "checkpoints", "step_2", "actor"))
    sft_metrics = (tmp_path / "demo" / "sft" / "metrics.jsonl").read_text()
    DPODemoPipeline(resolve(example, settings[:-1] + ["dpo.trainer.num_steps=3", "resume=latest"])[1]).run()
    assert (tmp_path / "demo" / "sft" / "metrics.jsonl").read_text() == sft_metrics  # not run again
    assert [r["step"] for r in read_metrics(str(tmp_path / "demo" / "dpo" / "metrics.jsonl"))] == [0, 1, 2, 3]
