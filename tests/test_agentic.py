"""Agentic multi-turn RL: the shipped environments, environments in worker processes (a raising or hanging one
costs its episode only), trajectories whose loss mask is 0 on exactly the environment's tokens, and the pipeline
for two steps, also with episodes whose environment hangs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import random
import types

import pytest
import torch

from baton.agentic import CalculatorEnv, EnvError, EnvPool, GuessNumberEnv, generate_trajectory
from baton.agentic.env import evaluate_arithmetic
from baton.agentic.rollout import AgenticSettings
from baton.config import ConfigError
from baton.engines.protocol import GenerationRequest, GenerationResult
from baton.models import load_tokenizer
from baton.pipelines.agentic import AgenticConfig, AgenticPipeline
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import RoleConfig, SamplingConfig, TrainerConfig
from baton.rollout import Sample, Status
from baton.rollout.config import RolloutSystemConfig
from baton.rollout.context import RolloutContext, RolloutServices
from baton.rollout.functions import reset_sample
from baton.strategy import SamplingParams, StrategyConfig
from baton.tracking import run_metrics
from conftest import wait_until

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
        with pytest.raises(EnvError, match=r"'hangs': the environment ran past 1 s in step\(\)"):
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

    def __init__(self, turns: list[str], pool: EnvPool, settings: AgenticSettings, partial_rollout: bool = False):
        self.tokenizer = load_tokenizer(None)
        self.extras = {"agentic": settings, "env_pool": pool}
        self.config = RolloutSystemConfig(partial_rollout=partial_rollout)
        self.turns, self.requests = list(turns), []

    def request_id(self, sample: Sample) -> str:
        return f"r{len(self.requests)}"

    async def generate_request(self, request, affinity_key=None) -> GenerationResult:
        self.requests.append((request, affinity_key))
        turn = self.turns.pop(0)  # "abort: <text>": the engine was aborted with that much of the turn made
        reason, turn = ("abort", turn.removeprefix("abort: ")) if turn.startswith("abort: ") else ("stop", turn)
        ids = tuple(self.tokenizer(turn, add_special_tokens=False)["input_ids"])
        return GenerationResult(request.request_id, ids, tuple([-0.5] * len(ids)), tuple([7] * len(ids)), 7, reason)


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


@pytest.mark.parametrize("env,saves", [("CountingEnv", True), ("ForgetfulCountingEnv", False)])
def test_an_aborted_episode_continues_from_its_next_turn_where_its_environment_saves_its_state(env, saves):
    settings = AgenticSettings(env=f"{ENVS}:{env}", max_turns=5)
    pool = EnvPool(f"{ENVS}:{env}", num_processes=1)
    try:
        args = ScriptedArgs(["a\n", "ab"], pool, settings, partial_rollout=True)  # cut short in its second turn
        prompt_ids = args.tokenizer("count\n", add_special_tokens=False)["input_ids"]
        args.turns[1] = "abort: ab"
        sample = Sample(0, 0, "count\n", prompt_ids, seed=5, metadata={"env_seed": 3})
        sample = asyncio.run(generate_trajectory(args, sample, SamplingParams()))
        assert sample.status == Status.ABORTED
        reset_sample(sample, keep_tokens=True)  # as the abort leaves it in the buffer, and a checkpoint saves it
        sample = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
        args.turns, args.requests = ["b\n", "c\n", "d\n"], []
        sample = asyncio.run(generate_trajectory(args, sample, SamplingParams()))
    finally:
        pool.close_pool()
    assert sample.status == Status.COMPLETED and "partial_state" not in sample.metadata
    if saves:  # the first turn and its answer kept; the second played again (same seed), the count restored
        assert sample.response == "a\nseen 1\nb\nseen 2\nc\n"
        assert [request.params.seed for request, _ in args.requests] == [6, 7]
        assert sample.metadata["trajectory_reward"] == {"score": 1.0, "turns": 3.0, "success": 1.0}
    else:  # played again from the start
        assert sample.response == "b\nseen 1\nc\nseen 2\nd\n"
        assert [request.params.seed for request, _ in args.requests] == [5, 6, 7]
    assert sample.loss_mask == [0 if piece.startswith("seen") else 1 for piece in sample.response.splitlines(True)
                                for _ in piece]
    sample.check()


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


def test_deterministic_async_episodes_repeat_and_resume_exactly(tmp_path):
    """rollout_system.deterministic with multi-turn episodes whose environments answer after random delays: each
    turn of a rollout's episodes goes to the engines in one batch once every episode has its environment's answer
    (lockstep), so two runs of one seed log the same
    metrics and end with the same weights, and a run resumed from the checkpoint of step 2 (the rollouts it ran
    ahead, episodes included) logs what the run that went on logged."""
    from safetensors.torch import load_file

    def config(name: str) -> AgenticConfig:
        made = tiny(tmp_path / name, num_steps=4, env=f"{ENVS}:JitteryLuckyGuessEnv")
        made.rollout_system = dataclasses.replace(made.rollout_system, mode="async", max_staleness=2,
                                                  deterministic=True)
        made.trainer.save_every_steps = 2
        return made

    for name in ("first", "second"):
        run_pipeline(AgenticPipeline, config(name))
    resumed = config("resumed")
    resumed.trainer.resume = str(tmp_path / "first" / "checkpoints" / "step_2")
    run_pipeline(AgenticPipeline, resumed)
    first, second = run_metrics(str(tmp_path / "first")), run_metrics(str(tmp_path / "second"))
    assert first == second and len({first[step]["agentic/turns/mean"] for step in (1, 2, 3, 4)}) > 1
    assert run_metrics(str(tmp_path / "resumed")) == {step: first[step] for step in (3, 4)}
    weights = [load_file(tmp_path / name / "checkpoints" / "step_4" / "actor" / "model.safetensors")
               for name in ("first", "second", "resumed")]
    assert all(torch.equal(weights[0][key], other[key]) for other in weights[1:] for key in weights[0])


def test_deterministic_episodes_must_fit_the_environments_at_once(tmp_path):
    config = tiny(tmp_path, num_env_processes=1, episodes_per_env_process=4)
    config.rollout_system = dataclasses.replace(config.rollout_system, deterministic=True, mode="one_step_off")
    with pytest.raises(ConfigError, match=r"plays a rollout's 8 episodes in lockstep, but the environments hold 4"):
        config.check()


class RecordingRouter:
    """A router that answers every request at once with one token, recording each submit's requests by sample."""

    def __init__(self):
        self.submits: list[list[tuple[int, int]]] = []

    def submit(self, requests, affinity_keys=None):
        self.submits.append([tuple(int(part[1:]) for part in r.request_id.split("-")[:2]) for r in requests])
        futures = []
        for request in requests:
            futures.append(concurrent.futures.Future())
            futures[-1].set_result(GenerationResult(request.request_id, (5,), (-1.0,), (0,), 0, "stop"))
        return futures


async def jittery_turns(args, sample: Sample, params: SamplingParams) -> Sample:
    """1 to 3 turns (by group), each after a random 0–10 ms wait (unseeded), as environments answer."""
    for turn in range(1 + sample.group_index % 3):
        await asyncio.sleep(random.SystemRandom().uniform(0.0, 0.01))
        await args.generate_request(GenerationRequest(args.request_id(sample), (1,), params))
    return sample


def test_deterministic_mode_batches_each_turn_of_every_episode_together():
    """Lockstep, as a router sees it: the first turns of all 12 samples in one submit, then the second turns of
    the 8 still playing, then the third turns of 4, each sorted by sample, however the waits between turns fall."""
    router = RecordingRouter()
    config = RolloutSystemConfig(deterministic=True, mode="one_step_off", generate_function=f"{THIS}:jittery_turns")
    pool = types.SimpleNamespace(router=router, config=config, version=0)
    services = RolloutServices(pool, rewarder=None, tokenizer=None)
    ctx = RolloutContext(services, SamplingParams(), num_groups_per_step=6)
    samples = [Sample(group, index, "p", [1]) for group in range(6) for index in range(2)]

    async def play():
        await asyncio.gather(*(ctx.generate(sample, SamplingParams()) for sample in reversed(samples)))

    asyncio.run(play())
    by_turns = [[(s.group_index, s.sample_index) for s in samples if s.group_index % 3 >= turn] for turn in range(3)]
    assert router.submits == by_turns


RESUMED: list[tuple[str, Sample]] = []  # (the partial response it was drawn with, the sample played to its end)


async def resumable_trajectory(args, sample: Sample, params: SamplingParams) -> Sample:
    """The shipped generate function, each training episode that continued a partial one recorded."""
    before = sample.response if sample.metadata.get("partial_state") else None
    sample = await generate_trajectory(args, sample, params)
    if before is not None and not args.evaluation:
        RESUMED.append((before, sample))
    return sample


def test_episodes_cut_short_by_a_stop_are_saved_with_their_environments_and_continue(tmp_path):
    """Async agentic with partial rollouts: the producer stops (as it does for a checkpoint) while its episodes wait
    on their environments after one turn; its state, as a checkpoint holds it, keeps each episode's turn and its
    environment's state (the count so far), and the episodes drawn from it again play on from there, not from the
    start: the count goes on, 3 turns in all."""
    RESUMED.clear()
    config = tiny(tmp_path, num_steps=1, env=f"{ENVS}:SlowCountingEnv", max_turns=4, max_tokens_per_turn=2,
                  num_val_episodes=0)
    config.rollout_system = dataclasses.replace(config.rollout_system, mode="async", max_staleness=1,
                                                partial_rollout=True, generate_function=f"{THIS}:resumable_trajectory")
    pipeline = AgenticPipeline(config)
    try:
        producer = pipeline.producer
        producer.start_continuous()  # 16 episodes: 2 steps' 4 groups of 2, within the bound
        wait_until(lambda: pipeline.pool.router.metrics()["router/engine_0/served"] >= 16,
                   "every episode's first turn", timeout_s=120)
        producer.stop_continuous()  # each waits 1 s on its environment: aborted at its next request
        state = json.loads(json.dumps(producer.state_dict()))
        partial = [Sample.from_dict(d) for group in state["data_source"]["buffer"] for d in group
                   if d["metadata"].get("partial_state")]
        producer.load_state_dict(state)
        groups, _ = producer.generate(rollout_id=1)  # the buffer's first
    finally:
        pipeline.shutdown()
    assert len(partial) == 16
    for sample in partial:
        assert sample.metadata["partial_state"] == {"rewards": [0.0], "env_state": {"seen": 1}}
        assert sample.response.endswith("seen 1\n") and sample.status == Status.PENDING
    assert len(RESUMED) == 8 and {before for before, _ in RESUMED} <= {s.response for s in partial}
    for before, sample in RESUMED:
        assert sample.response.startswith(before) and sample.response.count("seen") == 2
        assert sample.metadata["trajectory_reward"]["turns"] == 3.0 and sample.status == Status.COMPLETED
    first = [group[0]["group_index"] for group in state["data_source"]["buffer"][:4]]
    assert sorted(group[0].group_index for group in groups) == sorted(first)  # the rollout drew them first
