"""The shipped node executables: the steps of RLVR (GRPO, PPO, DAPO) as workflow nodes.

Controller-side nodes (`fn(ctx, batch) -> NodeOutput`) call the roles of the workflow's context without fetching
data; COMPUTE nodes (`fn(batch, config)`) run on a `ComputeWorker` with the batch fetched there. Each declares the
columns it reads and writes. They compute with the run's `RLAlgorithm` (`ctx.algorithm`, `config["rl"]`), the
object the loop trains with, so a workflow of them trains as `RLVRPipeline.run()` does (`examples/dag_grpo.yaml`).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch

from baton.dag.executor import NodeContext, NodeOutput
from baton.dag.graph import node_function
from baton.data import DataProto
from baton.distributed.future import RenamedData
from baton.rl import add_model_scores, per_row
from baton.rl.metrics import reward_error_count, reward_extra_metrics

PROMPT_COLUMNS = ["input_ids", "attention_mask", "prompt", "uid"]
SAMPLE_COLUMNS = ["prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                  "rollout_log_probs", "finish_reason", "prompt", "uid", "ground_truth"]
REWARD_COLUMNS = ["scores", "token_level_scores", "response_text"]
ADVANTAGE_COLUMNS = ["token_level_rewards", "advantages", "returns", "reward_baselines"]
BASELINES = "reward_baselines_by_uid"  # meta_info: ReMax's greedy reward of each prompt (uid → reward)


@node_function(writes=PROMPT_COLUMNS + ["ground_truth"])
def load_prompts(ctx: NodeContext, batch) -> NodeOutput:
    """The step's prompts from the training set (the run's seeded sampler)."""
    return NodeOutput(ctx.workflow.next_prompts())


@node_function(reads=["input_ids", "attention_mask"], writes=SAMPLE_COLUMNS, output="replace")
def generate(ctx: NodeContext, batch) -> NodeOutput:
    """`sampling.num_samples_per_prompt` responses per prompt from the rollout cluster (the prompts' columns
    repeated per sample)."""
    return NodeOutput(ctx.role("rollout").call_async("generate", batch, ctx.workflow.sampling))


@node_function(reads=["input_ids", "attention_mask", "uid"], output="meta", roles=["reward"])
def greedy_baseline(ctx: NodeContext, batch) -> NodeOutput:
    """ReMax: one greedy response per prompt (`ctx.workflow.baseline_sampling`), scored by the reward role; its
    reward (token-level scores summed, as verl) per prompt goes downstream as `meta_info["reward_baselines_by_uid"]`
    (one number a prompt, no rows), where the advantage node makes it each sample's `reward_baselines`. The caller
    fetches these greedy rows (one a prompt, never the training batch) to key them by uid."""
    params = ctx.workflow.baseline_sampling
    if params is None:
        return NodeOutput(DataProto())
    generated = ctx.role("rollout").call_async("generate", batch, params)
    rewards = ctx.role("reward").call_async("compute_rewards", generated, apply_overlong_penalty=True)
    generated, rewards = (part if isinstance(part, DataProto) else part.get() for part in (generated, rewards))
    reward = rewards.batch["token_level_scores"].sum(-1)  # [prompts]
    by_uid = dict(zip(generated.non_tensor_batch["uid"].tolist(), reward.tolist()))
    return NodeOutput(DataProto(meta_info={BASELINES: by_uid}))


@node_function(reads=["responses", "response_mask", "ground_truth"], writes=REWARD_COLUMNS)
def compute_reward(ctx: NodeContext, batch) -> NodeOutput:
    """`scores`, `token_level_scores` (and `reward_extra/*`) from the reward cluster, overlong penalty included."""
    return NodeOutput(ctx.role("reward").call_async("compute_rewards", batch, apply_overlong_penalty=True))


@node_function(reads=["input_ids", "attention_mask", "responses", "response_mask"], writes=["old_log_probs"])
def old_log_probs(ctx: NodeContext, batch) -> NodeOutput:
    """The actor's log-probs before its update, where the algorithm uses them (several epochs or mini-batches,
    a KL reward, a stale rollout, a rollout correction); a single on-policy update detaches its own instead, and
    this node then adds nothing (as the loop)."""
    if not ctx.algorithm.needs_old_log_probs:
        return NodeOutput()
    return NodeOutput(RenamedData(ctx.role("actor").call_async("compute_log_probs", batch), {"log_probs": "old_log_probs"}))


@node_function(reads=["input_ids", "attention_mask", "responses", "response_mask"], writes=["ref_log_probs"])
def ref_log_probs(ctx: NodeContext, batch) -> NodeOutput:
    """The reference model's log-probs (the KL loss or the KL reward)."""
    reference = ctx.role("reference", " (set algorithm.use_kl_loss or use_kl_in_reward, or `reference`)")
    return NodeOutput(RenamedData(reference.call_async("compute_log_probs", batch), {"log_probs": "ref_log_probs"}))


@node_function(reads=["input_ids", "attention_mask", "responses", "response_mask"], writes=["values"])
def critic_values(ctx: NodeContext, batch) -> NodeOutput:
    """The critic's value of every response token (PPO's GAE)."""
    critic = ctx.role("critic", f" (estimator {ctx.algorithm.config.adv_estimator!r} builds none; use gae)")
    return NodeOutput(critic.call_async("compute_values", batch))


@node_function(reads=["response_mask", "input_ids", "attention_mask", "responses"], writes=["rm_scores"],
               roles=["reward_model"])
def reward_model_scores(ctx: NodeContext, batch) -> NodeOutput:
    """The reward model's score of every response (`rm_scores`; a judge's metrics in its meta_info)."""
    return NodeOutput(ctx.role("reward_model").call_async("score", batch))


@node_function(reads=["scores", "token_level_scores", "response_mask", "rm_scores"],
               writes=SAMPLE_COLUMNS + REWARD_COLUMNS + ["rm_scores", "reward_extra/reward_model"], output="replace")
def add_reward_model_scores(batch: DataProto, config: dict):
    """The reward model's scores, × `reward_model_settings.weight` (`config["reward_model_weight"]`), added to the
    reward function's (as the loop does); the whole batch goes on, `rm_scores` kept."""
    batch, metrics = add_model_scores(batch, batch, config["reward_model_weight"])
    return batch, metrics


@node_function(reads=["token_level_scores", "response_mask", "uid"], writes=ADVANTAGE_COLUMNS)
def compute_advantage(batch: DataProto, config: dict):
    """Advantages and returns by the run's algorithm (`config["rl"]`, sent with every step: its KL coefficient is
    this step's, adaptive or fixed); for ReMax first each row's `reward_baselines` from the greedy baseline node."""
    baselines = batch.meta_info.get(BASELINES)
    if baselines is not None:
        batch.batch["reward_baselines"] = per_row(baselines, batch)
    columns, metrics = config["rl"].advantage_columns(batch)
    if baselines is not None:
        columns["reward_baselines"] = batch.batch["reward_baselines"]
    return DataProto.from_dict(columns), metrics


@node_function(reads=["scores", "response_mask", "attention_mask", "finish_reason", "uid"])
def rollout_metrics(batch: DataProto, config: dict):
    """The step's batch metrics (the loop's): scores, lengths, stop ratio, tokens, advantages, reward errors
    and the means of dict rewards' extra fields. Adds no columns."""
    metrics = {**config["rl"].batch_metrics(batch), **reward_error_count(batch), **reward_extra_metrics(batch)}
    return DataProto(), metrics


@node_function(reads=["advantages", "returns", "response_mask"])
def train_critic(ctx: NodeContext, batch) -> NodeOutput:
    """The critic's update by the value loss."""
    with ctx.workflow.timer("update_critic"):
        return NodeOutput(metrics=ctx.algorithm.update_critic(ctx.role("critic"), batch))


@node_function(reads=["advantages", "response_mask", "input_ids", "attention_mask"])
def train_actor(ctx: NodeContext, batch) -> NodeOutput:
    """The actor's update (num_ppo_epochs × num_mini_batches_per_step train steps) by the policy loss."""
    with ctx.workflow.timer("update_actor"):
        return NodeOutput(metrics=ctx.algorithm.update_actor(ctx.role("actor"), batch))


@node_function(roles=["actor", "rollout"])
def sync_weights(ctx: NodeContext, batch) -> NodeOutput:
    """The actor's weights to the rollout, every `trainer.sync_every_steps` steps."""
    if ctx.step % ctx.workflow.sync_every_steps == 0:
        with ctx.workflow.timer("sync"):
            ctx.workflow.sync_weights()
    return NodeOutput()


@node_function(reads=["scores", "uid"], output="filter")
def keep_informative_groups(batch: DataProto, config: dict):
    """DAPO's dynamic sampling as a node: keep the groups (same `uid`) whose scores are not all equal (they teach
    a group estimator nothing). Its output is the kept rows; `dynamic_sampling/kept_groups` and
    `/dropped_groups` in the metrics. A step where no group passes keeps the whole batch (and says so)."""
    uids, scores = batch.non_tensor_batch["uid"], batch.batch["scores"].numpy()
    keep_uids = [u for u in dict.fromkeys(uids.tolist()) if np.ptp(scores[uids == u]) > 0]
    rows = np.flatnonzero(np.isin(uids, keep_uids)) if keep_uids else np.arange(len(batch))
    num_groups = len(set(uids.tolist()))
    metrics = {"dynamic_sampling/kept_groups": len(keep_uids), "dynamic_sampling/dropped_groups":
               num_groups - len(keep_uids), "dynamic_sampling/kept_all_for_lack": float(not keep_uids)}
    return batch[rows], metrics


@node_function(reads=["responses", "response_mask", "ground_truth"], writes=lambda config: [config["column"]])
def score_with(batch: DataProto, config: dict):
    """One reward function (`config["reward_fn"]`: a registry name or import path, called with `config["kwargs"]`,
    its settings as reward_kwargs) on every response, into the float column `config["column"]` (a dict reward's
    "score"): a reward of its own, for a node that combines several (`weighted_sum`). Runs on a compute worker;
    decodes with the actor's tokenizer. A slow reward (math_verify) is scored in a process of the worker's own with
    a limit per row (`baton.rewards.scoring_pool`), so no response can freeze the worker."""
    from baton.rewards import score_rows

    routes, pool = _reward(config["reward_fn"], json.dumps(config.get("kwargs") or {}, sort_keys=True))
    texts = _tokenizer(config["tokenizer"]).batch_decode(batch.batch["responses"], skip_special_tokens=True)
    truths = [str(truth) for truth in batch.non_tensor_batch["ground_truth"]]
    scores = score_rows(routes, texts, truths, {}, pool=pool).scores
    column = config["column"]
    return DataProto.from_dict({column: torch.tensor(scores, dtype=torch.float32)}), {
        f"reward/{column}/mean": float(np.mean(scores))}


@node_function(reads=lambda config: ["response_mask", *config["weights"]], writes=["scores", "token_level_scores"])
def weighted_sum(batch: DataProto, config: dict):
    """`scores` = Σ weight × column over `config["weights"]` ({column: weight}), and `token_level_scores` with the
    score on each response's last token (the reward workers' layout)."""
    mask = batch.batch["response_mask"]
    scores = sum(float(w) * batch.batch[column].float() for column, w in config["weights"].items())
    lengths = mask.sum(-1)
    token_level = torch.zeros(mask.shape, dtype=torch.float32)
    token_level[torch.arange(len(batch)), (lengths - 1).clamp(min=0)] = scores * (lengths > 0)
    return DataProto.from_dict({"scores": scores, "token_level_scores": token_level})


@functools.lru_cache(maxsize=None)
def _reward(reward_fn: str, kwargs_json: str):
    """(RewardRoutes, its scoring pool or None), resolved once per process (a compute worker scores every step)."""
    from baton.rewards import RewardRoutes, scoring_pool

    routes = RewardRoutes(reward_fn, json.loads(kwargs_json))
    return routes, scoring_pool(routes)


@functools.lru_cache(maxsize=None)
def _tokenizer(path):
    """Loaded once per process (a compute worker scores every step)."""
    from baton.models import load_tokenizer

    return load_tokenizer(path)
