"""`baton eval` and `baton generate` on checkpoints of a tiny SFT run, in-process; the CLI's start-up stays light."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from baton.cli import main
from baton.datasets import arithmetic_splits
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.sft import SFTPipeline
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking import run_metrics

DATA = DataConfig(max_operand=4, num_val_examples=8)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """40 SFT steps, validated and saved at steps 20 and 40 (held-out accuracy 0 and then above 0)."""
    run_dir = tmp_path_factory.mktemp("runs") / "sft"
    config = SFTConfig(actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=3e-3))),
                       data=DATA, val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                       trainer=TrainerConfig(backend="local", run_dir=str(run_dir), num_steps=40, num_prompts_per_step=16,
                                             val_every_steps=20, save_every_steps=20, progress_bar=False))
    run_pipeline(SFTPipeline, config)
    return run_dir


def logged_validation(run_dir) -> dict[int, dict]:
    return {step: record for step, record in run_metrics(str(run_dir)).items() if "val/accuracy" in record}


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def evaluate(capsys, *argv) -> dict:
    code, out, err = cli(capsys, "eval", *argv)
    assert code == 0, err
    return json.loads(out)


def test_eval_reports_the_validation_the_run_logged(run_dir, capsys):
    logged = logged_validation(run_dir)
    assert sorted(logged) == [0, 20, 40]
    assert logged[40]["val/accuracy"] > logged[20]["val/accuracy"]  # two checkpoints with different figures
    for step in (20, 40):
        result = evaluate(capsys, str(run_dir / "checkpoints" / f"step_{step}"))
        assert result["checkpoint"] == str(run_dir / "checkpoints" / f"step_{step}" / "actor")
        assert result["accuracy"] == logged[step]["val/accuracy"]
        assert result["mean_reward"] == logged[step]["val/reward/mean"]
        assert result["mean_response_length"] == logged[step]["val/response_length/mean"]
        assert (result["n"], result["temperature"], result["max_new_tokens"]) == (8, 0.0, 3)  # the run's val_sampling
    # A run directory means its latest checkpoint; a role directory, itself; a directory of runs, the one written last.
    latest = evaluate(capsys, str(run_dir))
    assert latest["checkpoint"] == str(run_dir / "checkpoints" / "step_40" / "actor")
    assert latest["accuracy"] == logged[40]["val/accuracy"]
    assert evaluate(capsys, str(run_dir / "checkpoints" / "step_20" / "actor"))["accuracy"] == logged[20]["val/accuracy"]
    assert evaluate(capsys, str(run_dir.parent))["checkpoint"] == latest["checkpoint"]


def test_eval_data_reward_and_sampling_overrides(run_dir, capsys, tmp_path):
    checkpoint = str(run_dir / "checkpoints" / "step_40")
    default = evaluate(capsys, checkpoint)
    _, val = arithmetic_splits(DATA.max_operand, DATA.ops, DATA.num_val_examples, DATA.seed)
    same, wrong = tmp_path / "val.jsonl", tmp_path / "wrong.jsonl"
    same.write_text("".join(json.dumps(e) + "\n" for e in val.examples))
    wrong.write_text("".join(json.dumps({**e, "answer": "-1"}) + "\n" for e in val.examples))
    from_file = evaluate(capsys, checkpoint, "--data", str(same))
    assert (from_file["accuracy"], from_file["n"], from_file["data"]) == (default["accuracy"], 8, str(same))
    assert evaluate(capsys, checkpoint, "--data", str(wrong))["accuracy"] == 0.0
    sampled = evaluate(capsys, checkpoint, "--temperature", "1.0", "--num-samples", "3", "--max-new-tokens", "2")
    assert (sampled["temperature"], sampled["num_samples_per_prompt"], sampled["max_new_tokens"]) == (1.0, 3, 2)
    assert sampled["mean_response_length"] <= 2
    assert evaluate(capsys, checkpoint, "--reward", "baton.rewards.rules:exact_match")["accuracy"] == default["accuracy"]
    code, _, err = cli(capsys, "eval", checkpoint, "--reward", "no_such_reward")
    assert code != 0 and "no_such_reward" in err


def test_eval_calls_the_runs_reward_with_its_reward_kwargs(run_dir, capsys, tmp_path):
    import shutil

    import yaml

    copy = tmp_path / "runs" / "sft"
    shutil.copytree(run_dir, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    for pattern, accuracy in (("^NEVER$", 0.0), (".*", 1.0)):
        config.update(reward_fn="format", reward_kwargs={"pattern": pattern})
        (copy / "config.yaml").write_text(yaml.safe_dump(config))
        result = evaluate(capsys, str(copy))
        assert (result["reward_fn"], result["accuracy"]) == ("format", accuracy)
    # --reward replaces the run's reward and its settings, which were that reward's
    assert evaluate(capsys, str(copy), "--reward", "exact_match")["accuracy"] == logged_validation(run_dir)[40][
        "val/accuracy"]


def test_generate_prints_the_completions_eval_scores(run_dir, capsys, tmp_path):
    checkpoint = str(run_dir / "checkpoints" / "step_40")
    _, val = arithmetic_splits(DATA.max_operand, DATA.ops, DATA.num_val_examples, DATA.seed)
    prompts = [e["prompt"] for e in val.examples]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(prompts[2:]) + "\n")
    code, out, err = cli(capsys, "generate", checkpoint, "--prompt", prompts[0], "--prompt", prompts[1],
                         "--prompts-file", str(prompts_file))
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    correct = sum(line["completion"] == e["answer"] for line, e in zip(lines, val.examples))
    assert correct / len(prompts) == logged_validation(run_dir)[40]["val/accuracy"]

    code, out, _ = cli(capsys, "generate", checkpoint, "--prompt", "1+2=", "--num-samples", "2", "--temperature", "1.0")
    assert code == 0 and [json.loads(line)["prompt"] for line in out.splitlines()] == ["1+2=", "1+2="]


def test_generate_reads_a_prompt_file_by_the_runs_prompt_key_or_prompt_key(run_dir, capsys, tmp_path):
    import shutil

    import yaml

    copy = tmp_path / "runs" / "sft"  # the run as if its data kept prompts under "question"
    shutil.copytree(run_dir, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["data"]["prompt_key"] = "question"
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    checkpoint = str(copy / "checkpoints" / "step_40")
    asked = tmp_path / "asked.jsonl"
    asked.write_text('{"question": "1+2=", "solution": "3"}\n{"question": "2+2=", "solution": "4"}\n')
    code, out, err = cli(capsys, "generate", checkpoint, "--prompts-file", str(asked))
    assert code == 0, err
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == ["1+2=", "2+2="]

    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "1+2="}\n')
    code, _, err = cli(capsys, "generate", checkpoint, "--prompts-file", str(plain))
    assert code == 2 and err == (f"baton: error: {plain}, line 1: no 'question' field (fields: ['prompt']); pass "
                                 "--prompt-key FIELD, the field that holds the prompt (default: the run's "
                                 "data.prompt_key)\n")
    code, out, err = cli(capsys, "generate", checkpoint, "--prompts-file", str(plain), "--prompt-key", "prompt")
    assert code == 0 and [json.loads(line)["prompt"] for line in out.splitlines()] == ["1+2="], err


def test_eval_and_generate_refuse_what_is_not_a_checkpoint(run_dir, capsys, tmp_path):
    code, _, err = cli(capsys, "eval", str(tmp_path))
    assert code == 2 and "is not a checkpoint" in err
    code, _, err = cli(capsys, "generate", str(run_dir))
    assert code == 2 and "--prompt" in err


def test_help_lists_the_commands_without_importing_torch():
    script = "import sys; from baton.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass\n" \
             "print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    assert "eval" in out and "generate" in out
    assert out.strip().splitlines()[-1] == "False False"
    subprocess.run([sys.executable, "-m", "baton.cli", "eval", "--help"], capture_output=True, check=True)
