"""The policy's two halves, training (actor) and inference (rollout), their weight sync, and validation."""

from __future__ import annotations

import numpy as np

from baton.data import DataProto
from baton.datasets import PromptDataset, collate_prompts
from baton.pipelines.config import RoleConfig, SamplingConfig
from baton.rewards import REWARD_EXTRA_PREFIX
from baton.workers import ActorWorker, RolloutWorker
from baton.workers.weight_sync import ModelUpdatePair, probe_batch


# `Pipeline.create_clusters(..., fused=FUSED_POLICY)`: actor and rollout in one process per device.
FUSED_POLICY = {"policy": ["actor", "rollout"]}


def policy_roles(actor: RoleConfig, rollout: RoleConfig) -> dict[str, tuple]:
    """The actor and rollout entries of `Pipeline.create_clusters` (with the pipeline's other roles, so that
    all their processes start together)."""
    return {"actor": (ActorWorker, actor, (actor.strategy,)), "rollout": (RolloutWorker, rollout, (rollout.strategy,))}


def connect_policy(clusters: dict, actor: RoleConfig, rollout: RoleConfig, colocated: bool,
                   probe_data: PromptDataset | None, tokenizer) -> ModelUpdatePair:
    """The actor → rollout ModelUpdatePair, synced once so both start from the actor's weights.

    colocated (built with FUSED_POLICY): when both roles use the `hf` strategy the sync shares
    tensors instead of copying them.
    """
    probe = None
    if probe_data is not None and len(probe_data):
        examples = [probe_data[i] for i in range(min(4, len(probe_data)))]
        probe = probe_batch(tokenizer, [str(e[probe_data.prompt_key]) + str(e[probe_data.answer_key]) for e in examples], 1)
    share = colocated and actor.strategy.name == rollout.strategy.name == "hf"
    pair = ModelUpdatePair(clusters["actor"], clusters["rollout"], probe, share_role="actor" if share else None)
    pair.sync()
    return pair


def validate(rollout, reward, data: PromptDataset | None, tokenizer, sampling: SamplingConfig, max_prompt_len: int) -> dict:
    """Accuracy (share of responses with reward >= 1), mean reward (and of each further field of a dict reward) on the
    held-out prompts."""
    if data is None or not len(data):
        return {}
    prompts = collate_prompts(data, range(len(data)), tokenizer, max_prompt_len)
    out: DataProto = rollout.generate(prompts, sampling.params(seed=0))
    rewards = reward.compute_rewards(out)
    scores = rewards.batch["scores"].numpy()
    return {"val/accuracy": float(np.mean(scores >= 1.0)), "val/reward/mean": float(scores.mean()),
            "val/response_length/mean": float(out.batch["response_mask"].sum(-1).float().mean()),
            **reward_error_count(rewards, "val/"), **reward_extra_metrics(rewards, "val/")}


def reward_error_count(rewards: DataProto, prefix: str = "") -> dict[str, float]:
    """`reward/num_errors`: the rows the reward function raised on and that were scored 0 (reward_on_error: zero)."""
    counts = rewards.meta_info.get("metrics", {}).get("reward/num_errors", 0)
    return {f"{prefix}reward/num_errors": float(np.sum(counts))}


def reward_extra_metrics(rewards: DataProto, prefix: str = "") -> dict[str, float]:
    """`reward/<key>/mean`: the batch mean of each further field of a reward function that returns a dict."""
    return {f"{prefix}reward/{name.removeprefix(REWARD_EXTRA_PREFIX)}/mean": float(values.mean())
            for name, values in rewards.batch.items() if name.startswith(REWARD_EXTRA_PREFIX)}
