"""RLVR: reinforcement learning on verifiable rewards, GRPO (no critic) or PPO (critic + GAE).

The loop: generate → reward → old/ref log-probs (and values) → advantages → update → sync →
validate → checkpoint. Copy `run()` to make a new algorithm.
"""

from __future__ import annotations

import time

import numpy as np

from baton.algorithms import apply_kl_penalty, compute_advantages, loss_unit
from baton.data import DataProto
from baton.datasets import PromptSampler, collate_prompts
from baton.pipelines.base import Pipeline
from baton.pipelines.config import RLVRConfig
from baton.pipelines.data import load_datasets
from baton.pipelines.losses import PolicyLoss, ValueLoss
from baton.pipelines.policy import build_policy, validate
from baton.workers import CriticWorker, ReferenceWorker, RewardWorker


class RLVRPipeline(Pipeline):
    config_cls = RLVRConfig

    def __init__(self, config: RLVRConfig):
        super().__init__(config, config.trainer)
        algo = config.algorithm
        self.train_data, self.val_data, self.tokenizer = load_datasets(config.data, config.actor.strategy.tokenizer)
        self.sampler = PromptSampler(len(self.train_data), seed=config.trainer.seed)
        self.actor, self.rollout, pair = build_policy(self, config.actor, config.rollout, config.colocate_actor_rollout,
                                                      self.val_data, self.tokenizer)
        roles = {"reward": (RewardWorker, _cpu_role(config.num_reward_workers), (config.reward_fn, config.actor.strategy.tokenizer))}
        if config.reference is not None or algo.use_kl_loss or algo.use_kl_in_reward:
            reference = config.reference or config.actor
            roles["reference"] = (ReferenceWorker, reference, (reference.strategy,))
        if algo.adv_estimator == "gae":
            roles["critic"] = (CriticWorker, config.critic, (config.critic.strategy,))
        clusters = self.create_clusters(roles)
        self.reward, self.reference, self.critic = clusters["reward"], clusters.get("reference"), clusters.get("critic")
        self.update_pairs = [pair]
        self.checkpoint_clusters = ["actor"] + (["critic"] if self.critic else [])
        self.policy_loss = PolicyLoss(algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c, algo.loss_agg_mode,
                                      algo.entropy_coeff, algo.kl_loss_coef if algo.use_kl_loss else 0.0,
                                      algo.kl_loss_estimator)
        self.value_loss = ValueLoss(algo.cliprange_value, algo.loss_agg_mode)
        # One update per batch is on-policy: the loss detaches the current log-probs instead (as TRL does).
        # Several epochs or mini-batches move the weights between updates, and the KL reward penalty
        # needs the log-probs before the update.
        self.needs_old_log_probs = (algo.num_ppo_epochs > 1 or algo.num_mini_batches_per_step > 1
                                    or algo.use_kl_in_reward)
        self.maybe_resume()

    def next_prompts(self) -> DataProto:
        trainer = self.config.trainer
        prompts = collate_prompts(self.train_data, self.sampler.next_indices(trainer.num_prompts_per_step), self.tokenizer,
                                  self.config.data.max_prompt_len, uid_offset=self.global_step * trainer.num_prompts_per_step)
        prompts.meta_info["temperature"] = self.config.sampling.temperature
        return prompts

    def compute_advantages(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        algo, data = self.config.algorithm, batch.batch
        metrics = {}
        rewards = data["token_level_scores"]
        if algo.use_kl_in_reward:
            rewards, metrics = apply_kl_penalty(rewards, data["old_log_probs"], data["ref_log_probs"], data["response_mask"],
                                                algo.kl_reward_coef, algo.kl_reward_estimator)
        advantages, returns = compute_advantages(
            algo.adv_estimator, token_level_rewards=rewards, response_mask=data["response_mask"],
            index=batch.non_tensor_batch["uid"], values=data.get("values"), gamma=algo.gamma, lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std,
        )
        batch.batch.update(token_level_rewards=rewards, advantages=advantages, returns=returns)
        return batch, metrics

    def update(self, cluster, batch: DataProto, loss_fn) -> dict[str, float]:
        """num_ppo_epochs passes over num_mini_batches_per_step mini-batches; returns the last step's metrics."""
        algo = self.config.algorithm
        for _ in range(algo.num_ppo_epochs):
            for mini_batch in batch.chunk(algo.num_mini_batches_per_step):
                per_rank = cluster.train_step(mini_batch, loss_fn, loss_unit(algo.loss_agg_mode))
        return {k: float(np.mean([m[k] for m in per_rank])) for k in per_rank[0]}

    def run(self) -> dict:
        trainer = self.config.trainer
        tracker = self.make_tracker()
        start = time.perf_counter()
        first_val = None
        if trainer.val_before_train and self.global_step == 0:
            first_val = self.validate()
            tracker.log(first_val, step=0)
        metrics: dict[str, float] = {}
        for step in self.training_steps("rlvr"):
            with self.timer("step"):
                with self.timer("gen"):
                    batch = self.rollout.generate(self.next_prompts(), self.config.sampling.params())
                with self.timer("reward"):
                    batch = batch.union(self.reward.compute_rewards(batch).select(["scores", "token_level_scores"]))
                if self.needs_old_log_probs:
                    with self.timer("old_log_prob"):
                        batch.batch["old_log_probs"] = self.actor.compute_log_probs(batch).batch["log_probs"]
                if self.reference is not None:
                    with self.timer("ref"):
                        batch.batch["ref_log_probs"] = self.reference.compute_log_probs(batch).batch["log_probs"]
                if self.critic is not None:
                    with self.timer("values"):
                        batch.batch["values"] = self.critic.compute_values(batch).batch["values"]
                with self.timer("adv"):
                    batch, adv_metrics = self.compute_advantages(batch)
                if self.critic is not None:
                    with self.timer("update_critic"):
                        critic_metrics = self.update(self.critic, batch, self.value_loss)
                with self.timer("update_actor"):
                    actor_metrics = self.update(self.actor, batch, self.policy_loss)
                if step % trainer.sync_every_steps == 0:
                    with self.timer("sync"):
                        self.update_pairs[0].sync()
            metrics = {**self.rollout_metrics(batch), **adv_metrics, **_prefixed(actor_metrics, "actor/"),
                       **(_prefixed(critic_metrics, "critic/") if self.critic is not None else {}), **self.timings}
            self.end_step(step, metrics, "reward", "critic/score/mean")
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_reward=metrics.get("critic/score/mean")))

    def rollout_metrics(self, batch: DataProto) -> dict[str, float]:
        data = batch.batch
        lengths = data["response_mask"].sum(-1).float()
        step_s = self.timings.get("timing_s/step", float("nan"))
        return {
            "critic/score/mean": float(data["scores"].mean()), "critic/score/max": float(data["scores"].max()),
            "critic/advantages/mean": float(data["advantages"][data["response_mask"].bool()].mean()),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response/stop_ratio": float(np.mean(batch.non_tensor_batch["finish_reason"] == "stop")),
            "perf/throughput": float(data["attention_mask"].sum()) / step_s,
        }

    def validate(self) -> dict[str, float]:
        return validate(self.rollout, self.reward, self.val_data, self.tokenizer, self.config.val_sampling,
                        self.config.data.max_prompt_len)


def _cpu_role(world_size: int):
    from baton.pipelines.config import RoleConfig

    return RoleConfig(world_size=world_size, num_devices_per_worker=0)


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """Metric names as verl users know them: keys that already carry a role prefix keep it."""
    return {(k if "/" in k else prefix + k): v for k, v in metrics.items()}


__all__ = ["RLVRPipeline"]
