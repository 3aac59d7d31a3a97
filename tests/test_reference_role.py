"""A KL loss against an explicit `reference:` role: a model of its own, loaded from an HF directory, not the actor's
initial weights. The loss's KL must be measured against that model, and must pull the actor towards it."""

from __future__ import annotations

import pytest

from baton.models import build_model, load_tokenizer, save_tokenizer
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import AlgorithmConfig, RoleConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.strategy import StrategyConfig
from test_pipeline_paths import metrics_of, tiny_rlvr


def hf_directory(path, seed: int) -> str:
    build_model("tiny-qwen2", seed=seed).save_pretrained(path)
    save_tokenizer(load_tokenizer(None), str(path))
    return str(path)


def kl_per_step(run_dir, reference_dir, kl_loss_coef=0.1, num_steps=3) -> list[float]:
    reference = RoleConfig(strategy=StrategyConfig(model=reference_dir))
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=kl_loss_coef)
    run_pipeline(RLVRPipeline, tiny_rlvr(run_dir, num_steps=num_steps, algorithm=algorithm, reference=reference))
    return [r["actor/kl"] for r in metrics_of(run_dir)]


def test_the_kl_is_against_the_reference_model_given_not_the_actor(tmp_path):
    # The actor starts from tiny-qwen2 with seed 0: a reference holding those same weights starts at KL 0 ...
    same = kl_per_step(tmp_path / "same", hf_directory(tmp_path / "ref_same", seed=0))
    assert same[0] == pytest.approx(0.0, abs=1e-6)
    # ... and one holding other weights does not.
    other = kl_per_step(tmp_path / "other", hf_directory(tmp_path / "ref_other", seed=1))
    assert other[0] > 1e-3
    assert not (tmp_path / "other" / "checkpoints" / "step_3" / "reference").exists()  # a reference is never trained
