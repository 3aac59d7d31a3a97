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

from baton.agentic.pool import EnvPool
from baton.agentic.rollout import VAL_SEED_OFFSET, AgenticSettings, episode_rows
from baton.config import ConfigError
from baton.datasets import PromptDataset
from baton.models import load_tokenizer
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.demo import DemoConfig, DemoPipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.strategy import OptimizerConfig, StrategyConfig

GENERATE = "baton.agentic.rollout:generate_trajectory"
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
        self.rollout_system = dataclasses.replace(system, generate_function=system.generate_function or GENERATE,
                                                  reward_function=system.reward_function or REWARD)

    def check(self) -> None:
        super().check()
        if self.rollout_system.partial_rollout:
            raise ConfigError("rollout_system.partial_rollout: an episode does not resume part-way (its environment's "
                              "state is gone); set partial_rollout: false, and an aborted episode is played again")
        if self.loss != "policy":
            raise ConfigError(f"loss {self.loss!r}: agentic runs train the policy on its trajectories; use loss: policy")


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
        self.env_pool = EnvPool(settings.env, settings.env_kwargs, settings.num_env_processes,
                                settings.episodes_per_env_process, settings.env_timeout_s)
        try:
            super().__init__(config)
        except BaseException:
            self.env_pool.close_pool()
            raise
        self.rollouts.extras.update(agentic=settings, env_pool=self.env_pool)

    def make_probe(self):
        """The weight-sync probe: the log-prob of each of a few first observations' last character."""
        from baton.workers.weight_sync import probe_batch

        data = self.val_data if self.val_data is not None and len(self.val_data) else self.train_data
        return probe_batch(self.tokenizer, [str(data[i]["prompt"]) for i in range(min(4, len(data)))], 1)

    def rollout_metrics(self, batch) -> dict[str, float]:
        """RLVR's batch metrics, and the trajectories': turns per episode, success rate, environment tokens."""
        metrics = super().rollout_metrics(batch)
        data = batch.batch
        if "reward_extra/success" in data:
            metrics["agentic/success_rate"] = float(data["reward_extra/success"].float().mean())
            metrics["agentic/turns/mean"] = float(data["reward_extra/turns"].float().mean())
        env_tokens = (data["attention_mask"][:, -data["responses"].shape[1]:].bool() & ~data["response_mask"].bool())
        metrics["agentic/env_tokens/mean"] = float(env_tokens.sum(-1).float().mean())
        return metrics

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.env_pool.close_pool()


def _warm_up() -> SFTConfig:
    """The example's first stage: SFT on the weak teacher's games (`baton.agentic.demos`)."""
    from baton.agentic.demos import DEMOS_FILE

    return SFTConfig(
        actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3))),
        data=DataConfig(task="files", train_path=DEMOS_FILE, response_key="response", max_prompt_len=16),
        trainer=TrainerConfig(num_steps=300, num_prompts_per_step=64, val_every_steps=300, save_every_steps=300,
                              run_dir="runs/agentic/sft"))


def _agentic_rl() -> AgenticConfig:
    """The example's second stage: GRPO on guess-the-number (1-7, three guesses) from the warm-up's checkpoint."""
    from baton.agentic.demos import HIGH, MAX_TURNS

    policy = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-4)))
    return AgenticConfig(
        actor=policy, rollout=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"), world_size=1),
        agentic=AgenticSettings(env_kwargs={"high": HIGH}, max_turns=MAX_TURNS, max_tokens_per_turn=3,
                                num_val_episodes=200),
        sampling=SamplingConfig(temperature=1.0, num_samples_per_prompt=8),
        trainer=TrainerConfig(num_steps=60, num_prompts_per_step=16, val_every_steps=20, save_every_steps=60,
                              run_dir="runs/agentic/rlvr"))


@dataclass
class AgenticDemoConfig(DemoConfig):
    """The agentic example: SFT on the weak teacher's games, then GRPO on the environment from its checkpoint
    (`DemoConfig`'s two stages; the rlvr stage is the agentic one). `start_val_accuracy` / `final_val_accuracy`
    in the summary are the greedy policy's win rates on the held-out episodes before and after GRPO."""

    pipeline_cls: str = "baton.pipelines.agentic:AgenticDemoPipeline"
    run_dir: str = "runs/agentic"
    sft: SFTConfig = field(default_factory=_warm_up)
    rlvr: AgenticConfig = field(default_factory=_agentic_rl)


class AgenticDemoPipeline(DemoPipeline):
    config_cls = AgenticDemoConfig
    second_pipeline_cls = "baton.pipelines.agentic:AgenticPipeline"


__all__ = ["AgenticConfig", "AgenticDemoConfig", "AgenticDemoPipeline", "AgenticPipeline"]
