"""Fast learning tests: each trainer, on a task its untrained model already scores on now and then, must lift that
score by far more than the seed-to-seed spread. The task (tests/learning_tasks.py) is a contextual bandit over the
character tokenizer: 48 training prompts and 16 held-out ones, a one-character answer, reward 1 for a character of
the prompt's set (about a fifth of the untrained tiny model's answers). Reward is read from validation on the held-out
prompts at temperature 1, 16 samples of each, before the first step and after the last.

The default suite runs seed 0; `BATON_LEARNING_SEEDS=0,1,2,3,4 .venv/bin/python -m pytest tests/test_learning.py`
runs the five seeds the spreads below were measured on (docs/learning-tests.md). Torch runs on one thread, so a seed
gives the same figures on one machine; other CPUs (AVX2 against AVX-512 kernels) may give others, which is why each
threshold sits far below the lift every seed reached."""

from __future__ import annotations

import os

import pytest
import torch

from baton.agentic.rollout import AgenticSettings
from baton.pipelines.agentic import AgenticConfig, AgenticPipeline
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import (AlgorithmConfig, DataConfig, RLVRConfig, RoleConfig, SamplingConfig, SFTConfig,
                                    TrainerConfig)
from baton.pipelines.dag import DAGConfig, DAGPipeline
from baton.pipelines.distill import DistillConfig, DistillPipeline, DistillSettings
from baton.pipelines.dpo import DPOConfig, DPOPipeline, PairDataConfig, PreferenceConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.pipelines.sft import SFTPipeline
from baton.rollout.config import RolloutSystemConfig
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking import run_metrics
from learning_tasks import write_bandit, write_pairs

SEEDS = [int(seed) for seed in os.environ.get("BATON_LEARNING_SEEDS", "0").split(",")]
REWARD = "learning_tasks:first_in_set"  # tests/ is on sys.path
VAL_SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=1, num_samples_per_prompt=16)
DRIVERS = {"loop": (RLVRPipeline, RLVRConfig), "rollout_system": (RolloutRLVRPipeline, RolloutRLVRConfig),
           "dag": (DAGPipeline, DAGConfig)}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: the same seed gives the same figures on this machine, whatever else runs beside it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def role(seed: int, lr: float, **strategy) -> RoleConfig:
    return RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", seed=seed, optimizer=OptimizerConfig(lr=lr),
                                              **strategy))


def trainer(run_dir, seed: int, num_steps: int, num_prompts_per_step: int = 4) -> TrainerConfig:
    return TrainerConfig(backend="local", run_dir=str(run_dir), num_prompts_per_step=num_prompts_per_step,
                         num_steps=num_steps, val_every_steps=num_steps, save_every_steps=num_steps, seed=seed,
                         progress_bar=False)


def bandit_data(tmp_path, kinds: str = "lu") -> DataConfig:
    train_path, val_path = write_bandit(str(tmp_path), kinds)
    return DataConfig(task="files", train_path=train_path, val_path=val_path, response_key="demo")


def reward_before_and_after(run_dir) -> tuple[float, float]:
    """Validation's mean reward before the first step and after the last."""
    steps = run_metrics(str(run_dir))
    before, after = steps[0]["val/reward/mean"], steps[max(steps)]["val/reward/mean"]
    print(f"learning: {os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]} {before:.3f} -> {after:.3f}")
    return before, after


def rl_config(config_cls, tmp_path, seed: int, num_steps: int = 20, lr: float = 3e-3, run: str = "run", **fields):
    actor = role(seed, lr)
    return config_cls(actor=actor, rollout=actor, data=bandit_data(tmp_path), reward_fn=REWARD,
                      sampling=SamplingConfig(max_new_tokens=1, num_samples_per_prompt=8), val_sampling=VAL_SAMPLING,
                      trainer=trainer(tmp_path / run, seed, num_steps), **fields)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_grpo_learns_the_bandit_in_each_driver(tmp_path, driver, seed):
    """GRPO, 20 steps of 4 prompts x 8 samples, in the loop, the rollout system (sync) and the workflow graph."""
    pipeline_cls, config_cls = DRIVERS[driver]
    run_pipeline(pipeline_cls, rl_config(config_cls, tmp_path, seed))
    before, after = reward_before_and_after(tmp_path / "run")
    # 5 seeds: before 0.19-0.26, after 0.86-0.96, lift +0.64-+0.76 (the loop and the DAG: the same figures, seed for
    # seed); threshold 0.5
    assert after - before > 0.5, (before, after)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
def test_rloo_and_reinforce_plus_plus_learn_the_bandit(tmp_path, estimator, seed):
    run_pipeline(RLVRPipeline, rl_config(RLVRConfig, tmp_path, seed, algorithm=AlgorithmConfig(adv_estimator=estimator)))
    before, after = reward_before_and_after(tmp_path / "run")
    # 5 seeds: before 0.19-0.21, after 0.83-0.96, lift RLOO +0.64-+0.75, REINFORCE++ +0.72-+0.76; threshold 0.5
    assert after - before > 0.5, (before, after)


@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_with_a_critic_learns_the_bandit(tmp_path, seed):
    """GAE on a value model's values; the critic learns beside the actor. Eight prompts a step: with four, a step of
    one kind of prompt now and then pushed the policy onto one case for every prompt, which one seed in ten (seed 4)
    had not left after 40 steps (0.49); with eight, ten seeds reached 0.945-0.984 in 20 steps."""
    critic = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", kind="value", seed=seed,
                                                optimizer=OptimizerConfig(lr=3e-3)))
    config = rl_config(RLVRConfig, tmp_path, seed, critic=critic, algorithm=AlgorithmConfig(adv_estimator="gae"))
    config.trainer.num_prompts_per_step = 8
    run_pipeline(RLVRPipeline, config)
    before, after = reward_before_and_after(tmp_path / "run")
    # 5 seeds: after 0.96-0.98, lift +0.76-+0.78; threshold 0.5
    assert after - before > 0.5, (before, after)


def run_sft(run_dir, tmp_path, seed: int, num_steps: int = 40, train_path: str | None = None,
            kinds: str = "lu") -> dict[int, dict]:
    """SFT on the bandit's demonstrations (or on `train_path`'s); its metrics by step."""
    data = bandit_data(tmp_path, kinds)
    if train_path is not None:
        data.train_path = train_path
    config = SFTConfig(actor=role(seed, 3e-3), data=data, reward_fn=REWARD, val_sampling=VAL_SAMPLING,
                       trainer=trainer(run_dir, seed, num_steps))
    run_pipeline(SFTPipeline, config)
    return run_metrics(str(run_dir))


@pytest.mark.parametrize("seed", SEEDS)
def test_sft_learns_the_demonstrations(tmp_path, seed):
    """SFT on one demonstration per prompt: its loss falls and the reward of sampled answers rises."""
    steps = run_sft(tmp_path / "run", tmp_path, seed)
    losses = [steps[step]["sft/loss"] for step in sorted(steps) if "sft/loss" in steps[step]]
    print(f"learning: SFT loss, last/first {losses[-1] / losses[0]:.3f}")
    before, after = reward_before_and_after(tmp_path / "run")
    # 5 seeds: last/first loss 0.42-0.48; lift +0.21-+0.25; thresholds 0.7, 0.1
    assert losses[-1] < 0.7 * losses[0], losses
    assert after - before > 0.1, (before, after)


@pytest.mark.parametrize("seed", SEEDS)
def test_dpo_learns_to_prefer_the_chosen_answers(tmp_path, seed):
    """The "l" half of the bandit (lowercase wanted): every other character rejected against a lowercase one. At lr
    3e-3 three of five seeds moved the mass onto the end of text, which no pair can reject (a response is never
    empty), and lost reward; at 1e-3 all five gained."""
    config = DPOConfig(actor=role(seed, 1e-3, micro_batch_size_per_worker=16),
                       pairs=PairDataConfig(train_path=write_pairs(str(tmp_path), "l")),
                       algorithm=PreferenceConfig(loss_type="sigmoid", beta=0.1), data=bandit_data(tmp_path, "l"),
                       reward_fn=REWARD, val_sampling=VAL_SAMPLING,
                       trainer=trainer(tmp_path / "run", seed, 60, num_prompts_per_step=16))
    run_pipeline(DPOPipeline, config)
    before, after = reward_before_and_after(tmp_path / "run")
    # 5 seeds: before 0.15-0.18, after 0.62-0.94, lift +0.44-+0.79; threshold 0.25
    assert after - before > 0.25, (before, after)


@pytest.mark.parametrize("seed", SEEDS)
def test_on_policy_distillation_learns_from_a_grpo_teacher(tmp_path, seed):
    """The teacher: the GRPO test's model (another seed's weights); the student starts fresh and distils it on its
    own samples, never seeing a reward or a demonstration. (An SFT teacher, on one demonstration per prompt, scored
    0.46-0.94 on the held-out prompts from seed to seed: too uneven a target.)"""
    run_pipeline(RLVRPipeline, rl_config(RLVRConfig, tmp_path, seed + 100, run="teacher"))
    teacher = RoleConfig(strategy=StrategyConfig(model=str(tmp_path / "teacher" / "checkpoints" / "step_20" / "actor")))
    config = DistillConfig(actor=role(seed, 3e-3), teacher=teacher,
                           algorithm=DistillSettings(mode="on_policy", loss_type="reverse_kl"),
                           data=bandit_data(tmp_path), reward_fn=REWARD,
                           sampling=SamplingConfig(temperature=1.0, max_new_tokens=1, num_samples_per_prompt=4),
                           val_sampling=VAL_SAMPLING, trainer=trainer(tmp_path / "run", seed, 30))
    run_pipeline(DistillPipeline, config)
    before, after = reward_before_and_after(tmp_path / "run")
    # 5 seeds: after 0.77-0.91, lift +0.56-+0.71; threshold 0.4
    assert after - before > 0.4, (before, after)


@pytest.mark.parametrize("seed", SEEDS)
def test_agentic_grpo_learns_both_turns_of_two_doors(tmp_path, seed):
    """Multi-turn: a lowercase letter after "go", then an uppercase one after "ok" (tests/learning_tasks.py's
    TwoDoorsEnv); the reward sums the turns'."""
    actor = role(seed, 3e-3)
    config = AgenticConfig(actor=actor, rollout=actor, reward_fn=REWARD,
                           sampling=SamplingConfig(num_samples_per_prompt=8),
                           val_sampling=SamplingConfig(temperature=1.0, num_samples_per_prompt=16),
                           trainer=trainer(tmp_path / "run", seed, 40),
                           agentic=AgenticSettings(env="learning_tasks:TwoDoorsEnv", max_turns=2, max_tokens_per_turn=1,
                                                   max_tokens=8, num_env_processes=1, num_train_episodes=32,
                                                   num_val_episodes=8),
                           rollout_system=RolloutSystemConfig())
    run_pipeline(AgenticPipeline, config)
    before, after = reward_before_and_after(tmp_path / "run")
    # 5 seeds: before 0.09-0.12, after 0.97-1.00, lift +0.86-+0.90; threshold 0.6
    assert after - before > 0.6, (before, after)
