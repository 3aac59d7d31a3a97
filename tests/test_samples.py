"""Samples a reader can read (issue 34): samples.jsonl from every pipeline that validates, the same prompts at each
validation; the console's validation line and samples table; progress lines on a non-terminal; wall time over a
resume."""

from __future__ import annotations

import io
import json
import os
import signal

import pytest

from agentic_envs import LuckyGuessEnv
from baton.agentic.rollout import AgenticSettings
from baton.checkpoint import PIPELINE_STATE, load_state
from baton.datasets.arith_prefs import write_pairs
from baton.pipelines.agentic import AgenticConfig, AgenticPipeline
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.dag import DAGConfig, DAGPipeline
from baton.pipelines.distill import DistillConfig, DistillPipeline, DistillSettings
from baton.pipelines.dpo import DPOConfig, DPOPipeline, PairDataConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.pipelines.signals import TrainingInterrupted
from baton.pipelines.sft import SFTPipeline
from baton.strategy import StrategyConfig
from baton.tracking import run_metrics, run_samples
from baton.tracking.progress import LineProgress, progress
from baton.tracking.samples import SAMPLE_KEYS, model_text, sample_row, samples_table, validation_line

NUM_SAMPLES = 2
DATA = dict(data=DataConfig(max_operand=9, num_val_examples=6))
VAL_SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1)


def trainer(run_dir, **settings) -> TrainerConfig:
    """Two steps, a validation before each and after the last (steps 0, 1, 2), `NUM_SAMPLES` samples each."""
    return TrainerConfig(**{**dict(backend="local", run_dir=str(run_dir), num_steps=2, num_prompts_per_step=4,
                                   val_every_steps=1, save_every_steps=2, progress_bar=False, log_samples=NUM_SAMPLES),
                            **settings})


def tiny_role(model: str = "tiny-qwen2", **strategy) -> RoleConfig:
    return RoleConfig(strategy=StrategyConfig(model=model, **strategy))


def mock_grpo(run_dir, **settings) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(name="mock"))
    return RLVRConfig(actor=role, rollout=role, **DATA, val_sampling=VAL_SAMPLING,
                      sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                      trainer=trainer(run_dir, **settings))


def sft(run_dir):
    return SFTPipeline, SFTConfig(actor=tiny_role(), **DATA, val_sampling=VAL_SAMPLING, trainer=trainer(run_dir))


def rlvr(run_dir):
    return RLVRPipeline, mock_grpo(run_dir)


def rlvr_fields(run_dir) -> dict:
    return dict(actor=tiny_role(), rollout=tiny_role(), **DATA, val_sampling=VAL_SAMPLING,
                sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2), trainer=trainer(run_dir))


def rollout_system(run_dir):
    return RolloutRLVRPipeline, RolloutRLVRConfig(**{**rlvr_fields(run_dir), "rollout": tiny_role()})


def dag(run_dir):
    return DAGPipeline, DAGConfig(**rlvr_fields(run_dir), colocate_actor_rollout=True)


def dpo(run_dir):
    pairs = str(run_dir.parent / "pairs.jsonl")
    write_pairs(pairs, max_operand=9, num_val=6)
    return DPOPipeline, DPOConfig(actor=tiny_role(micro_batch_size_per_worker=4),
                                  pairs=PairDataConfig(train_path=pairs), **DATA, val_sampling=VAL_SAMPLING,
                                  trainer=trainer(run_dir))


def distill(run_dir):
    return DistillPipeline, DistillConfig(actor=tiny_role(), teacher=tiny_role(seed=1), **DATA,
                                          algorithm=DistillSettings(top_k=4), val_sampling=VAL_SAMPLING,
                                          sampling=SamplingConfig(max_new_tokens=3), trainer=trainer(run_dir))


class NamedGameEnv(LuckyGuessEnv):
    """A game whose first observation names its seed, so that each held-out episode has a prompt of its own."""

    def reset(self, seed: int) -> str:
        return f"game {seed}: " + super().reset(seed)


def agentic(run_dir):
    return AgenticPipeline, AgenticConfig(
        actor=tiny_role(), rollout=tiny_role(), sampling=SamplingConfig(num_samples_per_prompt=2),
        trainer=trainer(run_dir), agentic=AgenticSettings(env="test_samples:NamedGameEnv", max_turns=3,
                                                          num_train_episodes=16, num_val_episodes=4))


PIPELINES = {"sft": sft, "rlvr": rlvr, "rollout_system": rollout_system, "dag": dag, "dpo": dpo, "distill": distill,
             "agentic": agentic}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_every_pipeline_logs_the_same_prompts_samples_at_each_validation(tmp_path, name):
    pipeline_cls, config = PIPELINES[name](tmp_path / "run")
    run_pipeline(pipeline_cls, config)
    rows = run_samples(str(tmp_path / "run"))
    assert rows and all(list(row) == list(SAMPLE_KEYS) for row in rows), rows[:1]
    assert [row["step"] for row in rows] == [0] * NUM_SAMPLES + [1] * NUM_SAMPLES + [2] * NUM_SAMPLES
    assert {row["split"] for row in rows} == {"val"}
    assert all(isinstance(row["prompt"], str) and isinstance(row["response"], str) for row in rows)
    assert all(isinstance(row["reward"], float) for row in rows)
    # The validation set's first prompts, the same at every validation, so a reader follows one prompt's answers.
    _, val, _ = pipeline_cls.load_data(config)
    first = [val[i][val.prompt_key] for i in range(NUM_SAMPLES)]
    assert len(set(first)) == NUM_SAMPLES
    for step in (0, 1, 2):
        assert [row["prompt"] for row in rows if row["step"] == step] == first
    if name == "agentic":  # an episode: no ground truth, the return as reward, the model's turns without the hints
        assert all(row["ground_truth"] is None for row in rows)
    else:
        assert [row["ground_truth"] for row in rows[:NUM_SAMPLES]] == [str(val[i][val.answer_key])
                                                                       for i in range(NUM_SAMPLES)]


def test_log_samples_zero_writes_no_samples_and_keeps_the_validation_line(tmp_path, capsys):
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, log_samples=0))
    assert not os.path.exists(tmp_path / "samples.jsonl")
    err = capsys.readouterr().err
    assert f"baton: {tmp_path.name} step 2/2 validation: accuracy" in err and "prompt | response" not in err


@pytest.mark.parametrize("name", ["rlvr", "rollout_system"])
def test_the_rl_loops_log_training_samples_every_n_steps(tmp_path, name):
    pipeline_cls, config = PIPELINES[name](tmp_path / "run")
    config.trainer.log_samples_every_steps = 2
    config.trainer.num_steps = 4
    config.trainer.val_every_steps = 4
    run_pipeline(pipeline_cls, config)
    train = [row for row in run_samples(str(tmp_path / "run")) if row["split"] == "train"]
    assert [row["step"] for row in train] == [2] * NUM_SAMPLES + [4] * NUM_SAMPLES
    assert all(list(row) == list(SAMPLE_KEYS) and isinstance(row["reward"], float) for row in train)
    assert all(row["ground_truth"] is not None for row in train)
    assert len({row["prompt"] for row in train if row["step"] == 2}) == NUM_SAMPLES  # one sample of each prompt


def test_the_console_prints_a_line_and_the_samples_table_at_each_validation(tmp_path, capsys):
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path))
    err = capsys.readouterr().err
    metrics = run_metrics(str(tmp_path))
    for step in (0, 1, 2):
        line = f"baton: {tmp_path.name} step {step}/2 validation: accuracy {metrics[step]['val/accuracy']:.3f}, mean "
        assert line in err, err
    assert err.count("prompt | response | ground truth | reward") == 3
    rows = run_samples(str(tmp_path))
    table = samples_table(rows[:NUM_SAMPLES])
    assert table in err  # the step-0 rows as written to samples.jsonl


def test_the_table_keeps_each_sample_on_one_line_cut_to_its_width():
    rows = [sample_row(3, "val", "What is 2+2?\nAnswer:", "x" * 100, "4", 1.0),
            sample_row(3, "val", "guess a number", "5\n7\n", None, None)]
    table = samples_table(rows).splitlines()
    assert len(table) == 4 and table[0].split(" | ")[0].strip() == "prompt"
    assert "What is 2+2?\\nAnswer:" in table[2] and "x" * 37 + "..." in table[2] and "x" * 38 not in table[2]
    cells = [cell.strip() for cell in table[3].split(" | ")]
    assert cells == ["guess a number", "5\\n7\\n", "-", "-"]  # no ground truth, no reward


def test_the_validation_line_names_the_figures_that_matter():
    metrics = {"val/accuracy": 0.75, "val/reward/mean": 0.8, "val/pass@2": 0.8, "val/pass@4": 0.9,
               "val/response_length/mean": 12.25, "val/truncated_ratio": 0.0}
    assert validation_line("rlvr", 10, 50, metrics) == (
        "baton: rlvr step 10/50 validation: accuracy 0.750, mean reward 0.800, pass@4 0.900, response length 12.2 "
        "tokens")
    assert validation_line("rlvr", 10, 50, {}) is None


def test_model_text_leaves_out_the_environments_tokens():
    from baton.models import load_tokenizer

    tokenizer = load_tokenizer()  # the character tokenizer
    turn1, hint, turn2 = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("12\n", "higher\n", "40\n"))
    ids, mask = turn1 + hint + turn2, [1] * len(turn1) + [0] * len(hint) + [1] * len(turn2)
    assert model_text(tokenizer, ids, mask) == "12\n40"
    assert model_text(tokenizer, turn1, [1] * len(turn1)) == "12\n"


def test_progress_on_a_non_terminal_writes_lines_not_carriage_returns(tmp_path, capsys):
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=3, progress_bar=True))
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("rlvr: step ")]
    assert lines[0].startswith("rlvr: step 1/3 (33%)") and lines[-1].startswith("rlvr: step 3/3 (100%)")
    assert "reward=" in lines[-1] and "val_acc=" in lines[-1]


def test_a_logged_run_of_a_model_writes_no_carriage_return_at_all(tmp_path, capsys):
    """Besides the loop's bar, transformers' bars (loading weights, writing each checkpoint) are off off a terminal."""
    pipeline_cls, config = sft(tmp_path)
    config.trainer.progress_bar = True
    run_pipeline(pipeline_cls, config)
    err = capsys.readouterr().err
    assert "sft: step 2/2 (100%)" in err and "\r" not in err


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log, terminal = io.StringIO(), Terminal()
    lines = progress(range(1, 11), "sft", initial=0, total=10, file=log)
    assert isinstance(lines, LineProgress)
    for step in lines:
        lines.set_postfix({"loss": f"{1 / step:.3f}"})
    lines.close()
    # the first step and the last (the interval, 30 s, did not pass in between)
    assert log.getvalue().splitlines()[0].startswith("sft: step 1/10 (10%)")
    assert log.getvalue().splitlines()[-1].startswith("sft: step 10/10 (100%)")
    assert log.getvalue().splitlines()[-1].endswith("loss=0.100") and "\r" not in log.getvalue()
    bar = progress(range(3), "sft", initial=0, total=3, file=terminal)
    list(bar)
    bar.close()
    assert "\r" in terminal.getvalue()


def test_the_summary_wall_time_adds_up_over_a_resume(tmp_path):
    class InterruptedAtStep2(RLVRPipeline):
        def end_step(self, step, metrics, label, key):
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)  # the loop's deferred handler: the step finishes and is saved
            super().end_step(step, metrics, label, key)

    with pytest.raises(TrainingInterrupted):
        run_pipeline(InterruptedAtStep2, mock_grpo(tmp_path, num_steps=4, save_every_steps=100))
    earlier_s = load_state(os.path.join(tmp_path, "checkpoints", "step_2", PIPELINE_STATE))["wall_s"]
    summary = run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=4, save_every_steps=100, resume="latest"))
    with open(tmp_path / "summary.json") as f:
        assert json.load(f)["wall_s"] == summary["wall_s"]
    # The resumed part ran steps 3 and 4; the summary counts the interrupted part before them too.
    resumed_steps_s = sum(run_metrics(str(tmp_path), wall_clock=True)[step]["timing_s/step"] for step in (3, 4))
    assert summary["resumed_from_step"] == 2
    assert summary["wall_s"] >= earlier_s + resumed_steps_s
