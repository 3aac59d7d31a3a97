"""The demo's task and config: the weak teacher's demonstrations, one seed for the whole run, stage directories."""

from __future__ import annotations

import pytest

from baton.cli import resolve
from baton.config import ConfigError, dump_yaml
from baton.datasets import PromptDataset, arithmetic_splits, collate_sft
from baton.datasets.arithmetic import NUM_TEACHER_ANSWERS, drop_carry
from baton.models import load_tokenizer


def _operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def test_the_teacher_drops_the_carry_in_exactly_its_share_of_demonstrations():
    train, val = arithmetic_splits(30, "+", 200, seed=0, teacher_error=0.6)
    num_carry = 0
    for example in train.examples + val.examples:
        a, b = _operands(example["prompt"])
        assert example["answer"] == str(a + b)
        answers = example["teacher_answers"]
        assert len(answers) == NUM_TEACHER_ANSWERS
        if a % 10 + b % 10 >= 10:
            num_carry += 1
            assert answers.count(str(a + b - 10)) == 6 and answers.count(str(a + b)) == 4
        else:
            assert answers == [str(a + b)] * NUM_TEACHER_ANSWERS
    assert all(e["teacher_answers"] == [e["answer"]] for e in arithmetic_splits(9, "+", 8)[0].examples)
    assert 0.3 < num_carry / (len(train) + len(val)) < 0.6
    assert drop_carry(17, 25) == 32 and drop_carry(12, 5) == 17


def test_the_teacher_does_not_move_the_held_out_split():
    clean = arithmetic_splits(30, "+", 200, seed=0)
    noisy = arithmetic_splits(30, "+", 200, seed=0, teacher_error=0.8)
    for a, b in zip(clean, noisy):
        assert [e["prompt"] for e in a.examples] == [e["prompt"] for e in b.examples]
    with pytest.raises(ValueError, match="probability"):
        arithmetic_splits(9, "+", 8, teacher_error=1.5)


def test_sft_trains_on_each_response_of_a_list_as_its_own_row():
    data = PromptDataset([{"prompt": "1+1=", "answer": "2", "demos": ["2", "3"]},
                          {"prompt": "2+2=", "answer": "4", "demos": "4"}])
    rows = data.one_response_per_row("demos")
    assert [(e["prompt"], e["demos"]) for e in rows.examples] == [("1+1=", "2"), ("1+1=", "3"), ("2+2=", "4")]
    assert data.one_response_per_row("answer") is data
    sparse = PromptDataset([{"prompt": "1+1=", "answer": "2", "demos": ["2"]}, {"prompt": "2+2=", "answer": "4"}])
    assert [e.get("demos", "-") for e in sparse.one_response_per_row("demos").examples] == ["2", "-"]  # no None made up
    tokenizer = load_tokenizer()
    batch = collate_sft(rows, [1], tokenizer, response_key="demos")
    assert tokenizer.decode(batch.batch["responses"][0], skip_special_tokens=True) == "3"
    assert batch.non_tensor_batch["ground_truth"][0] == "2"  # the reward still checks the answer
    with pytest.raises(ValueError, match="data.response_key"):
        collate_sft(rows, [0], tokenizer, response_key="missing")


def _seeds(config) -> dict[str, int]:
    return {key: holder.seed for key, holder in config._seeded()}


def test_one_seed_sets_every_seed_of_the_demo_and_per_stage_seeds_stay_for_experts():
    _, config = resolve(None, ["seed=3"])
    seeds = _seeds(config)
    assert set(seeds.values()) == {3}
    assert {"sft.trainer.seed", "sft.actor.strategy.seed", "rlvr.trainer.seed", "rlvr.rollout.strategy.seed"} <= set(seeds)
    assert config.data.seed == 0  # the task (its held-out split) stays fixed
    _, expert = resolve(None, ["seed=null", "sft.trainer.seed=5", "rlvr.rollout.strategy.seed=7"])
    assert _seeds(expert)["sft.trainer.seed"] == 5 and _seeds(expert)["rlvr.rollout.strategy.seed"] == 7
    assert _seeds(expert)["rlvr.trainer.seed"] == 0
    with pytest.raises(ConfigError, match="seed=null"):
        resolve(None, ["seed=3", "sft.trainer.seed=5"])


def test_the_demo_shows_where_each_stage_writes():
    _, config = resolve(None, ["run_dir=out/demo"])
    assert config.sft.trainer.run_dir == "out/demo/sft" and config.rlvr.trainer.run_dir == "out/demo/rlvr"
    assert "run_dir: out/demo/sft" in dump_yaml(config)
    with pytest.raises(ConfigError, match="set run_dir instead"):
        resolve(None, ["sft.trainer.run_dir=elsewhere"])


def test_a_decaying_schedule_without_total_steps_spans_the_stage():
    _, config = resolve(None, ["sft.trainer.num_steps=300"])
    assert config.sft.actor.strategy.scheduler.total_steps is None  # as written: "the whole stage"
    assert config.stage("sft").with_run_schedules().actor.strategy.scheduler.total_steps == 300
    _, config = resolve(None, ["rlvr.actor.strategy.scheduler.name=linear", "rlvr.algorithm.num_mini_batches_per_step=2"])
    assert config.stage("rlvr").with_run_schedules().actor.strategy.scheduler.total_steps == 2 * config.rlvr.trainer.num_steps
