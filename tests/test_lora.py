"""LoRA on a training role (`StrategyConfig.lora`, `baton.strategy.lora`): only the adapter trains, exports are
merged into plain HF names, checkpoints hold the adapter and resume exactly, the reference is the actor with its
adapter off (no reference cluster), and a sync that does not deliver the merged weights fails through the probe."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from baton.cli import main
from baton.config import ConfigError, from_dict, load_config
from baton.pipelines import evaluate
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import AlgorithmConfig, RLVRConfig, RoleConfig
from baton.pipelines.preflight import check_roles
from baton.pipelines.rlvr import RLVRPipeline
from baton.strategy import OptimizerConfig, SamplingParams, StrategyConfig, create_strategy
from baton.strategy.base import LoraConfig
from baton.data.shards import WeightPiece
from baton.strategy.hf import TorchStrategy
from baton.workers import BaseModelReference
from baton.workers.weight_sync import WeightSyncError
from test_checkpoint import SCHEDULER, encode, pg_loss, same_params
from test_pipeline_paths import metrics_of, tiny_rlvr

LORA = LoraConfig(rank=4, alpha=8.0)


def make_strategy(lora: LoraConfig | None = LORA, **overrides):
    config = {"model": "tiny-qwen2", "seed": 0, "optimizer": OptimizerConfig(lr=1e-2), "scheduler": SCHEDULER,
              "lora": lora, **overrides}
    return create_strategy(StrategyConfig(**config))


@pytest.fixture(scope="module")
def prompts():
    return encode(make_strategy(lora=None))


@pytest.fixture(scope="module")
def batch(prompts):
    return make_strategy(lora=None).generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=1))


def adapter_and_base(strategy) -> tuple[dict, dict]:
    state = {k: v.detach().clone() for k, v in strategy.hf_model.state_dict().items()}
    return ({k: v for k, v in state.items() if ".lora_" in k}, {k: v for k, v in state.items() if ".lora_" not in k})


def exported(strategy) -> dict[str, torch.Tensor]:
    return {name: tensor for bucket in strategy.export_weights(1 << 16) for name, tensor in bucket.items()}


def test_only_the_adapter_trains(batch):
    strategy = make_strategy()
    adapter, base = adapter_and_base(strategy)
    assert adapter and all(not p.requires_grad for n, p in strategy.hf_model.named_parameters() if ".lora_" not in n)
    strategy.train_step(batch, pg_loss)
    trained = {id(p) for group in strategy.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in strategy.hf_model.named_parameters() if ".lora_" in n}
    adapter_after, base_after = adapter_and_base(strategy)
    assert same_params(base_after, base)  # the base weights are bit-identical after the step
    assert not same_params(adapter_after, adapter)


def test_gradient_checkpointing_trains_the_adapter_alike(batch):
    plain, checkpointed = make_strategy(), make_strategy(gradient_checkpointing=True)
    assert plain.train_step(batch, pg_loss)["grad_norm"] == pytest.approx(
        checkpointed.train_step(batch, pg_loss)["grad_norm"], rel=1e-5)
    for (name, a), b in zip(adapter_and_base(plain)[0].items(), adapter_and_base(checkpointed)[0].values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)


def test_export_is_merged_in_hf_names_and_equals_peft_merge_and_unload(batch):
    strategy = make_strategy()
    base_export = exported(strategy)  # B starts at 0: the merged model is the base
    plain = make_strategy(lora=None).hf_model.state_dict()
    assert base_export.keys() == plain.keys() and same_params(base_export, plain)
    strategy.train_step(batch, pg_loss)
    weights = exported(strategy)
    merged = copy.deepcopy(strategy.peft_model).merge_and_unload().state_dict()
    assert weights.keys() == merged.keys() == plain.keys()  # no base_model.model. prefixes, no lora_A/B
    for name in weights:
        torch.testing.assert_close(weights[name], merged[name], rtol=0, atol=1e-6)
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], plain["model.layers.0.self_attn.q_proj.weight"])
    assert any(".lora_" in n for n in strategy.hf_model.state_dict())  # nothing was merged into the model itself
    # A plain model given the export computes what the LoRA model computes.
    receiver = make_strategy(lora=None)
    receiver.import_weights(strategy.export_weights(1 << 16))
    torch.testing.assert_close(receiver.forward(batch).batch["log_probs"], strategy.forward(batch).batch["log_probs"],
                               rtol=0, atol=1e-5)


def test_checkpoint_holds_the_adapter_and_resumes_exactly(tmp_path, prompts, batch):
    path = str(tmp_path / "ckpt")
    original = make_strategy()
    for _ in range(2):
        original.train_step(batch, pg_loss)
    original.save_checkpoint(path)
    files = set(os.listdir(path))
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.state", "scheduler.state"} <= files
    assert "model.safetensors" not in files  # the base is the role's model, not copied into every checkpoint
    assert all(".lora_" in k for k in load_file(os.path.join(path, "adapter_model.safetensors")))
    expected_metrics = original.train_step(batch, pg_loss)
    expected_params = adapter_and_base(original)
    expected_samples = original.generate(prompts, SamplingParams(max_new_tokens=6, n=2))

    resumed = make_strategy(lora=LoraConfig(rank=4, alpha=8.0))  # a fresh adapter until the checkpoint is loaded
    resumed.train_step(batch, pg_loss)  # and moved away from the saved one
    resumed.load_checkpoint(path)
    assert resumed.global_step == 2
    metrics = resumed.train_step(batch, pg_loss)
    assert metrics["loss"] == expected_metrics["loss"] and metrics["grad_norm"] == expected_metrics["grad_norm"]
    assert all(same_params(a, b) for a, b in zip(adapter_and_base(resumed), expected_params))
    assert resumed.generate(prompts, SamplingParams(max_new_tokens=6, n=2)).equals(expected_samples)


def test_a_checkpoint_loads_only_into_a_role_with_its_lora_settings(tmp_path, batch):
    path = str(tmp_path / "ckpt")
    make_strategy().save_checkpoint(path)
    with pytest.raises(ValueError, match="holds a LoRA adapter and this role has no strategy.lora"):
        make_strategy(lora=None).load_checkpoint(path)
    with pytest.raises(ValueError, match="does not fit this role's lora settings"):
        make_strategy(lora=LoraConfig(rank=8)).load_checkpoint(path)
    full = str(tmp_path / "full")
    make_strategy(lora=None).save_checkpoint(full)
    with pytest.raises(ValueError, match="holds full weights and this role trains a LoRA adapter"):
        make_strategy().load_checkpoint(full)


def test_merged_export_is_a_plain_hf_model(tmp_path, batch):
    strategy = make_strategy()
    strategy.train_step(batch, pg_loss)
    out = str(tmp_path / "merged")
    strategy.save_merged(out)
    assert "model.safetensors" in os.listdir(out) and "adapter_config.json" not in os.listdir(out)
    plain = make_strategy(lora=None, model=out)  # a plain HF directory: no peft on this side
    assert plain.peft_model is None
    torch.testing.assert_close(plain.forward(batch).batch["log_probs"], strategy.forward(batch).batch["log_probs"],
                               rtol=0, atol=1e-5)


def test_base_forward_is_the_model_without_its_adapter(batch):
    strategy = make_strategy()
    base = make_strategy(lora=None).forward(batch).batch["log_probs"]
    strategy.train_step(batch, pg_loss)
    assert not torch.allclose(strategy.forward(batch).batch["log_probs"], base, atol=1e-4)  # the adapter moved it
    torch.testing.assert_close(strategy.base_forward(batch).batch["log_probs"], base, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="this role has none"):
        make_strategy(lora=None).base_forward(batch)


def lora_rlvr(run_dir, **config) -> RLVRConfig:
    config = tiny_rlvr(run_dir, **config)
    lora_strategy = StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-2), lora=LORA)
    return RLVRConfig(**{**config.__dict__, "actor": RoleConfig(strategy=lora_strategy)})


def test_the_kl_reference_is_the_actor_with_its_adapter_off(tmp_path):
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1)
    pipeline = RLVRPipeline(lora_rlvr(tmp_path, num_steps=3, algorithm=algorithm, colocate_actor_rollout=True))
    try:
        assert "reference" not in pipeline.clusters  # no second copy of the model
        assert isinstance(pipeline.reference, BaseModelReference)
        pipeline.run()
    finally:
        pipeline.shutdown()
    kl = [r["actor/kl"] for r in metrics_of(tmp_path)]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the adapter starts at 0: the policy is its base
    assert kl[-1] > 1e-6  # and the trained adapter moves it away from the base
    step = tmp_path / "checkpoints" / "step_3" / "actor"
    assert (step / "adapter_model.safetensors").is_file() and not (step / "model.safetensors").exists()
    # `baton eval` / `generate` open it: the run's base model with the adapter on (the synced rollout's weights).
    policy = evaluate.load_policy(str(step), trust_run_dir=True)
    assert policy.strategy.peft_model is not None
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in policy.strategy.hf_model.named_parameters()
               if "lora_B" in n)
    # `baton export` writes it merged as a plain HF directory, which scores as the adapter on its base does.
    out = tmp_path / "merged"
    assert main(["export", str(step), str(out), "--trust-run-dir"]) == 0
    probe = policy.strategy.generate(encode(policy.strategy), SamplingParams(max_new_tokens=3, n=2, seed=0))
    plain = make_strategy(lora=None, model=str(out))
    torch.testing.assert_close(plain.forward(probe).batch["log_probs"], policy.strategy.forward(probe).batch["log_probs"],
                               rtol=0, atol=1e-5)
    assert main(["export", str(step), str(out)]) == 2  # never over an existing model


def test_a_resumed_lora_run_with_a_kl_loss_continues_exactly(tmp_path):
    from baton.tracking import run_metrics

    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1)
    run_pipeline(RLVRPipeline, lora_rlvr(tmp_path / "straight", num_steps=4, algorithm=algorithm))
    run_pipeline(RLVRPipeline, lora_rlvr(tmp_path / "resumed", num_steps=2, algorithm=algorithm))
    run_pipeline(RLVRPipeline, lora_rlvr(tmp_path / "resumed", num_steps=4, algorithm=algorithm,
                                         trainer={"resume": "latest"}))
    expected, got = run_metrics(str(tmp_path / "straight")), run_metrics(str(tmp_path / "resumed"))
    assert expected[4]["actor/kl"] > 0 and [got[step] for step in (3, 4)] == [expected[step] for step in (3, 4)]
    adapters = [load_file(str(tmp_path / run / "checkpoints" / "step_4" / "actor" / "adapter_model.safetensors"))
                for run in ("straight", "resumed")]
    assert same_params(*adapters)


def test_a_sync_that_sends_the_unmerged_base_fails_loudly(tmp_path, monkeypatch):
    def base_weights_only(self):  # the bug this guards against: the adapter left out
        for name, tensor in self.hf_model.state_dict().items():
            if ".lora_" not in name:
                yield WeightPiece(name.replace(".base_layer", ""), tensor, tuple(tensor.shape), tensor.dtype)

    # What was sent arrives (the fingerprints agree); the probe's forward pass sees that it is not the trained model.
    monkeypatch.setattr(TorchStrategy, "weight_pieces", base_weights_only)
    with pytest.raises(WeightSyncError, match="did not receive the trained weights"):
        run_pipeline(RLVRPipeline, lora_rlvr(tmp_path, num_steps=2))


def test_lora_config_errors():
    for bad, message in [({"rank": 0}, "rank=0 must be >= 1"), ({"alpha": 0.0}, "alpha=0.0 must be"),
                         ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
                         ({"target_modules": []}, "target_modules is empty"),
                         ({"target_modules": ["q_proj", "lm_head"]}, r"\['lm_head'\].*target the projections only")]:
        with pytest.raises(ValueError, match=message):
            LoraConfig(**bad)
    with pytest.raises(ValueError, match="drop lora for the critic"):
        StrategyConfig(kind="value", lora=LoraConfig())
    with pytest.raises(ValueError, match=r"\['qkv'\] are not Linear layers of this model"):
        make_strategy(lora=LoraConfig(target_modules=["q_proj", "qkv"]))
    with pytest.raises(ValueError, match="strategy.name: hf"):
        make_strategy(name="fsdp2")


def test_lora_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  strategy:\n    lora: {rank: 16, alpha: 32}\n")
    config = load_config(RLVRConfig, str(path), ["actor.strategy.lora.dropout=0.05"])
    assert config.actor.strategy.lora == LoraConfig(rank=16, alpha=32.0, dropout=0.05)
    assert config.rollout.strategy.lora is None
    assert load_config(RLVRConfig, None, ["actor.strategy.lora.rank=4"]).actor.strategy.lora.rank == 4
    with pytest.raises(ConfigError, match="'actor.strategy.lora'.*rank=-1"):
        from_dict(RLVRConfig, {"actor": {"strategy": {"lora": {"rank": -1}}}})
    with pytest.raises(ConfigError, match="actor.strategy.lora.ranks"):
        from_dict(RLVRConfig, {"actor": {"strategy": {"lora": {"ranks": 4}}}})
    with pytest.raises(ConfigError, match="rollout.strategy.lora.*remove it"):
        check_roles(from_dict(RLVRConfig, {"rollout": {"strategy": {"lora": {}}}}), RLVRConfig().trainer)


def test_a_workflow_refuses_a_lora_reference():
    from baton.pipelines.dag import DAGConfig

    config = from_dict(DAGConfig, {"actor": {"strategy": {"lora": {}}}, "algorithm": {"use_kl_loss": True}})
    with pytest.raises(ConfigError, match="RLVRPipeline"):
        config.check()


def test_a_lora_actor_with_a_kl_loss_trains_alike_in_the_loop_and_the_rollout_system(tmp_path):
    """The rollout system takes its reference from the LoRA actor as the loop does, and syncs merged weights."""
    from baton.tracking import run_metrics
    from test_rl_drivers import DRIVERS, assert_same_training, settings

    actor = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-2), lora=LORA))
    runs = {}
    for name in ("loop", "rollout_sync"):
        pipeline_cls, config_cls = DRIVERS[name]
        fields = {**settings(tmp_path / name, algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1)),
                  "actor": actor}
        run_pipeline(pipeline_cls, config_cls(**fields))
        runs[name] = run_metrics(str(tmp_path / name))
    assert_same_training(runs)
    assert runs["loop"][1]["actor/kl"] == pytest.approx(0.0, abs=1e-6) and runs["loop"][4]["actor/kl"] > 1e-6
