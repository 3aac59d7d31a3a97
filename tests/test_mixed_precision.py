"""Mixed precision (`compute_dtype: bfloat16`): float32 master parameters and AdamW state, bf16 compute.

A small learning rate is where bf16 parameters fail: AdamW's first steps move each weight by about
lr, far below bf16's resolution (a relative 2^-8) for most weights, so the update rounds away.
Mixed precision must move the weights as a float32 run does, up to the bf16 error of the matmuls.
The 2-rank FSDP2 run is torch.distributed over gloo in spawned processes.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
from safetensors.torch import load_file

from baton.strategy import OptimizerConfig, SamplingParams, StrategyConfig, create_strategy
from baton.strategy.fsdp2 import Fsdp2Strategy
from test_strategy_distributed import pg_loss, prompts_of, train_batch

LR = 1e-6
NUM_STEPS = 3
NUM_ROWS = 7  # two ranks hold shards of 4 and 3
MIXED = {"compute_dtype": "bfloat16"}
BF16 = {"dtype": "bfloat16"}
# Measured at lr 1e-6 over 3 steps (the relative norm of the weight deltas' difference from float32's; their
# cosine): mixed precision 0.054 / 0.9985 (hf), 0.059 / 0.9983 (fsdp2); bf16 parameters 0.99 / 0.13, with 98% of
# the weights not moved at all. AdamW moves a weight by ~lr·sign(gradient) at first, so the mixed run differs
# only where bf16 matmuls flip the sign of a gradient near zero; the bounds leave ~2.5x room.
MAX_RELATIVE_DIFFERENCE = 0.15
MIN_COSINE = 0.99


def config(name: str, **precision) -> StrategyConfig:
    return StrategyConfig(name=name, model="tiny-qwen2", optimizer=OptimizerConfig(lr=LR), **precision)


def full_weights(strategy) -> dict[str, torch.Tensor]:
    """All parameters in HF names (on every rank of a collective; rank 0 holds them, others get {})."""
    return {name: tensor.clone() for bucket in strategy.export_weights() for name, tensor in bucket.items()}


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[name].float().flatten() for name in sorted(weights)])


def weight_delta(strategy, rank: int = 0, world_size: int = 1) -> torch.Tensor | None:
    """How NUM_STEPS small-lr steps (this rank's shard of each batch) move the weights, flattened; None off rank 0."""
    before = full_weights(strategy)
    for step in range(NUM_STEPS):
        strategy.train_step(train_batch(NUM_ROWS, shift=step).chunk(world_size)[rank], pg_loss)
    after = full_weights(strategy)
    return flat(after) - flat(before) if rank == 0 else None


def compare(delta: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(|delta - reference| / |reference|, cosine of the two)."""
    relative = float((delta - reference).norm() / reference.norm())
    return relative, float(torch.nn.functional.cosine_similarity(delta, reference, dim=0))


@pytest.fixture(scope="module")
def float32_delta() -> torch.Tensor:
    return weight_delta(create_strategy(config("hf")))


# --- spawned gloo ranks -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _on_rank(rank: int, world_size: int, port: int, fn, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_on_ranks(fn, world_size: int, args: tuple, out_dir) -> list:
    """`fn(rank, world_size, *args)` in `world_size` spawned processes that form a gloo group (an Fsdp2Strategy
    built there joins it); each rank's return value. A rank that raises fails the call and stops the others."""
    torch.multiprocessing.spawn(_on_rank, args=(world_size, _free_port(), fn, args, str(out_dir)), nprocs=world_size)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world_size)]


def fsdp2_weight_delta(rank: int, world_size: int, precision: dict) -> torch.Tensor | None:
    return weight_delta(Fsdp2Strategy(config("fsdp2", **precision)), rank, world_size)


# --- the update ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf", "fsdp2"])
def test_mixed_precision_moves_the_weights_as_float32_does(name, float32_delta):
    strategy = create_strategy(config(name, **MIXED))
    relative, cosine = compare(weight_delta(strategy), float32_delta)
    print(f"{name} mixed precision vs float32: relative difference {relative:.3f}, cosine {cosine:.4f}")
    assert relative < MAX_RELATIVE_DIFFERENCE and cosine > MIN_COSINE
    assert relative > 1e-3  # the compute did run in bf16: a float32 run would match to rounding
    # Master parameters, their gradients and AdamW's moments all stay float32.
    params = list(strategy.module.parameters())
    assert {p.dtype for p in params} == {p.grad.dtype for p in params} == {torch.float32}
    moments = [v for state in strategy.optimizer.state.values() for k, v in state.items() if k != "step"]
    assert moments and {v.dtype for v in moments} == {torch.float32}


def test_fsdp2_mixed_precision_on_two_ranks_moves_the_weights_as_one_float32_worker(float32_delta, tmp_path):
    delta, nothing = run_on_ranks(fsdp2_weight_delta, 2, (MIXED,), tmp_path)
    assert nothing is None
    relative, cosine = compare(delta, float32_delta)
    print(f"fsdp2 x2 mixed precision vs hf float32: relative difference {relative:.3f}, cosine {cosine:.4f}")
    assert 1e-3 < relative < MAX_RELATIVE_DIFFERENCE and cosine > MIN_COSINE


def test_bf16_parameters_lose_small_updates_and_the_strategy_warns(float32_delta):
    """What mixed precision is for; also shows that the bounds above reject a run whose updates round away."""
    strategy = create_strategy(config("hf", **BF16))
    with pytest.warns(UserWarning, match="train with dtype: float32 and compute_dtype: bfloat16"):
        delta = weight_delta(strategy)
    relative, cosine = compare(delta, float32_delta)
    unmoved = float((delta == 0).float().mean())
    print(f"bf16 parameters vs float32: relative difference {relative:.3f}, cosine {cosine:.4f}, unmoved {unmoved:.1%}")
    assert unmoved > 0.9 and relative > 0.5 and cosine < 0.5
    assert float((float32_delta == 0).float().mean()) < 0.01


def test_mixed_precision_does_not_warn(recwarn):
    create_strategy(config("hf", **MIXED)).train_step(train_batch(NUM_ROWS), pg_loss)
    assert not [w for w in recwarn if "compute_dtype" in str(w.message)]


# --- log-probs and generation ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf", "fsdp2"])
def test_mixed_precision_log_probs_are_float32_from_bf16_matmuls(name):
    batch = train_batch(NUM_ROWS)
    want = create_strategy(config("hf")).forward(batch).batch
    got = create_strategy(config(name, **MIXED)).forward(batch).batch
    # The bf16 matmuls move the log-probs (the entropy of this untrained model, near uniform, hardly moves).
    assert 1e-4 < float((got["log_probs"] - want["log_probs"]).abs().max()) < 0.05
    for key in ("log_probs", "entropy"):
        assert got[key].dtype == torch.float32
        assert float((got[key] - want[key]).abs().max()) < 0.05, key
        # A bf16 log-softmax would leave every value on bf16's grid; float32 logits leave almost none there.
        on_bf16_grid = float((got[key] == got[key].bfloat16().float()).float().mean())
        assert on_bf16_grid < 0.1, (key, on_bf16_grid)


def test_mixed_precision_generate_samples_under_autocast():
    prompts = prompts_of(train_batch(NUM_ROWS))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    mixed = create_strategy(config("hf", **MIXED))
    out = mixed.generate(prompts, greedy)
    float32_out = create_strategy(config("hf")).generate(prompts, greedy)
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    # The sampler's log-probs agree with forward() of the same mixed-precision model ...
    mask = out.batch["response_mask"].bool()
    recomputed = mixed.forward(out).batch["log_probs"]
    assert float((recomputed - out.batch["rollout_log_probs"])[mask].abs().max()) < 0.05
    # ... and differ from the float32 model's on the tokens both sampled after the same prefix: generate computed in bf16.
    width = min(out.batch["responses"].shape[1], float32_out.batch["responses"].shape[1])
    same_prefix = (out.batch["responses"][:, :width] == float32_out.batch["responses"][:, :width]).long().cumprod(1)
    same_prefix = same_prefix.bool() & mask[:, :width]
    assert same_prefix.any()
    difference = out.batch["rollout_log_probs"][:, :width] - float32_out.batch["rollout_log_probs"][:, :width]
    assert float(difference[same_prefix].abs().max()) > 1e-4


# --- checkpoints and configuration -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf", "fsdp2"])
def test_mixed_precision_checkpoints_hold_float32_weights(name, tmp_path):
    strategy = create_strategy(config(name, **MIXED))
    strategy.train_step(train_batch(NUM_ROWS), pg_loss)
    strategy.save_checkpoint(str(tmp_path / "step1"))
    saved = load_file(tmp_path / "step1" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    master = full_weights(strategy)
    assert all(torch.equal(saved[name], master[name]) for name in saved)


@pytest.mark.parametrize("settings, message", [
    ({"compute_dtype": "float16"}, "needs loss scaling.*use compute_dtype: bfloat16"),
    ({"compute_dtype": "bf16"}, "compute_dtype 'bf16' is not one of"),
    ({"dtype": "bfloat16", "compute_dtype": "bfloat16"}, "set dtype: float32 with compute_dtype: bfloat16"),
])
def test_compute_dtype_validation(settings, message):
    with pytest.raises(ValueError, match=message):
        StrategyConfig(**settings)


def test_float32_compute_dtype_is_plain_float32():
    assert StrategyConfig(compute_dtype="float32").mixed_precision_dtype is None
    assert StrategyConfig(compute_dtype="bfloat16").mixed_precision_dtype == torch.bfloat16


def test_an_rlvr_run_syncs_a_mixed_precision_hf_actor_into_a_bf16_rollout(tmp_path):
    """The sync probe compares float32-master bf16 compute with bf16 weights: ~2e-3 apart on tiny-qwen2, so its
    tolerance follows the roles' precision (0.1 there, 1e-4 for float32 on both sides) instead of failing the run."""
    from baton.pipelines.base import run_pipeline
    from baton.pipelines.config import RoleConfig
    from baton.pipelines.policy import probe_tolerance
    from baton.pipelines.rlvr import RLVRPipeline
    from test_pipeline_paths import metrics_of, tiny_rlvr

    actor = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3), **MIXED))
    rollout = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", dtype="bfloat16"))
    assert probe_tolerance(actor, rollout) == 0.1 and probe_tolerance(RoleConfig(), RoleConfig()) == 1e-4
    run_pipeline(RLVRPipeline, tiny_rlvr(tmp_path, num_steps=2, actor=actor, rollout=rollout))
    assert [r["step"] for r in metrics_of(tmp_path)][:2] == [1, 2]
