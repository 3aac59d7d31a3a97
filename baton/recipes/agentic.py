"""The agentic example: SFT on a weak teacher's games of guess-the-number (`baton.agentic.demos`), then GRPO on the
environment from its checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from baton.agentic.rollout import AgenticSettings
from baton.pipelines.agentic import AgenticConfig
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.recipes.demo import DemoConfig, DemoPipeline
from baton.strategy import OptimizerConfig, StrategyConfig


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

    pipeline_cls: str = "baton.recipes.agentic:AgenticDemoPipeline"
    run_dir: str = "runs/agentic"
    sft: SFTConfig = field(default_factory=_warm_up)
    rlvr: AgenticConfig = field(default_factory=_agentic_rl)


class AgenticDemoPipeline(DemoPipeline):
    config_cls = AgenticDemoConfig
    second_pipeline_cls = "baton.pipelines.agentic:AgenticPipeline"


def _agent_warm_up() -> SFTConfig:
    """The agent example's first stage: SFT on the weak teacher's games as chat conversations."""
    from baton.agentic.demos import CHAT_DEMOS_FILE

    config = _warm_up()
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, run_dir="runs/agent/sft"),
                               data=DataConfig(task="files", train_path=CHAT_DEMOS_FILE, response_key="response",
                                               max_prompt_len=32))


def _agent_rl() -> AgenticConfig:
    """The agent example's second stage: GRPO on the episodes the agent program plays through the endpoint."""
    from baton.agentic.demos import HIGH, MAX_TURNS

    turn_loop = _agentic_rl()
    return AgenticConfig(
        actor=turn_loop.actor, rollout=turn_loop.rollout, sampling=turn_loop.sampling,
        agentic=AgenticSettings(env_kwargs={"high": HIGH}, agent="baton.agentic.agents.guess_number:play",
                                agent_kwargs={"high": HIGH, "max_turns": MAX_TURNS}, max_turns=MAX_TURNS,
                                max_tokens_per_turn=3, max_tokens=96, num_val_episodes=200),
        trainer=dataclasses.replace(turn_loop.trainer, run_dir="runs/agent/rlvr"))


@dataclass
class AgentDemoConfig(DemoConfig):
    """The agent example: guess-the-number played by an agent program written against the `openai` client
    (`baton.agentic.agents.guess_number`) through the OpenAI-compatible endpoint. SFT on the weak teacher's games as
    chat conversations, then GRPO on the program's episodes, trained on the tokens the endpoint sampled."""

    pipeline_cls: str = "baton.recipes.agentic:AgentDemoPipeline"
    run_dir: str = "runs/agent"
    sft: SFTConfig = field(default_factory=_agent_warm_up)
    rlvr: AgenticConfig = field(default_factory=_agent_rl)


class AgentDemoPipeline(DemoPipeline):
    config_cls = AgentDemoConfig
    second_pipeline_cls = "baton.pipelines.agentic:AgenticPipeline"
