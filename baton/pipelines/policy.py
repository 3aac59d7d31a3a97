"""The policy's two halves, training (actor) and inference (rollout), their weight sync, and validation."""

from __future__ import annotations

import dataclasses

from baton.data import DataProto
from baton.datasets import PromptDataset, collate_prompts
from baton.pipelines.config import RoleConfig, SamplingConfig, TrainerConfig
from baton.rewards import DATA_SOURCE, PRED, REWARD_EXTRA_PREFIX
from baton.rl.metrics import reward_error_count, validation_set_metrics
from baton.strategy.capabilities import shares_policy_weights, syncs_policy_adapter
from baton.tracking.samples import Validation, batch_rows
from baton.workers import ActorWorker, BaseModelReference, ReferenceWorker, RolloutWorker
from baton.workers.weight_sync import ModelUpdatePair, probe_batch

# `Pipeline.create_clusters(..., fused=FUSED_POLICY)`: actor and rollout in one process per device.
FUSED_POLICY = {"policy": ["actor", "rollout"]}


def policy_roles(actor: RoleConfig, rollout: RoleConfig) -> dict[str, tuple]:
    """The actor and rollout entries of `Pipeline.create_clusters` (with the pipeline's other roles, so that
    all their processes start together)."""
    return {"actor": (ActorWorker, actor, (actor.strategy,)), "rollout": (RolloutWorker, rollout, (rollout.strategy,))}


def validation_rollout(actor: RoleConfig) -> RoleConfig:
    """The rollout that a pipeline with no rollout of its own (SFT, DPO, distillation) validates (and, on-policy,
    samples) with: one hf worker on the actor's first device, sharing (or receiving) the actor's weights (a LoRA
    actor's merged: the rollout has no adapter of its own)."""
    return RoleConfig(strategy=dataclasses.replace(actor.strategy, name="hf", lora=None), world_size=1,
                      device_mapping=(actor.device_mapping or [0])[:1])


def connect_policy(clusters: dict, actor: RoleConfig, rollout: RoleConfig, colocated: bool,
                   probe_data: PromptDataset | None, tokenizer, trainer: TrainerConfig) -> ModelUpdatePair:
    """The actor → rollout ModelUpdatePair, synced once so both start from the actor's weights.

    colocated (built with FUSED_POLICY): when both roles run on one backend that shares weights in process
    (`shares_policy_weights`, e.g. both `hf` without LoRA), the sync shares tensors instead of copying them.
    A LoRA actor sends only its adapter to a rollout whose engine serves adapters (`syncs_policy_adapter`: `vllm` with
    `engine_kwargs: {enable_lora: true, max_lora_rank: R}`), merged weights to any other, as `trainer`'s
    weight_sync_transport, weight_sync_delta and weight_sync_fingerprints say.
    """
    probe = None
    if probe_data is not None and len(probe_data):
        examples = [probe_data[i] for i in range(min(4, len(probe_data)))]
        probe = probe_batch(tokenizer, [str(e[probe_data.prompt_key]) + str(e[probe_data.answer_key]) for e in examples], 1)
    share = colocated and shares_policy_weights(actor.strategy, rollout.strategy)
    pair = ModelUpdatePair(clusters["actor"], clusters["rollout"], probe, atol=probe_tolerance(actor, rollout),
                           share_role="actor" if share else None,
                           adapter_only=syncs_policy_adapter(actor.strategy, rollout.strategy),
                           transport=trainer.weight_sync_transport, delta=trainer.weight_sync_delta,
                           fingerprints=trainer.weight_sync_fingerprints)
    pair.sync()
    return pair


def reference_role(config) -> tuple | None:
    """An RLVR config's reference cluster as a role entry (worker class, role, args): its `reference:` section, else a
    copy of the actor. None where the algorithm reads no reference, or where a LoRA actor's initial model is the
    reference (no `reference:` section): the actor itself with its adapter off serves then (`reference_for`), so no
    second copy of the model is built."""
    if not config.needs_reference or (config.reference is None and config.actor.strategy.lora is not None):
        return None
    reference = config.reference or config.actor
    return ReferenceWorker, reference, (reference.strategy,)


def reference_for(config, clusters: dict):
    """What the algorithm reads the reference's log-probs from: the reference cluster, or else (`reference_role`) the
    actor with its LoRA adapter off (`BaseModelReference`); None where it reads none."""
    if "reference" in clusters:
        return clusters["reference"]
    return BaseModelReference(clusters["actor"]) if config.needs_reference else None


def probe_tolerance(*roles: RoleConfig) -> float:
    """How far the sync probe's log-probs may differ: float32 on both sides agree to ~1e-6, so 1e-4; bf16 or fp16
    compute on either side (`dtype`, or mixed precision's `compute_dtype`) moves them by ~1e-3 on the tiny models
    and more on large ones, so 0.1, which still catches weights that did not arrive (they differ by far more)."""
    reduced = any((role.strategy.compute_dtype or role.strategy.dtype) != "float32" for role in roles)
    return 0.1 if reduced else 1e-4


def validate(rollout, reward, data: PromptDataset | None, tokenizer, sampling: SamplingConfig, max_prompt_len: int) -> dict:
    """The held-out prompts' metric set (`validation`'s metrics, no sample rows)."""
    return validation(rollout, reward, data, tokenizer, sampling, max_prompt_len).metrics


def validation(rollout, reward, data: PromptDataset | None, tokenizer, sampling: SamplingConfig, max_prompt_len: int,
               step: int = 0, num_samples: int = 0) -> Validation:
    """The held-out prompts, `sampling.num_samples_per_prompt` samples each, scored, as the metric set every driver
    logs (`baton.rl.metrics.validation_set_metrics`: `val/accuracy`, `val/pass@k`, `val-core/...`, ...), and the
    sample rows (`baton.tracking.samples.sample_row`, at `step`) of the first `num_samples` prompts, one sample each.
    maj@k votes over a dict reward's "pred" field, or, where it has none, over each decoded response stripped of
    surrounding whitespace."""
    if data is None or not len(data):
        return Validation({})
    prompts = collate_prompts(data, range(len(data)), tokenizer, max_prompt_len)
    out: DataProto = rollout.generate(prompts, sampling.params(seed=0))
    rewards = reward.compute_rewards(out)
    fields = {name.removeprefix(REWARD_EXTRA_PREFIX): values.numpy() for name, values in rewards.batch.items()
              if name.startswith(REWARD_EXTRA_PREFIX)}
    pred = rewards.non_tensor_batch.get(REWARD_EXTRA_PREFIX + PRED)
    votes = pred if pred is not None else [str(text).strip() for text in rewards.non_tensor_batch["response_text"]]
    errors = reward_error_count(rewards)
    scores = rewards.batch["scores"].numpy()
    metrics = validation_set_metrics(
        scores, out.non_tensor_batch["uid"], out.batch["response_mask"].long().sum(-1).numpy(),
        out.non_tensor_batch["finish_reason"] == "length", fields, out.non_tensor_batch.get(DATA_SOURCE), votes, sampling.num_samples_per_prompt,
        errors["reward/num_errors"], errors["reward/num_timeouts"])
    return Validation(metrics, batch_rows(step, "val", out, scores.tolist(), tokenizer, num_samples))
