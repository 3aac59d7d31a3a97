"""One temperature: the rollout records the temperature it sampled at, and every log-prob of that batch uses it."""

from __future__ import annotations

import pytest
import torch

from baton import Cluster, ResourceManager, WorkerConfig, WorkerSpec
from baton.data import DataProto
from baton.datasets import PromptDataset, collate_prompts
from baton.models import load_tokenizer
from baton.strategy import SamplingParams, StrategyConfig
from baton.strategy.logprobs import sampling_temperature
from baton.workers import ActorWorker, RolloutWorker


@pytest.fixture(scope="module")
def policy():
    manager = ResourceManager(backend="local")
    config = StrategyConfig(model="tiny-qwen2", seed=3)  # the same seed: the two roles hold the same weights
    rollout = Cluster(WorkerSpec(RolloutWorker, (config,)), WorkerConfig("rollout", world_size=1), manager)
    actor = Cluster(WorkerSpec(ActorWorker, (config,)), WorkerConfig("actor", world_size=1, share_devices_with=("rollout",)), manager)
    prompts = collate_prompts(PromptDataset([{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]),
                              range(4), load_tokenizer(None))
    yield rollout, actor, prompts
    manager.shutdown()


def test_log_probs_of_a_sampled_batch_are_at_the_temperature_it_was_sampled_at(policy):
    rollout, actor, prompts = policy
    out = rollout.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=4, n=2, seed=0))
    assert out.meta_info["temperature"] == 0.7
    mask = out.batch["response_mask"].bool()
    log_probs = actor.compute_log_probs(out).batch["log_probs"]
    torch.testing.assert_close(log_probs[mask], out.batch["rollout_log_probs"][mask], atol=1e-5, rtol=1e-5)
    at_one = actor.compute_log_probs(DataProto(out.batch, out.non_tensor_batch, {"temperature": 1.0})).batch
    assert not torch.allclose(at_one["log_probs"][mask], log_probs[mask], atol=1e-3)  # the record is what decides


def test_a_sampled_batch_without_its_temperature_is_an_error():
    sampled = DataProto.from_dict({"rollout_log_probs": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="was sampled .* but records no meta_info\\['temperature'\\]"):
        sampling_temperature(sampled)
    assert sampling_temperature(DataProto.from_dict({"responses": torch.zeros(2, 3)})) == 1.0  # SFT data: not sampled
