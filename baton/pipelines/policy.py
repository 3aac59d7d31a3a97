"""The policy's two halves, training (actor) and inference (rollout), their weight sync, and validation."""

from __future__ import annotations

import numpy as np

from baton.data import DataProto
from baton.datasets import PromptDataset, collate_prompts
from baton.distributed import WorkerSpec, create_colocated_clusters
from baton.pipelines.config import RoleConfig, SamplingConfig
from baton.workers import ActorWorker, RolloutWorker
from baton.workers.weight_sync import ModelUpdatePair, probe_batch


def build_policy(pipeline, actor: RoleConfig, rollout: RoleConfig, colocate: bool, probe_data: PromptDataset | None,
                 tokenizer):
    """(actor cluster, rollout cluster, their ModelUpdatePair), synced once so both start from the actor's weights.

    colocate: both roles in one process per device; when both use the `hf` strategy the sync
    shares tensors instead of copying them.
    """
    probe = None
    if probe_data is not None and len(probe_data):
        examples = [probe_data[i] for i in range(min(4, len(probe_data)))]
        probe = probe_batch(tokenizer, [str(e[probe_data.prompt_key]) + str(e[probe_data.answer_key]) for e in examples], 1)
    if colocate:
        views = create_colocated_clusters(
            {"actor": WorkerSpec(ActorWorker, (actor.strategy,)), "rollout": WorkerSpec(RolloutWorker, (rollout.strategy,))},
            actor.worker_config("policy"), pipeline.manager,
        )
        pipeline.clusters.update(views)
        both_hf = actor.strategy.name == rollout.strategy.name == "hf"
        pair = ModelUpdatePair(views["actor"], views["rollout"], probe, share_role="actor" if both_hf else None)
    else:
        clusters = pipeline.create_clusters({"actor": (ActorWorker, actor, (actor.strategy,)),
                                             "rollout": (RolloutWorker, rollout, (rollout.strategy,))})
        pair = ModelUpdatePair(clusters["actor"], clusters["rollout"], probe)
    pair.sync()
    return pair.src, pair.dst, pair


def validate(rollout, reward, data: PromptDataset | None, tokenizer, sampling: SamplingConfig, max_prompt_len: int) -> dict:
    """Accuracy (share of responses with reward >= 1) and mean reward on the held-out prompts."""
    if data is None or not len(data):
        return {}
    prompts = collate_prompts(data, range(len(data)), tokenizer, max_prompt_len)
    out: DataProto = rollout.generate(prompts, sampling.params(seed=0))
    scores = reward.compute_rewards(out).batch["scores"].numpy()
    return {"val/accuracy": float(np.mean(scores >= 1.0)), "val/reward/mean": float(scores.mean()),
            "val/response_length/mean": float(out.batch["response_mask"].sum(-1).float().mean())}
