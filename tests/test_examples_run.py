"""Every example config runs: each is loaded as `baton run` loads it, shrunk (2 steps a stage, 8 held-out examples, the
local backend, the test's run directory) and run to the end, so an example that no longer trains fails here.

These runs take minutes, so they are marked `examples`: the README's test command leaves them out (`-m "not
examples"` in pyproject.toml) and `.ci/run` runs them as a pass of their own. Configs that need what this machine
lacks are checked instead of run: `gpu_*` (GPUs and a model path) and `vllm_*` without the vllm extra (`.ci/run`'s
vllm pass runs it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest

from baton.cli import resolve
from baton.datasets.config import DataConfig
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import TrainerConfig
from baton.tracking import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
CONFIGS = sorted([name for name in os.listdir(EXAMPLES) if name.endswith(".yaml")] + ["reverse/config.yaml"])
NUM_STEPS = 2
# Stages that keep their steps: DAPO's dynamic filter keeps only groups whose rewards differ, which an SFT stage of
# two steps never gives it (every sample of the untrained model scores 0).
KEEP_STEPS = {"dapo_dynamic.yaml": {"sft"}}

pytestmark = pytest.mark.examples


def shrink(config, run_dir: str, keep_steps: frozenset = frozenset(), keep: bool = False):
    """`config` with every stage's trainer on the local backend for NUM_STEPS steps (those under a field named in
    `keep_steps`: their own) into `run_dir`, validating and checkpointing at the last, and at most 8 held-out
    arithmetic examples."""
    if not dataclasses.is_dataclass(config):
        return config
    changes = {f.name: shrink(getattr(config, f.name), run_dir, keep_steps, keep or f.name in keep_steps)
               for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))}
    if isinstance(config, TrainerConfig):
        num_steps = config.num_steps if keep else min(config.num_steps, NUM_STEPS)
        changes.update(backend="local", num_steps=num_steps, val_every_steps=num_steps, save_every_steps=num_steps,
                       progress_bar=False, run_dir=os.path.join(run_dir, os.path.basename(config.run_dir)))
    elif isinstance(config, DataConfig) and config.task == "arithmetic":
        changes["num_val_examples"] = min(config.num_val_examples, 8)
    elif any(f.name == "run_dir" for f in dataclasses.fields(config)):  # a two-stage demo's own run_dir
        changes["run_dir"] = run_dir
    return dataclasses.replace(config, **changes)


def metrics_files(run_dir) -> list[str]:
    return sorted(os.path.join(d, "metrics.jsonl") for d, _, files in os.walk(run_dir) if "metrics.jsonl" in files)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_example_config_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # as the README runs them: from the repository root
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, name), [])
    if name.startswith("gpu_") or (name.startswith("vllm_") and importlib.util.find_spec("vllm") is None):
        pytest.skip("needs GPUs and a model path" if name.startswith("gpu_") else "needs the vllm extra")
    summary = run_pipeline(pipeline_cls, shrink(config, str(tmp_path), frozenset(KEEP_STEPS.get(name, ()))))
    assert summary is not None
    found = metrics_files(tmp_path)
    if name == "transform.yaml":  # the single-controller example: no model, no training steps
        return
    assert found, f"{name} wrote no metrics.jsonl under its run directory"
    for path in found:
        steps = [record["step"] for record in read_metrics(path)]
        assert steps and max(steps) >= 1, f"{path}: no training step was logged ({steps})"
