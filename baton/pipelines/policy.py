"""The policy's two halves, training (actor) and inference (rollout), their weight sync, and validation."""

from __future__ import annotations

import dataclasses

import numpy as np

from baton.data import DataProto
from baton.datasets import PromptDataset, collate_prompts
from baton.pipelines.config import RoleConfig, SamplingConfig
from baton.pipelines.val_metrics import pass_at_k, sample_sizes, validation_metrics
from baton.rewards import DATA_SOURCE, PRED, REWARD_EXTRA_PREFIX
from baton.workers import ActorWorker, RolloutWorker
from baton.workers.weight_sync import ModelUpdatePair, probe_batch


# `Pipeline.create_clusters(..., fused=FUSED_POLICY)`: actor and rollout in one process per device.
FUSED_POLICY = {"policy": ["actor", "rollout"]}


def policy_roles(actor: RoleConfig, rollout: RoleConfig) -> dict[str, tuple]:
    """The actor and rollout entries of `Pipeline.create_clusters` (with the pipeline's other roles, so that
    all their processes start together)."""
    return {"actor": (ActorWorker, actor, (actor.strategy,)), "rollout": (RolloutWorker, rollout, (rollout.strategy,))}


def validation_rollout(actor: RoleConfig) -> RoleConfig:
    """The rollout that a pipeline with no rollout of its own (SFT, DPO, distillation) validates (and, on-policy,
    samples) with: one hf worker on the actor's first device, sharing (or receiving) the actor's weights."""
    return RoleConfig(strategy=dataclasses.replace(actor.strategy, name="hf"), world_size=1,
                      device_mapping=(actor.device_mapping or [0])[:1])


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
    pair = ModelUpdatePair(clusters["actor"], clusters["rollout"], probe, atol=probe_tolerance(actor, rollout),
                           share_role="actor" if share else None)
    pair.sync()
    return pair


def probe_tolerance(*roles: RoleConfig) -> float:
    """How far the sync probe's log-probs may differ: float32 on both sides agree to ~1e-6, so 1e-4; bf16 or fp16
    compute on either side (`dtype`, or mixed precision's `compute_dtype`) moves them by ~1e-3 on the tiny models
    and more on large ones, so 0.1, which still catches weights that did not arrive (they differ by far more)."""
    reduced = any((role.strategy.compute_dtype or role.strategy.dtype) != "float32" for role in roles)
    return 0.1 if reduced else 1e-4


def validate(rollout, reward, data: PromptDataset | None, tokenizer, sampling: SamplingConfig, max_prompt_len: int) -> dict:
    """The held-out prompts, `sampling.num_samples_per_prompt` (n) samples each, scored.

    `val/accuracy` (share of responses with reward >= 1), `val/pass@{k}` (the unbiased pass@k of reward >= 1,
    averaged over prompts, for verl's k = 2, 4, … n), `val/reward/mean`, `val/response_length/mean`,
    `val/reward/<key>/mean` for each further field of a dict reward, `val/reward/num_errors`; and verl's
    `val-core/{data_source}/{variable}/{metric}` and `val-aux/...` (see `validation_metrics`) of the score
    ("reward") and of each numeric field of a dict reward ("acc", ...). maj@k votes over a dict reward's "pred"
    field, or, where it has none, over each decoded response stripped of surrounding whitespace (verl logs no
    maj@k without "pred").
    """
    if data is None or not len(data):
        return {}
    prompts = collate_prompts(data, range(len(data)), tokenizer, max_prompt_len)
    out: DataProto = rollout.generate(prompts, sampling.params(seed=0))
    rewards = reward.compute_rewards(out)
    scores = rewards.batch["scores"].numpy()
    uids = out.non_tensor_batch["uid"]
    fields = {name.removeprefix(REWARD_EXTRA_PREFIX): values.numpy() for name, values in rewards.batch.items()
              if name.startswith(REWARD_EXTRA_PREFIX)}
    if "reward" in fields:
        raise ValueError("a dict reward's field 'reward' would clash with validation's name for the score "
                         "(verl's val-core/<data_source>/reward/...); rename the field")
    pred = rewards.non_tensor_batch.get(REWARD_EXTRA_PREFIX + PRED)
    votes = pred if pred is not None else [str(text).strip() for text in rewards.non_tensor_batch["response_text"]]
    correct = scores >= 1.0
    return {"val/accuracy": float(np.mean(correct)),
            **{f"val/pass@{k}": pass_at_k(correct, uids, k) for k in sample_sizes(sampling.num_samples_per_prompt)},
            "val/reward/mean": float(scores.mean()),
            "val/response_length/mean": float(out.batch["response_mask"].sum(-1).float().mean()),
            **reward_error_count(rewards, "val/"), **reward_extra_metrics(rewards, "val/"),
            **validation_metrics({"reward": scores, **fields}, uids, out.non_tensor_batch.get(DATA_SOURCE), votes)}


def reward_error_count(rewards: DataProto, prefix: str = "") -> dict[str, float]:
    """`reward/num_errors`: the rows the reward function raised on or ran past reward.timeout_s_per_row on, scored 0
    (reward_on_error: zero); `reward/num_timeouts`: those of them that ran past the limit."""
    counts = rewards.meta_info.get("metrics", {})
    return {f"{prefix}reward/{name}": float(np.sum(counts.get(f"reward/{name}", 0)))
            for name in ("num_errors", "num_timeouts")}


def reward_extra_metrics(rewards: DataProto, prefix: str = "") -> dict[str, float]:
    """`reward/<key>/mean`: the batch mean of each further field of a reward function that returns a dict."""
    return {f"{prefix}reward/{name.removeprefix(REWARD_EXTRA_PREFIX)}/mean": float(values.mean())
            for name, values in rewards.batch.items() if name.startswith(REWARD_EXTRA_PREFIX)}
