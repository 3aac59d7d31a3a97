"""RLVR: reinforcement learning on verifiable rewards, GRPO (no critic) or PPO (critic + GAE).

The loop: generate (and, for ReMax, a greedy baseline) → reward → old/ref log-probs (and values) → advantages →
update → sync → validate → checkpoint. Roles on the same devices take turns on them (`on_device`: the rollout for
generation, validation and the sync; the actor, reference and critic for their compute). Copy `run()` to make a new
algorithm.
"""

from __future__ import annotations

import time
import warnings

from baton.algorithms import estimator_needs
from baton.data import DataProto
from baton.datasets import PromptSampler, collate_prompts
from baton.datasets.load import load_datasets
from baton.pipelines.base import Pipeline
from baton.pipelines.config import RLVRConfig
from baton.pipelines.policy import FUSED_POLICY, connect_policy, policy_roles, reference_for, reference_role, validation
from baton.rewards import RewardRoutes
from baton.rl import RLAlgorithm, StaleSamplesWarning, TrainingRoles, add_model_scores, baseline_per_row
from baton.rl.metrics import model_score_metrics, reward_error_count, reward_extra_metrics
from baton.strategy import SamplingParams
from baton.workers import CriticWorker, RewardWorker


class RLVRPipeline(Pipeline):
    config_cls = RLVRConfig

    def __init__(self, config: RLVRConfig):
        config = config.with_run_schedules()
        super().__init__(config, config.trainer)
        algo = config.algorithm
        self.sampler = PromptSampler(len(self.train_data), seed=config.trainer.seed)
        roles = {**policy_roles(config.actor, config.rollout),
                 "reward": (RewardWorker, config.reward, (
                     config.reward_fn, config.actor.strategy.tokenizer, config.reward_on_error,
                     config.reward.num_processes_per_worker, config.reward.timeout_s_per_row,
                     config.sampling.max_new_tokens, config.overlong_buffer.len, config.overlong_buffer.penalty_factor,
                     config.reward_kwargs))}
        if (reference := reference_role(config)) is not None:
            roles["reference"] = reference
        if estimator_needs(algo.adv_estimator).critic:  # the estimator's registration says what it needs
            roles["critic"] = (CriticWorker, config.critic, (config.critic.strategy,))
        if config.reward_model is not None:
            roles["reward_model"] = reward_model_role(config)
        roles.update(self.extra_roles(config))
        clusters = self.create_clusters(roles, fused=self.fused_roles(config, roles))
        self.actor, self.rollout, self.reward = clusters["actor"], clusters["rollout"], clusters["reward"]
        self.reference, self.critic = reference_for(config, clusters), clusters.get("critic")
        self.reward_model = clusters.get("reward_model")
        self.update_pairs = [connect_policy(clusters, config.actor, config.rollout, config.colocate_actor_rollout,
                                            self.val_data, self.tokenizer, config.trainer)]
        self.checkpoint_clusters = ["actor"] + (["critic"] if self.critic else [])
        self.sampling_clusters = ["rollout"]
        # Roles on the same devices take turns (trainer.offload_idle_roles): the rollout generates, then the
        # actor, reference and critic compute. Colocated actor and rollout share tensors: neither is offloaded.
        self.share_devices([["rollout"], ["actor", "reference", "critic"]],
                           never_offloaded=FUSED_POLICY["policy"] if config.colocate_actor_rollout else ())
        stale = config.trainer.sync_every_steps > 1 and not config.colocate_actor_rollout  # colocated: shared tensors
        self.algorithm = RLAlgorithm(algo, config.reward_fn, stale=stale)
        if stale and not self.algorithm.corrected:
            warnings.warn(
                f"trainer.sync_every_steps={config.trainer.sync_every_steps}: the rollout samples with weights up to "
                f"{config.trainer.sync_every_steps - 1} update(s) older than the actor's, and the loss does not correct "
                "for it (its ratio is against the actor's own log-probs); rollout/logprob_diff/mean and max show the "
                "gap. Use sync_every_steps=1 for on-policy training, or an algorithm.rollout_correction",
                StaleSamplesWarning, stacklevel=2)
        # ReMax (verl): one greedy response per prompt, whose reward is the baseline of that prompt's samples.
        self.baseline_sampling = (SamplingParams(temperature=0.0, max_new_tokens=config.sampling.max_new_tokens, n=1)
                                  if self.algorithm.needs.baseline_rollout else None)
        self.maybe_resume()

    @classmethod
    def load_data(cls, config: RLVRConfig):
        return load_datasets(config.data, config.actor.strategy.tokenizer,
                             RewardRoutes(config.reward_fn, config.reward_kwargs))

    def extra_roles(self, config: RLVRConfig) -> dict:
        """Further clusters to start with the loop's (name → (worker class, settings, constructor args)); none."""
        return {}

    def fused_roles(self, config: RLVRConfig, roles: dict) -> dict | None:
        """Roles that share one process per slot: the actor and rollout when colocated."""
        return FUSED_POLICY if config.colocate_actor_rollout else None

    def pipeline_state(self) -> dict:
        return {**super().pipeline_state(), **self.algorithm.state_dict()}

    def load_pipeline_state(self, state: dict) -> None:
        super().load_pipeline_state(state)
        self.algorithm.load_state_dict(state)

    def next_prompts(self) -> DataProto:
        """The step's prompts, in the seeded sampler's order. Group g (uid g, counted from 0 over the run) samples
        with `group_seeds(trainer.seed, g, n)`, as the rollout system's data source seeds its g-th group, so the
        loop, the workflow and the rollout system draw the same samples."""
        trainer, num_prompts = self.config.trainer, self.config.trainer.num_prompts_per_step
        return collate_prompts(self.train_data, self.sampler.next_indices(num_prompts), self.tokenizer,
                               self.config.data.max_prompt_len, uid_offset=(self.global_step - 1) * num_prompts,
                               seed=trainer.seed, num_samples=self.config.sampling.num_samples_per_prompt)

    def training_roles(self) -> TrainingRoles:
        return TrainingRoles(self.actor, self.reference, self.critic)

    def run(self) -> dict:
        trainer = self.config.trainer
        tracker = self.make_tracker()
        start = time.perf_counter()
        first_val = self.first_validation()
        metrics: dict[str, float] = {}
        for step in self.training_steps("rlvr"):
            with self.timer("step"):
                self.on_device("rollout")
                with self.timer("gen"):
                    prompts = self.next_prompts()
                    batch = self.rollout.generate(prompts, self.config.sampling.params())
                if self.baseline_sampling is not None:
                    with self.timer("gen_max"):
                        baseline = self.rollout.generate(prompts, self.baseline_sampling)
                        baseline_rewards = self.reward.compute_rewards(baseline, apply_overlong_penalty=True)
                        batch.batch["reward_baselines"] = baseline_per_row(baseline, baseline_rewards, batch)
                self.on_device("actor", "reference", "critic")
                with self.timer("reward"):
                    rewards = self.reward.compute_rewards(batch, apply_overlong_penalty=True)  # overlong_buffer
                    batch = batch.union(rewards.select(None, [], []))  # scores, token_level_scores, reward_extra/*
                    if self.reward_model is not None:
                        batch, model_metrics = add_model_scores(batch, self.reward_model.score(batch),
                                                                self.config.reward_model_settings.weight)
                        rewards.meta_info.setdefault("metrics", {}).update(model_metrics)
                batch, train_metrics = self.algorithm.train_on(batch, self.training_roles(), self.timer)
                if step % trainer.sync_every_steps == 0:
                    self.sync_weights()
            metrics = {**self.algorithm.batch_metrics(batch), **reward_error_count(rewards), **reward_extra_metrics(batch),
                       **model_score_metrics(rewards), **train_metrics, **self.timings}
            self.algorithm.watch(step, metrics)
            self.log_train_samples(step, batch)
            self.end_step(step, metrics, "reward", "critic/score/mean")
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_reward=metrics.get("critic/score/mean")))

    def validate(self) -> dict[str, float]:
        self.on_device("rollout")
        result = validation(self.rollout, self.reward, self.val_data, self.tokenizer, self.config.val_sampling,
                            self.config.data.max_prompt_len, self.global_step, self.trainer.log_samples)
        self.val_samples = result.samples
        return result.metrics

    def roles_to_save_from(self) -> list[str]:
        return [*self.sampling_clusters, *self.checkpoint_clusters]  # sampling states are read too (pipeline_state)


def reward_model_role(config: RLVRConfig) -> tuple:
    """The `reward_model` cluster's (worker class, settings, constructor args): a scalar reward model or a judge."""
    from baton.workers.reward_model import JudgeWorker, RewardModelWorker

    role, settings = config.reward_model, config.reward_model_settings
    if settings.type == "scalar":
        return RewardModelWorker, role, (role.strategy,)
    return JudgeWorker, role, (role.strategy, settings.template, settings.parse_fn, settings.max_new_tokens,
                               settings.min_score, settings.max_score, settings.max_response_chars)


__all__ = ["RLVRPipeline", "reward_model_role"]
