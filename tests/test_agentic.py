"""Agentic multi-turn RL: the shipped environments, environments in worker processes (a raising or hanging one
costs its episode only), trajectories whose loss mask is 0 on exactly the environment's tokens, and the pipeline
for two steps, also with episodes whose environment hangs."""

from __future__ import annotations

import asyncio

import pytest

from baton.agentic import CalculatorEnv, EnvError, EnvPool, GuessNumberEnv, generate_trajectory
from baton.agentic.env import evaluate_arithmetic
from baton.agentic.rollout import AgenticSettings
from baton.engines.protocol import GenerationResult
from baton.models import load_tokenizer
from baton.pipelines.agentic import AgenticConfig, AgenticPipeline
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import RoleConfig, SamplingConfig, TrainerConfig
from baton.rollout import Sample, Status
from baton.rollout.config import RolloutSystemConfig
from baton.strategy import SamplingParams, StrategyConfig
from baton.tracking import run_metrics

THIS = "test_agentic"  # tests/ is on sys.path: functions here are importable by path
ENVS = "agentic_envs"  # tests/ is on sys.path: its misbehaving environments are importable by path


def test_guess_the_number_answers_higher_lower_and_correct():
    env = GuessNumberEnv(high=8)
    assert env.reset(3) == "guess 1-8\n" and env.reset(3) == env.reset(3)
    target = env.target
    assert env.step("x") == ("invalid\n", 0.0, False, {"valid": False})
    assert env.step("9")[0] == "invalid\n"
    if target > 1:
        assert env.step(str(target - 1))[:3] == ("higher\n", 0.0, False)
    if target < 8:
        assert env.step(f" {target + 1}\n")[:3] == ("lower\n", 0.0, False)
    assert env.step(str(target))[:3] == ("correct\n", 1.0, True)
    targets = []
    for seed in range(20):
        env.reset(seed)
        targets.append(env.target)
    assert len(set(targets)) > 4 and all(1 <= t <= 8 for t in targets)  # seeds spread the targets
    env.reset(3)
    assert env.target == target  # the same seed, the same episode


def test_the_calculator_tool_evaluates_arithmetic_only():
    env = CalculatorEnv(max_operand=9)
    question = env.reset(0)
    assert question.startswith("what is ") and question.endswith("?\n")
    value = evaluate_arithmetic(env.question)
    assert env.step(f"calc {env.question}") == (f"= {value}\n", 0.0, False, {"tool": True})
    assert env.step("calc __import__('os')")[0] == "= error\n"
    assert env.step("hello")[0] == "use calc or answer\n"
    assert env.step(f"answer {value + 1}")[:3] == ("wrong\n", 0.0, True)
    env.reset(0)
    assert env.step(f"answer {value}")[:3] == ("right\n", 1.0, True)
    for bad in ("2**100", "x+1", "open('f')", "1/2"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)


@pytest.mark.timeout(120)  # the pool's 1 s limit ends the hung step; a pool that waited on it would hang here
def test_the_pool_contains_an_environment_that_raises_hangs_or_dies():
    async def scenario(pool: EnvPool):
        assert await pool.reset("good", 2) == "guess 1-8\n"
        with pytest.raises(EnvError, match=r"episode 'odd': reset\(\) failed: the environment raised: ValueError: seed 1"):
            await pool.reset("odd", 1)
        await pool.close("odd")
        await pool.reset("hangs", 4)
        # What ended the wait: the pool's limit (env timeout_s), not the environment, which sleeps for an hour.
        with pytest.raises(EnvError, match=r"'hangs': the environment ran past 1 s \(env timeout_s\) in step\(\)"):
            await pool.step("hangs", "1")
        with pytest.raises(EnvError, match="'hangs' was lost earlier"):
            await pool.step("hangs", "2")
        assert (await pool.step("good", "1"))[0] in ("higher\n", "correct\n")  # its own process: unharmed
        await pool.close("hangs")
        assert pool.num_restarts == 1  # the hung episode's process, once it held no episode
        await pool.reset("dies", 6)
        with pytest.raises(EnvError, match=r"'dies': step\(\) failed: its environment process died"):
            await pool.step("dies", "1")
        await pool.close("dies")
        assert pool.num_restarts == 2
        assert await pool.reset("again", 10) == "guess 1-8\n"
        assert (await pool.step("again", "1"))[0] in ("higher\n", "correct\n")
        for key in ("good", "again"):
            await pool.close(key)
        assert pool.num_episodes == 0

    pool = EnvPool(f"{ENVS}:BrokenEnv", num_processes=2, timeout_s=1.0)
    try:
        asyncio.run(scenario(pool))
    finally:
        pool.close_pool()


def test_the_pool_bounds_the_wait_for_a_free_process_and_refuses_a_bad_path():
    async def scenario(pool: EnvPool):
        await pool.reset("a", 0)
        with pytest.raises(EnvError, match=r"no environment process had room within 0.2 s \(1 × 1 episodes\)"):
            await pool.reset("b", 0)
        await pool.close("a")
        await pool.reset("b", 0)  # free again
        await pool.close("b")

    pool = EnvPool("baton.agentic.env:GuessNumberEnv", num_processes=1, episodes_per_process=1, acquire_timeout_s=0.2)
    try:
        asyncio.run(scenario(pool))
    finally:
        pool.close_pool()
    with pytest.raises(ValueError, match="environment 'no_such:Env' cannot be imported"):
        EnvPool("no_such:Env")


class ScriptedArgs:
    """What `generate_trajectory` uses of a RolloutContext, with an engine that answers with scripted turns."""

    def __init__(self, turns: list[str], pool: EnvPool, settings: AgenticSettings):
        self.tokenizer = load_tokenizer(None)
        self.extras = {"agentic": settings, "env_pool": pool}
        self.turns, self.requests = list(turns), []

    def request_id(self, sample: Sample) -> str:
        return f"r{len(self.requests)}"

    async def generate_request(self, request, affinity_key=None) -> GenerationResult:
        self.requests.append((request, affinity_key))
        ids = tuple(self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"])
        return GenerationResult(request.request_id, ids, tuple([-0.5] * len(ids)), tuple([7] * len(ids)), 7, "stop")


def test_a_trajectory_masks_exactly_the_environments_tokens():
    settings = AgenticSettings(max_turns=4)
    pool = EnvPool("baton.agentic.env:GuessNumberEnv", num_processes=1)
    try:
        env = GuessNumberEnv()
        prompt = env.reset(11)
        target = env.target
        wrong = 1 if target != 1 else 2
        args = ScriptedArgs([f"{wrong}\n", f"{target}\n"], pool, settings)
        prompt_ids = args.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        sample = Sample(0, 0, prompt, prompt_ids, seed=5, metadata={"env_seed": 11})
        sample = asyncio.run(generate_trajectory(args, sample, SamplingParams()))
    finally:
        pool.close_pool()
    hint = "higher\n" if wrong < target else "lower\n"
    pieces = [(f"{wrong}\n", 1), (hint, 0), (f"{target}\n", 1)]
    expected_ids = [t for text, _ in pieces for t in args.tokenizer(text, add_special_tokens=False)["input_ids"]]
    expected_mask = [m for text, m in pieces for _ in text]
    assert sample.response_ids == expected_ids and sample.loss_mask == expected_mask
    assert sample.rollout_log_probs == [-0.5 if m else 0.0 for m in expected_mask]
    assert sample.weight_versions == [7 if m else -1 for m in expected_mask]
    sample.check()
    assert sample.status == Status.COMPLETED and sample.response == f"{wrong}\n{hint}{target}\n"
    assert sample.metadata["trajectory_reward"] == {"score": 1.0, "turns": 2.0, "success": 1.0}
    (first, key), (second, same_key) = args.requests
    assert first.prompt_ids == tuple(prompt_ids)  # each turn sends the whole conversation, on one engine
    assert second.prompt_ids == tuple(prompt_ids) + tuple(expected_ids[:len(f"{wrong}\n{hint}")])
    assert key == same_key and first.params.seed == 5 and second.params.seed == 6
    newline = args.tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    assert first.params.stop_token_ids == (newline, args.tokenizer.eos_token_id)  # a turn ends at its newline


def test_the_turn_limit_and_the_token_budget_truncate():
    for settings, turns, length in [(AgenticSettings(max_turns=2), 2, None), (AgenticSettings(max_tokens=5), None, 5)]:
        pool = EnvPool("baton.agentic.env:GuessNumberEnv", {"high": 99}, num_processes=1)
        try:
            args = ScriptedArgs(["0\n"] * 10, pool, settings)  # "invalid" every turn
            sample = Sample(0, 0, "guess 1-99\n", [5], metadata={"env_seed": 0})
            sample = asyncio.run(generate_trajectory(args, sample, SamplingParams()))
        finally:
            pool.close_pool()
        assert sample.status == Status.TRUNCATED
        assert sample.metadata["trajectory_reward"]["success"] == 0.0
        if turns is not None:
            assert sample.metadata["trajectory_reward"]["turns"] == turns
        if length is not None:
            assert sample.response_length == length  # "0\n" + "inv" of "invalid\n"
            assert sample.loss_mask == [1, 1, 0, 0, 0]


PLAYED: list[tuple[bool, Sample]] = []  # (evaluation, the sample) of every episode recorded_trajectory played


async def recorded_trajectory(args, sample: Sample, params: SamplingParams) -> Sample:
    """The shipped generate function, each episode it plays recorded."""
    sample = await generate_trajectory(args, sample, params)
    PLAYED.append((args.evaluation, sample))
    return sample


def training_episodes() -> list[Sample]:
    return [sample for evaluation, sample in PLAYED if not evaluation]


def tiny(run_dir, num_steps=2, env="baton.agentic.env:GuessNumberEnv", **settings) -> AgenticConfig:
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"))
    return AgenticConfig(
        actor=role, rollout=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"), world_size=1),
        sampling=SamplingConfig(num_samples_per_prompt=2),
        trainer=TrainerConfig(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, num_steps=num_steps,
                              val_every_steps=num_steps, save_every_steps=num_steps, progress_bar=False),
        agentic=AgenticSettings(env=env, **{"max_turns": 3, "num_train_episodes": 32, "num_val_episodes": 4,
                                            **settings}),
        rollout_system=RolloutSystemConfig(generate_function=f"{THIS}:recorded_trajectory"))


def test_the_pipeline_trains_on_trajectories_for_two_steps(tmp_path):
    PLAYED.clear()
    summary = run_pipeline(AgenticPipeline, tiny(tmp_path, env=f"{ENVS}:LuckyGuessEnv"))
    steps = run_metrics(str(tmp_path))
    assert sorted(steps) == [0, 1, 2]
    last = steps[2]
    episodes = training_episodes()
    assert len(episodes) == 2 * 8  # 4 prompts of 2 episodes a step, the second step's last
    rewards = [sample.metadata["trajectory_reward"] for sample in episodes[8:]]
    # The step's metrics are its 8 episodes': success, turns, score (1 for a right guess) and environment tokens.
    assert last["agentic/success_rate"] == pytest.approx(sum(r["success"] for r in rewards) / 8)
    assert last["agentic/turns/mean"] == pytest.approx(sum(r["turns"] for r in rewards) / 8)
    assert last["critic/score/mean"] == pytest.approx(sum(r["score"] for r in rewards) / 8)
    assert 0 < sum(r["success"] for r in rewards) < 8 and len({r["turns"] for r in rewards}) > 1  # they vary
    env_tokens = [sample.loss_mask.count(0) for sample in episodes[8:]]
    assert last["agentic/env_tokens/mean"] == pytest.approx(sum(env_tokens) / 8)
    assert last["agentic/env_tokens/mean"] > 0  # the hints are in the trajectories, masked out
    assert "actor/pg_loss" in last and summary["final_val_accuracy"] is not None


def test_episodes_whose_environment_raises_or_hangs_are_dropped_not_the_step(tmp_path):
    PLAYED.clear()
    config = tiny(tmp_path, num_steps=1, env=f"{ENVS}:FlakyEnv", env_timeout_s=1.0, num_val_episodes=0)
    config.trainer.val_before_train = False
    run_pipeline(AgenticPipeline, config)
    steps = run_metrics(str(tmp_path))
    assert sorted(steps) == [1]
    record = steps[1]
    # FlakyEnv raises or hangs in step() on odd seeds: exactly those episodes failed, each counted, and their
    # groups (a prompt's episodes share its seed) dropped.
    failed = [s for s in training_episodes() if s.status == Status.FAILED]
    assert failed and {s.metadata["env_seed"] % 2 for s in failed} == {1}
    assert all(s.metadata["env_seed"] % 2 == 0 for s in training_episodes() if s.status != Status.FAILED)
    assert record["rollout/num_dropped/failed_samples"] == len(failed)
    assert record["rollout/num_dropped/failed_groups"] == len(failed) / 2
    assert record["rollout/num_groups"] == 4 and "actor/pg_loss" in record
