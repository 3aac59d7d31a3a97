"""Agentic multi-turn RL (ROLL's agentic pipeline) on the rollout system: each sample is an episode of an
environment played turn by turn against the engines (`baton.agentic.rollout.generate_trajectory`), the environments
in processes of their own (`baton.agentic.pool.EnvPool`), and GRPO (or any of the algorithms) trains on the
trajectories with the environment's tokens masked out of the loss. The prompts are the episodes' first
observations: `agentic.num_train_episodes` environment seeds for training, `agentic.num_val_episodes` others
held out, where `val/accuracy` is the share of episodes the greedy policy wins (a reward >= 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from baton.agentic.endpoint import AgentEndpoint
from baton.agentic.pool import EnvPool
from baton.agentic.rollout import VAL_SEED_OFFSET, AgenticSettings, episode_rows
from baton.config import ConfigError
from baton.datasets import PromptDataset
from baton.models import load_tokenizer
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline

GENERATE = "baton.agentic.rollout:generate_trajectory"
AGENT_GENERATE = "baton.agentic.agent:generate_agent_episode"
AGENT_PROGRAM = "baton.agentic.agent:AgentProgram"
REWARD = "baton.agentic.rollout:trajectory_reward"


@dataclass
class AgenticConfig(RolloutRLVRConfig):
    """`RolloutRLVRConfig` with an environment (`agentic`; see `AgenticSettings`). The rollout system's generate and
    reward functions default to the trajectory ones; `sampling` sets the temperature and the samples per episode
    (its max_new_tokens is not used: the agentic settings bound the turns and the trajectory)."""

    pipeline_cls: str = "baton.pipelines.agentic:AgenticPipeline"
    agentic: AgenticSettings = field(default_factory=AgenticSettings)

    def __post_init__(self):
        system = self.rollout_system
        generate = GENERATE if self.agentic.agent is None else AGENT_GENERATE
        self.rollout_system = dataclasses.replace(system, generate_function=system.generate_function or generate,
                                                  reward_function=system.reward_function or REWARD)

    def check(self) -> None:
        super().check()
        if self.loss != "policy":
            raise ConfigError(f"loss {self.loss!r}: agentic runs train the policy on its trajectories; use loss: policy")
        settings, capacity = self.agentic, self.agentic.num_env_processes * self.agentic.episodes_per_env_process
        episodes = max(self.trainer.num_prompts_per_step * self.sampling.num_samples_per_prompt,
                       settings.num_val_episodes * self.val_sampling.num_samples_per_prompt)
        if self.rollout_system.deterministic and episodes > capacity:
            # In lockstep every episode's turn waits for all the others': one waiting for an environment slot
            # would hold them all.
            raise ConfigError(f"rollout_system.deterministic plays a rollout's {episodes} episodes in lockstep, but "
                              f"the environments hold {capacity} at once (agentic.num_env_processes × "
                              "episodes_per_env_process); raise those, or lower the episodes a rollout plays")


class AgenticPipeline(RolloutRLVRPipeline):
    config_cls = AgenticConfig

    @classmethod
    def load_data(cls, config: AgenticConfig):
        """The episodes as prompt datasets: (train, val, tokenizer)."""
        settings = config.agentic
        try:
            train = episode_rows(settings, range(settings.num_train_episodes))
            val = episode_rows(settings, range(VAL_SEED_OFFSET, VAL_SEED_OFFSET + settings.num_val_episodes))
        except Exception as error:
            raise ConfigError(f"agentic.env {settings.env!r} with env_kwargs {settings.env_kwargs}: its reset() "
                              f"failed: {type(error).__name__}: {error}") from error
        tokenizer = load_tokenizer(config.actor.strategy.tokenizer)
        return (PromptDataset(train, answer_key=None, source=f"{settings.env} episodes"),
                PromptDataset(val, answer_key=None, source=f"{settings.env} held-out episodes") if val else None,
                tokenizer)

    def __init__(self, config: AgenticConfig):
        settings = config.agentic
        env, env_kwargs = settings.env, settings.env_kwargs
        if settings.agent is not None:  # the processes run the agent program's episodes
            env, env_kwargs = AGENT_PROGRAM, {"agent": settings.agent, "agent_kwargs": settings.agent_kwargs}
        self.env_pool = EnvPool(env, env_kwargs, settings.num_env_processes, settings.episodes_per_env_process,
                                settings.env_timeout_s)
        self.endpoint = None
        try:
            super().__init__(config)
        except BaseException:
            self.env_pool.close_pool()
            raise
        if settings.agent is not None:
            try:
                self.endpoint = AgentEndpoint(self.tokenizer, "baton-policy", settings.tool_call_parser,
                                              settings.endpoint_host, settings.endpoint_port, settings.endpoint_token)
                self.pool.loop.run(self.endpoint.start())
            except BaseException:
                self.shutdown()
                raise
        self.services.extras.update(agentic=settings, env_pool=self.env_pool, endpoint=self.endpoint)

    def make_probe(self):
        """The weight-sync probe: the log-prob of each of a few first observations' last character."""
        from baton.workers.weight_sync import probe_batch

        data = self.val_data if self.val_data is not None and len(self.val_data) else self.train_data
        return probe_batch(self.tokenizer, [str(data[i]["prompt"]) for i in range(min(4, len(data)))], 1)

    def rollout_metrics(self, batch) -> dict[str, float]:
        """RLVR's batch metrics, and the trajectories': turns per episode, success rate, environment tokens; for an
        agent program's episodes, the tool calls that failed to parse and the sequences started again."""
        metrics = super().rollout_metrics(batch)
        data = batch.batch
        if "reward_extra/success" in data:
            metrics["agentic/success_rate"] = float(data["reward_extra/success"].float().mean())
            metrics["agentic/turns/mean"] = float(data["reward_extra/turns"].float().mean())
        for name in ("tool_call_parse_errors", "chain_resets"):  # an agent program's episodes: totals of the batch
            if f"reward_extra/{name}" in data:
                metrics[f"agent/{name}"] = float(data[f"reward_extra/{name}"].float().sum())
        env_tokens = (data["attention_mask"][:, -data["responses"].shape[1]:].bool() & ~data["response_mask"].bool())
        metrics["agentic/env_tokens/mean"] = float(env_tokens.sum(-1).float().mean())
        return metrics

    def shutdown(self) -> None:
        try:
            if getattr(self, "endpoint", None) is not None:
                self.pool.loop.run(self.endpoint.stop(), timeout_s=30)
                self.endpoint = None
            super().shutdown()
        finally:
            self.env_pool.close_pool()



__all__ = ["AgenticConfig", "AgenticPipeline"]
