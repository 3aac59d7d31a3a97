"""What a run shows its user: the resumed run's summary, the progress bar after Ctrl-C, the plot's panels."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.signals import TrainingInterrupted
from baton.strategy import StrategyConfig
from baton.tracking.plot import choose_panels, plot_run


def mock_grpo(run_dir, **trainer) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(name="mock"))
    settings = dict(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, val_every_steps=2, save_every_steps=2,
                    progress_bar=False)
    return RLVRConfig(actor=role, rollout=role, data=DataConfig(max_operand=9, num_val_examples=8),
                      sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                      trainer=TrainerConfig(**{**settings, **trainer}))


def test_a_resumed_run_keeps_its_start_accuracy_and_says_where_it_resumed(tmp_path, capsys):
    first = run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=2))
    assert first["start_val_accuracy"] is not None and "resumed_from_step" not in first
    capsys.readouterr()

    resumed = run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=4, resume="latest"))
    assert resumed["start_val_accuracy"] == first["start_val_accuracy"]
    assert resumed["resumed_from_step"] == 2
    assert f"baton: resumed from step 2 of 4 ({tmp_path / 'checkpoints' / 'step_2'})" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text())["start_val_accuracy"] == first["start_val_accuracy"]


def test_after_ctrl_c_the_progress_bar_shows_the_saved_step(tmp_path, capsys):
    class Interrupted(RLVRPipeline):
        def end_step(self, step, metrics, label, key):
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)  # the loop's deferred handler: the step finishes and is saved
            super().end_step(step, metrics, label, key)

    with pytest.raises(TrainingInterrupted) as info:
        run_pipeline(Interrupted, mock_grpo(tmp_path, num_steps=4, save_every_steps=100, progress_bar=True))
    assert info.value.checkpoint.endswith("step_2")
    frames = re.split("[\r\n]", capsys.readouterr().err)  # a bar's frames, or lines where stderr is no terminal
    last_bar = [frame for frame in frames if frame.startswith("rlvr:")][-1]
    assert " 2/4 " in last_bar, last_bar


def records(*dicts) -> list[dict]:
    return [{"step": step, **d} for step, d in enumerate(dicts)]


def test_the_plot_shows_entropy_when_kl_is_off_and_drops_panels_nothing_fills():
    grpo = records({"val/accuracy": 0.1}, {"critic/score/mean": 0.2, "actor/entropy": 1.5, "response_length/mean": 4.0})
    with_kl = records({"critic/score/mean": 0.2, "actor/entropy": 1.5, "actor/kl": 0.01})
    sft = records({"val/accuracy": 0.0, "val/response_length/mean": 3.0}, {"sft/loss": 2.0})

    assert [title for title, _ in choose_panels({"rlvr": grpo})] == [
        "reward (RL) / loss (SFT, DPO, distillation)", "validation accuracy", "policy entropy (KL off)", "response length"]
    assert "KL to reference" in [title for title, _ in choose_panels({"rlvr": with_kl})]
    corrected = records({"critic/score/mean": 0.2, "rollout_corr/ess": 0.9, "rollout/mismatch_kl": 0.01})
    assert ("off-policy: IS effective sample share, mismatch KL", ["rollout_corr/ess", "rollout/mismatch_kl"]) in \
        choose_panels({"rlvr": corrected})
    assert [title for title, _ in choose_panels({"sft": sft})] == [
        "reward (RL) / loss (SFT, DPO, distillation)", "validation accuracy", "validation response length"]


def test_plot_run_writes_a_png_for_a_run_without_kl(tmp_path):
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=2))
    path = plot_run(str(tmp_path))
    assert path == str(tmp_path / "metrics.png") and os.path.getsize(path) > 0


def test_a_two_stage_run_is_plotted_stage_after_stage_in_the_order_it_ran(tmp_path, monkeypatch):
    """SFT (steps 0-4) then RLVR (0-2): RLVR is drawn from step 4 on, after SFT (alphabetically it comes first),
    with its start marked; the stage order is the summary's."""
    import matplotlib.figure

    for stage, rows in (("sft", records(*[{"sft/loss": 2.0 - 0.1 * i, "val/accuracy": 0.1 * i} for i in range(5)])),
                        ("rlvr", records(*[{"critic/score/mean": 0.5, "val/accuracy": 0.5 + 0.1 * i} for i in range(3)]))):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"sft": {}, "rlvr": {}}))
    drawn = {}

    def savefig(figure, path, **kwargs):
        for ax in figure.axes:
            drawn[ax.get_title()] = {line.get_label(): list(line.get_xdata()) for line in ax.lines}

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_run(str(tmp_path))
    accuracy = drawn["validation accuracy"]
    assert accuracy["sft: val/accuracy"] == [0, 1, 2, 3, 4] and accuracy["rlvr: val/accuracy"] == [4, 5, 6]
    assert [x for label, x in accuracy.items() if label.startswith("_")] == [[4, 4]]  # where RLVR begins
