"""SFT: supervised fine-tuning on (prompt, answer) pairs; the loss covers the answer tokens only."""

from __future__ import annotations

import time

from baton.datasets import PromptSampler, collate_sft
from baton.datasets.load import load_datasets
from baton.pipelines.base import Pipeline
from baton.pipelines.config import SFTConfig
from baton.pipelines.policy import FUSED_POLICY, connect_policy, policy_roles, validation, validation_rollout
from baton.rewards import RewardRoutes
from baton.rl.losses import SFTLoss
from baton.strategy.capabilities import can_share_weights
from baton.workers import RewardWorker


class SFTPipeline(Pipeline):
    config_cls = SFTConfig

    def __init__(self, config: SFTConfig):
        config = config.with_run_schedules()
        super().__init__(config, config.trainer)
        self.sampler = PromptSampler(len(self.train_data), seed=config.trainer.seed)
        # Validation generates with an hf rollout that shares (or receives) the actor's weights.
        rollout = validation_rollout(config.actor)
        colocate = can_share_weights(config.actor.strategy.name, rollout.strategy.name)
        clusters = self.create_clusters({**policy_roles(config.actor, rollout),
                                         "reward": (RewardWorker, config.reward, (
                                             config.reward_fn, config.actor.strategy.tokenizer, config.reward_on_error,
                                             config.reward.num_processes_per_worker, config.reward.timeout_s_per_row,
                                             None, 0, 1.0, config.reward_kwargs))},  # no overlong penalty
                                        fused=FUSED_POLICY if colocate else None)
        self.actor, self.rollout, self.reward = clusters["actor"], clusters["rollout"], clusters["reward"]
        self.update_pairs = [connect_policy(clusters, config.actor, rollout, colocate, self.val_data, self.tokenizer,
                                            config.trainer)]
        self.checkpoint_clusters = ["actor"]
        self.sampling_clusters = ["rollout"]
        self.loss = SFTLoss()
        self.maybe_resume()

    @classmethod
    def load_data(cls, config: SFTConfig):
        train, val, tokenizer = load_datasets(config.data, config.actor.strategy.tokenizer,
                                              RewardRoutes(config.reward_fn, config.reward_kwargs))
        return train.one_response_per_row(config.data.sft_response_key), val, tokenizer

    def validate(self) -> dict[str, float]:
        self.sync_weights()
        result = validation(self.rollout, self.reward, self.val_data, self.tokenizer, self.config.val_sampling,
                            self.config.data.max_prompt_len, self.global_step, self.trainer.log_samples)
        self.val_samples = result.samples
        return result.metrics

    def run(self) -> dict:
        trainer = self.config.trainer
        tracker = self.make_tracker()
        start = time.perf_counter()
        first_val = self.first_validation()
        metrics: dict[str, float] = {}
        for step in self.training_steps("sft"):
            with self.timer("step"):
                batch = collate_sft(self.train_data, self.sampler.next_indices(trainer.num_prompts_per_step), self.tokenizer,
                                    self.config.data.max_prompt_len, self.config.data.sft_response_key)
                per_rank = self.actor.train_step(batch, self.loss, "token")
            metrics = {"sft/loss": per_rank[0]["loss"], "actor/grad_norm": per_rank[0]["grad_norm"],
                       "actor/lr": per_rank[0]["lr"], **self.timings}
            self.end_step(step, metrics, "loss", "sft/loss")
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_loss=metrics.get("sft/loss")))
