"""FSDP2 makes the same updates as HF through the pipelines, not only in bare train_step calls.

The pipelines call forward() (the weight-sync probe, validation) before and between training steps;
these tests keep that path in, since that is where FSDP2 and HF once parted.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from baton.models import build_model, load_tokenizer
from baton.pipelines.base import run_pipeline as run
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.sft import SFTPipeline
from baton.rl.losses import SFTLoss
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.fsdp2 import Fsdp2Strategy
from baton.strategy.hf import HFStrategy
from baton.tracking import run_metrics
from baton.workers.weight_sync import probe_batch

TEXTS = ["12+7=19", "3*4=12", "100-1=99", "8/2=4", "5+5=10", "7*7=49", "2+2=4", "9-3=6"]
NUM_STEPS = 5


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {name: float((a[name] - b[name]).abs().max()) for name in a}


def test_a_forward_before_the_first_step_leaves_fsdp2_training_like_hf():
    """A no-grad forward leaves FSDP2's root (embeddings, tied LM head, final norm) gathered; the optimizer built
    after it must still hold the sharded parameters. One in-process rank (a group of one)."""
    config = StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3))
    batch = probe_batch(load_tokenizer(), TEXTS, 3)
    hf, fsdp2 = HFStrategy(config), Fsdp2Strategy(config)
    for strategy in (hf, fsdp2):
        strategy.forward(batch)
        strategy.train_step(batch, SFTLoss())
        strategy.forward(batch)
        strategy.train_step(batch, SFTLoss())
    differences = max_weight_difference(hf._full_state_dict(), fsdp2._full_state_dict())
    assert max(differences.values()) < 1e-6, {k: v for k, v in differences.items() if v >= 1e-6}


def sft_config(run_dir, strategy: str, world_size: int, backend: str) -> SFTConfig:
    role = RoleConfig(strategy=StrategyConfig(name=strategy, model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3)),
                      world_size=world_size)
    trainer = TrainerConfig(backend=backend, num_nodes=1, run_dir=str(run_dir), num_steps=NUM_STEPS,
                            num_prompts_per_step=8, val_every_steps=2, save_every_steps=NUM_STEPS, progress_bar=False)
    return SFTConfig(actor=role, data=DataConfig(max_operand=9, num_val_examples=8), trainer=trainer)


def assert_same_runs(hf_dir, fsdp2_dir) -> None:
    """Every logged metric within 1e-4 relative at every step, and the last checkpoint's weights within float
    tolerance."""
    hf, fsdp2 = run_metrics(str(hf_dir)), run_metrics(str(fsdp2_dir))
    assert hf.keys() == fsdp2.keys() == set(range(NUM_STEPS + 1))
    for step in hf:
        assert hf[step].keys() == fsdp2[step].keys(), step
        for key, value in hf[step].items():
            assert fsdp2[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    checkpoint = f"checkpoints/step_{NUM_STEPS}/actor/model.safetensors"
    hf_weights, fsdp2_weights = load_file(hf_dir / checkpoint), load_file(fsdp2_dir / checkpoint)
    # Adam divides each element's gradient by its own scale, so an element whose gradient is near 0 turns the
    # rounding that differs between a sharded and a whole reduction (and between CPU kernels: seen on one machine
    # and not another) into an update difference of up to about lr (1e-3) per step: the largest difference is held
    # to half an update, and the mean one to float noise.
    differences = max_weight_difference(hf_weights, fsdp2_weights)
    total = sum(float((hf_weights[k] - fsdp2_weights[k]).abs().sum()) for k in hf_weights)
    mean = total / sum(w.numel() for w in hf_weights.values())
    print(f"final weights, fsdp2 against hf: max |difference| {max(differences.values()):.3g}, mean {mean:.3g}")
    assert max(differences.values()) < 5e-4, {k: v for k, v in differences.items() if v >= 5e-4}
    assert mean < 5e-7, mean


@pytest.mark.ray
def test_sft_with_fsdp2_on_two_workers_matches_hf_on_one(tmp_path, ray_cluster):
    run(SFTPipeline, sft_config(tmp_path / "hf", "hf", 1, "local"))
    run(SFTPipeline, sft_config(tmp_path / "fsdp2", "fsdp2", 2, "ray"))

    assert_same_runs(tmp_path / "hf", tmp_path / "fsdp2")
    assert {"sft/loss", "val/accuracy"} <= run_metrics(str(tmp_path / "hf"))[NUM_STEPS].keys()


def digit_share(response: str, ground_truth: str, **fields) -> float:
    """A reward that varies within a group from the first step (exact match is 0 everywhere for an untrained model)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def grpo_config(run_dir, actor_strategy: str, world_size: int, backend: str) -> RLVRConfig:
    actor = RoleConfig(strategy=StrategyConfig(name=actor_strategy, model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3)),
                       world_size=world_size)
    rollout = RoleConfig(strategy=StrategyConfig(name="hf", model="tiny-qwen2"))
    trainer = TrainerConfig(backend=backend, num_nodes=1, run_dir=str(run_dir), num_steps=NUM_STEPS,
                            num_prompts_per_step=4, val_every_steps=2, save_every_steps=NUM_STEPS, progress_bar=False)
    return RLVRConfig(actor=actor, rollout=rollout, reward_fn="test_fsdp2_parity:digit_share",
                      data=DataConfig(max_operand=9, num_val_examples=8),
                      sampling=SamplingConfig(max_new_tokens=4, num_samples_per_prompt=4),
                      val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=4, num_samples_per_prompt=1),
                      trainer=trainer)


@pytest.mark.ray
def test_grpo_with_an_fsdp2_actor_on_two_workers_matches_hf_on_one(tmp_path, ray_cluster):
    """The hf rollout samples with the rollout's seeded generator, so equal weights give equal samples."""
    run(RLVRPipeline, grpo_config(tmp_path / "hf", "hf", 1, "local"))
    run(RLVRPipeline, grpo_config(tmp_path / "fsdp2", "fsdp2", 2, "ray"))
    # The loss metrics (actor/pg_loss, actor/pg_clipfrac, ...) are the whole batch's however it is split over
    # the ranks, whose shards hold different token counts.
    assert_same_runs(tmp_path / "hf", tmp_path / "fsdp2")
    last = run_metrics(str(tmp_path / "hf"))[NUM_STEPS]
    fsdp2_last = run_metrics(str(tmp_path / "fsdp2"))[NUM_STEPS]
    print(f"actor/pg_loss at step {NUM_STEPS}: hf x1 {last['actor/pg_loss']:.7f}, fsdp2 x2 {fsdp2_last['actor/pg_loss']:.7f}")
    # The runs trained: gradients at the last step, and weights that moved from the initial ones (the loss itself can
    # be 0 on every step: with responses of one length the group-normalised advantages average to 0 per token).
    assert last["actor/grad_norm"] > 0
    trained = load_file(tmp_path / "hf" / f"checkpoints/step_{NUM_STEPS}/actor/model.safetensors")
    initial = {k: v for k, v in build_model("tiny-qwen2", seed=0).state_dict().items() if k in trained}  # tied head
    assert max(max_weight_difference(trained, initial).values()) > 1e-4
