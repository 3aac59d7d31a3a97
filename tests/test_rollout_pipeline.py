"""RLVR on the rollout system (`RolloutRLVRPipeline`), on the local backend with the tiny model: the three modes and
their staleness bound (also across a resume), exact resume, dump → replay, rollout-only, the SFT rollout function,
custom functions by import path, over-sampling with a filter, an abort that does not wait on a slow reward, partial
rollouts resumed over two weight versions, responses cut at a token budget per rollout (and a deterministic resume
with them in the buffer), and eval per dataset."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading

import pytest
import torch

from baton.checkpoint import PIPELINE_STATE, load_state
from baton.config import ConfigError
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.rollout import Sample, Status, samples_to_data
from baton.rollout.config import RolloutSystemConfig
from baton.rollout.functions import generate_rollout, generate_sample
from baton.strategy import SamplingParams, StrategyConfig
from baton.tracking import run_metrics
from baton.workers.weight_sync import WeightSyncError
from conftest import wait_until

THIS = "test_rollout_pipeline"  # tests/ is on sys.path: functions here are importable by path


def tiny(run_dir, num_steps=4, engines=2, **system) -> RolloutRLVRConfig:
    return RolloutRLVRConfig(
        actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2")),
        rollout=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"), world_size=engines),
        data=DataConfig(max_operand=9, num_val_examples=8),
        sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
        val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
        trainer=TrainerConfig(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, val_every_steps=2,
                              save_every_steps=2, progress_bar=False, num_steps=num_steps),
        rollout_system=RolloutSystemConfig(**system))


def steps(run_dir) -> dict[int, dict]:
    """The run's metrics by training step (step 0, the validation before training, left out), timings kept."""
    return {step: record for step, record in run_metrics(str(run_dir), wall_clock=True).items() if step > 0}


@pytest.mark.parametrize("mode,bound", [("sync", 0), ("one_step_off", 1), ("async", 1)])
def test_each_mode_trains_within_its_staleness_bound(tmp_path, mode, bound):
    summary = run_pipeline(RolloutRLVRPipeline, tiny(tmp_path, mode=mode, max_staleness=1))
    by_step = steps(tmp_path)
    assert sorted(by_step) == [1, 2, 3, 4]
    for record in by_step.values():
        assert record["rollout/staleness/max"] <= bound
        assert record["rollout/num_groups"] == 4  # the step got the groups it needs
        for key in ("actor/pg_loss", "critic/score/mean", "timing_s/gen", "timing_s/sync", "router/engine_1/served"):
            assert key in record, key
    if mode == "one_step_off":  # step N+1's rollout ran while step N trained: one version old, from step 2 on
        assert [by_step[s]["rollout/staleness/max"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert summary["final_val_accuracy"] == by_step[4]["val/accuracy"]
    assert os.path.isdir(tmp_path / "checkpoints" / "step_4" / "actor")


def test_async_staleness_bound_holds_across_a_resume(tmp_path):
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path, num_steps=2, mode="async", max_staleness=1))
    config = tiny(tmp_path, num_steps=5, mode="async", max_staleness=1)
    config.trainer.resume = "latest"
    run_pipeline(RolloutRLVRPipeline, config)
    by_step = steps(tmp_path)
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    assert all(by_step[s]["rollout/staleness/max"] <= 1 for s in by_step)


def test_an_async_checkpoint_keeps_the_next_steps_groups_taken_ahead(tmp_path):
    """An overlapped step takes the next step's groups while it trains; a checkpoint saves them as the next step's,
    and a run resumed from it trains that step on them: the same metrics as the run that went on."""
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path / "first", num_steps=3, mode="async", max_staleness=1))
    checkpoint = tmp_path / "first" / "checkpoints" / "step_2"
    state = load_state(str(checkpoint / PIPELINE_STATE))
    [ahead] = state["ahead"]
    assert ahead["step"] == 3 and len(ahead["groups"]) == 4 and state["rollouts"]["consumed_steps"] == 3
    config = tiny(tmp_path / "resumed", num_steps=3, mode="async", max_staleness=1)
    config.trainer.resume = str(checkpoint)
    run_pipeline(RolloutRLVRPipeline, config)
    first, resumed = steps(tmp_path / "first"), steps(tmp_path / "resumed")
    assert sorted(resumed) == [3] and resumed[3]["rollout/staleness/max"] <= 1
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
        assert resumed[3][key] == first[3][key], key


@pytest.mark.parametrize("mode,bound,staleness", [("one_step_off", 1, [0, 1, 1, 1]), ("async", 2, [0, 1, 2, 2])])
def test_deterministic_overlapped_runs_repeat_their_metrics_and_weights(tmp_path, mode, bound, staleness):
    """rollout_system.deterministic: step t's groups sample with the weights of version t - 1 - L (L rollouts run
    ahead of training), so two runs of one seed log the same metrics (timings aside) and end with the same weights."""
    from safetensors.torch import load_file

    for name in ("first", "second"):
        config = tiny(tmp_path / name, mode=mode, max_staleness=bound, deterministic=True)
        config.algorithm = dataclasses.replace(config.algorithm, rollout_correction="token_tis")
        run_pipeline(RolloutRLVRPipeline, config)
    first, second = run_metrics(str(tmp_path / "first")), run_metrics(str(tmp_path / "second"))
    assert first == second
    assert [first[step]["rollout/staleness/max"] for step in (1, 2, 3, 4)] == staleness  # exactly L from step L + 1
    # The correction's diagnostics, and the batch and the loss split by staleness (every token L versions old).
    last = first[4]
    assert 0 < last["rollout_corr/ess"] <= 1 and last["rollout/mismatch_kl"] >= 0
    assert last[f"staleness/{bound}/token_frac"] == 1.0 and f"actor/pg_clipfrac/staleness_{bound}" in last
    weights = [load_file(tmp_path / name / "checkpoints" / "step_4" / "actor" / "model.safetensors")
               for name in ("first", "second")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


def test_a_deterministic_async_run_resumes_exactly_with_the_rollouts_it_ran_ahead(tmp_path):
    """A checkpoint of deterministic async holds the L rollouts queued ahead (`pipeline_state["ahead"]`); the run
    resumed from it logs what the run that went on logged, every metric."""
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path / "whole", mode="async", max_staleness=2, deterministic=True))
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_2"
    assert [ahead["step"] for ahead in load_state(str(checkpoint / PIPELINE_STATE))["ahead"]] == [3, 4]
    config = tiny(tmp_path / "resumed", mode="async", max_staleness=2, deterministic=True)
    config.trainer.resume = str(checkpoint)
    run_pipeline(RolloutRLVRPipeline, config)
    whole, resumed = run_metrics(str(tmp_path / "whole")), run_metrics(str(tmp_path / "resumed"))
    assert sorted(resumed) == [3, 4] and resumed[3] == whole[3] and resumed[4] == whole[4]


def model_that_stops_at_random(directory) -> str:
    """The tiny model, saved with its end-of-text logit raised so that its responses end after anywhere from one to
    eight tokens (with random weights a response otherwise runs to max_new_tokens)."""
    from baton.models.build import build_model
    from baton.models.tokenizer import load_tokenizer

    tokenizer, model = load_tokenizer(), build_model("tiny-qwen2", seed=0)
    with torch.no_grad():
        ids = tokenizer(["1+2=", "7+5="], add_special_tokens=False, return_tensors="pt")["input_ids"]
        mean = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[tokenizer.eos_token_id] = 0.3 * mean / mean.norm()
    model.save_pretrained(directory)
    return str(directory)


def test_a_deterministic_run_resumes_exactly_with_the_partial_rollouts_in_its_buffer(tmp_path):
    """max_new_tokens_per_rollout cuts each response at a recorded token boundary, so the weights change inside
    responses and a checkpoint holds partial rollouts: the groups cut go back to the buffer with their tokens, log-probs
    and versions, and continue in a later rollout on newer weights. The run resumed from step 2 continues them (the
    rollout of step 4 is made of them) and logs what the run that went on logged, and ends with the same weights."""
    from safetensors.torch import load_file

    model = model_that_stops_at_random(tmp_path / "model")

    def config(name: str) -> RolloutRLVRConfig:
        made = tiny(tmp_path / name, mode="one_step_off", deterministic=True, partial_rollout=True,
                    mask_stale_partial_tokens=True, max_new_tokens_per_rollout=3)
        made.actor = RoleConfig(strategy=StrategyConfig(model=model))
        made.rollout = dataclasses.replace(made.rollout, strategy=StrategyConfig(model=model))
        made.sampling = dataclasses.replace(made.sampling, max_new_tokens=8)
        return made

    run_pipeline(RolloutRLVRPipeline, config("whole"))
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_2"
    buffer = load_state(str(checkpoint / PIPELINE_STATE))["rollouts"]["data_source"]["buffer"]
    partial = [sample for group in buffer for sample in group if sample["response_ids"]]
    assert partial and all(sample["status"] == Status.PENDING.value for sample in partial)
    resumed = config("resumed")
    resumed.trainer.resume = str(checkpoint)
    run_pipeline(RolloutRLVRPipeline, resumed)
    whole, again = run_metrics(str(tmp_path / "whole")), run_metrics(str(tmp_path / "resumed"))
    assert whole[1]["rollout/num_cut_groups"] > 0 and whole[4]["rollout/num_partial_samples"] > 0
    assert again == {step: whole[step] for step in (3, 4)}
    weights = [load_file(tmp_path / name / "checkpoints" / "step_4" / "actor" / "model.safetensors")
               for name in ("whole", "resumed")]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


def test_free_running_async_requeues_cut_groups_and_keeps_its_bound(tmp_path):
    """The async producer puts a group cut at max_new_tokens_per_rollout back in the buffer and draws it again on the
    engines' newer weights; every step still gets its groups, within the bound."""
    model = model_that_stops_at_random(tmp_path / "model")
    config = tiny(tmp_path / "run", mode="async", max_staleness=2, partial_rollout=True, stale_policy="withhold",
                  max_new_tokens_per_rollout=3)
    config.actor = RoleConfig(strategy=StrategyConfig(model=model))
    config.rollout = dataclasses.replace(config.rollout, strategy=StrategyConfig(model=model))
    config.sampling = dataclasses.replace(config.sampling, max_new_tokens=8)
    run_pipeline(RolloutRLVRPipeline, config)
    by_step = run_metrics(str(tmp_path / "run"))
    assert sum(by_step[step].get("rollout/num_cut_groups", 0) for step in (1, 2, 3, 4)) > 0
    assert sum(by_step[step]["rollout/num_partial_samples"] for step in (1, 2, 3, 4)) > 0
    assert all(by_step[step]["rollout/num_groups"] == 4 and by_step[step]["rollout/staleness/max"] <= 2
               for step in (1, 2, 3, 4))


def test_a_cut_sample_continues_on_newer_weights_and_its_first_tokens_leave_the_loss(tmp_path):
    config = tiny(tmp_path, num_steps=1, engines=1, partial_rollout=True, mask_stale_partial_tokens=True,
                  max_new_tokens_per_rollout=2)
    pipeline = RolloutRLVRPipeline(config)
    try:
        [group] = pipeline.producer.data_source.get_samples(1)
        ctx = pipeline.producer.context()
        params = SamplingParams(temperature=1.0, max_new_tokens=5, n=1, stop_token_ids=())
        sample = ctx.run(generate_sample(ctx, group[0], params))
        assert sample.status == Status.ABORTED and sample.weight_versions == [0, 0]  # cut after 2 new tokens
        pipeline.publisher.publish(pipeline.actor, version=1)
        sample.status = Status.PENDING  # as the rollout puts it back
        sample = ctx.run(generate_sample(ctx, sample, params))
        assert sample.status == Status.ABORTED and sample.weight_versions == [0, 0, 1, 1]
        sample.status = Status.PENDING
        sample = ctx.run(generate_sample(ctx, sample, params))  # one token left: the whole bound ends it
        assert sample.status == Status.TRUNCATED and sample.weight_versions == [0, 0, 1, 1, 1]
        assert sample.loss_mask == [0, 0, 0, 0, 1] and sample.metadata["num_resumes"] == 2
    finally:
        pipeline.shutdown()


@pytest.mark.parametrize("system,message", [
    (dict(max_new_tokens_per_rollout=4), "needs partial_rollout: true"),
    (dict(max_new_tokens_per_rollout=0, partial_rollout=True), "a value >= 1"),
    (dict(max_new_tokens_per_rollout=4, partial_rollout=True, mode="async", max_staleness=2, deterministic=True),
     "first tokens are 3 versions old when it trains, over max_staleness=2"),
])
def test_cut_responses_are_refused_where_they_cannot_train(system, message):
    with pytest.raises(ValueError, match=message):
        RolloutSystemConfig(**system)


@pytest.mark.ray
def test_deterministic_async_on_ray_repeats_its_metrics(tmp_path, ray_cluster):
    """The same with the engines in processes of their own, generating beside the actor's."""
    for name in ("first", "second"):
        config = tiny(tmp_path / name, num_steps=3, mode="async", max_staleness=2, deterministic=True)
        config.trainer = dataclasses.replace(config.trainer, backend="ray", num_nodes=1)
        run_pipeline(RolloutRLVRPipeline, config)
    first, second = run_metrics(str(tmp_path / "first")), run_metrics(str(tmp_path / "second"))
    assert first == second and [first[step]["rollout/staleness/max"] for step in (1, 2, 3)] == [0, 1, 2]


def test_a_deterministic_run_refuses_over_sampling():
    with pytest.raises(ValueError, match="deterministic: over-sampling and a dynamic filter keep the groups that"):
        RolloutSystemConfig(mode="async", deterministic=True, over_sampling_factor=2.0)


def test_a_sync_run_resumes_exactly(tmp_path):
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path / "whole"))
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path / "split", num_steps=2))
    config = tiny(tmp_path / "split")
    config.trainer.resume = "latest"
    run_pipeline(RolloutRLVRPipeline, config)
    whole, split = steps(tmp_path / "whole"), steps(tmp_path / "split")
    for step in (3, 4):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert split[step][key] == whole[step][key], (step, key)


def test_saved_rollouts_replay_to_the_same_training_metrics(tmp_path):
    template = str(tmp_path / "rollouts" / "{rollout_id}.jsonl")
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path / "original", save_rollouts=template))
    assert sorted(os.listdir(tmp_path / "rollouts")) == [f"{i}.jsonl" for i in (1, 2, 3, 4)]
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path / "replay", load_rollouts=template))
    original, replay = steps(tmp_path / "original"), steps(tmp_path / "replay")
    for step in (1, 2, 3, 4):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
            assert replay[step][key] == original[step][key], (step, key)


def test_rollout_only_generates_and_saves_without_training(tmp_path):
    template = str(tmp_path / "rollouts" / "{rollout_id}.jsonl")
    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path / "run", num_steps=2, rollout_only=True, save_rollouts=template))
    by_step = steps(tmp_path / "run")
    assert all(not any(key.startswith("actor/") for key in record) for record in by_step.values())
    assert sorted(os.listdir(tmp_path / "rollouts")) == ["1.jsonl", "2.jsonl"]


def test_the_sft_rollout_function_trains_sft(tmp_path):
    config = tiny(tmp_path, num_steps=8, engines=1, rollout_function="baton.rollout.functions:sft_rollout")
    config.loss = "sft"
    config.trainer.num_prompts_per_step = 16
    config.actor.strategy.optimizer.lr = 3e-3
    run_pipeline(RolloutRLVRPipeline, config)
    losses = [steps(tmp_path)[s]["actor/loss"] for s in range(1, 9)]
    assert losses[-1] < 0.8 * losses[0]


CALLS: list[tuple[str, int]] = []


def recording_rollout(args, rollout_id, data_source, evaluation=False):
    CALLS.append(("rollout", rollout_id))
    return generate_rollout(args, rollout_id, data_source, evaluation)


async def tagging_generate(args, sample, params):
    sample = await generate_sample(args, sample, params)
    sample.metadata["tagged"] = True
    CALLS.append(("generate", sample.group_index))
    return sample


def odd_groups_dropped(args, group):
    return group[0].group_index % 2 == 0, "odd"


def test_custom_rollout_generate_and_filter_functions_by_import_path(tmp_path):
    CALLS.clear()
    config = tiny(tmp_path, num_steps=2, rollout_function=f"{THIS}:recording_rollout",
                  generate_function=f"{THIS}:tagging_generate", dynamic_filter=f"{THIS}:odd_groups_dropped",
                  over_sampling_factor=2.0, save_rollouts=str(tmp_path / "r{rollout_id}.jsonl"))
    run_pipeline(RolloutRLVRPipeline, config)
    assert [c for c in CALLS if c[0] == "rollout"] == [("rollout", 1), ("rollout", 2)]
    assert any(c[0] == "generate" for c in CALLS)
    by_step = steps(tmp_path)
    for step in (1, 2):
        assert by_step[step]["rollout/num_groups"] == 4  # exactly the groups the step needs
        assert by_step[step]["rollout/num_dropped/odd"] >= 1
        saved = [json.loads(line) for line in open(tmp_path / f"r{step}.jsonl")]
        assert len(saved) == 8 and all(s["group_index"] % 2 == 0 and s["metadata"]["tagged"] for s in saved)


RELEASE = threading.Event()  # set at the end of the test: a reward that sleeps never outlives it


def slow_for_odd_groups(args, sample):
    if sample.group_index % 2 and args.sampling_params.temperature > 0:  # training's groups; validation is greedy
        RELEASE.wait(timeout=600)
    return 1.0 if sample.response.strip() == sample.label else float(sample.sample_index)  # rewards differ


def test_an_abort_does_not_wait_on_a_slow_reward(tmp_path):
    RELEASE.clear()
    config = tiny(tmp_path, num_steps=1, reward_function=f"{THIS}:slow_for_odd_groups", over_sampling_factor=2.0,
                  abort_timeout_s=0.5)
    config.trainer.val_before_train = False
    done = threading.Event()

    def run():
        try:
            run_pipeline(RolloutRLVRPipeline, config)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        # 4 of the 8 groups started reward at once; the other 4 sleep until RELEASE: the step takes the 4 and the
        # abort gives up on the sleeping ones after abort_timeout_s.
        assert done.wait(timeout=120), "the step waited on the slow rewards"
    finally:
        RELEASE.set()
        thread.join(timeout=60)
    record = steps(tmp_path)[1]
    assert record["rollout/num_groups"] == 4 and record["rollout/num_aborted_groups"] == 4


@pytest.mark.ray
def test_colocated_engines_on_ray_live_in_the_actors_processes(tmp_path, ray_cluster):
    """colocate_actor_rollout: one engine in each actor rank's process (two here), each a router engine of its own;
    an `fsdp2` actor's shards and an `hf` engine share no tensors, so each sync copies the gathered weights."""
    import ray

    config = tiny(tmp_path, num_steps=2, engines=None)
    config.colocate_actor_rollout = True
    config.actor = RoleConfig(strategy=StrategyConfig(name="fsdp2", model="tiny-qwen2"), world_size=2)
    config.trainer = dataclasses.replace(config.trainer, backend="ray", num_nodes=1)
    pipeline = RolloutRLVRPipeline(config)
    try:
        hosts = pipeline.clusters["actor"]._group.hosts
        assert pipeline.clusters["rollout"]._group is pipeline.clusters["actor"]._group  # one process per rank
        assert len(pipeline.pool.engines) == 2 and len({ray.get(h.pid.remote()) for h in hosts}) == 2
        pipeline.run()
    finally:
        pipeline.shutdown()
    by_step = steps(tmp_path)
    assert sorted(by_step) == [1, 2]
    assert by_step[2]["router/engine_0/served"] > 0 and by_step[2]["router/engine_1/served"] > 0


@pytest.mark.parametrize("system, message", [
    (dict(mode="async"), "the engines generate with the actor's own tensors, .*use mode: sync"),
    (dict(mode="one_step_off"), "cannot generate while it trains"),
    (dict(load_rollouts="runs/x/{rollout_id}.jsonl"), "trains on saved rollouts without engines"),
])
def test_colocation_refuses_what_it_cannot_do_before_anything_starts(tmp_path, system, message):
    config = tiny(tmp_path, engines=None, **system)
    config.colocate_actor_rollout = True
    with pytest.raises(ConfigError, match=message):
        config.check()


def test_a_partial_sample_resumes_over_two_weight_versions(tmp_path):
    config = tiny(tmp_path, num_steps=1, engines=1, partial_rollout=True, mask_stale_partial_tokens=True)
    pipeline = RolloutRLVRPipeline(config)
    try:
        producer = pipeline.producer
        [group] = producer.data_source.get_samples(1)
        ctx = producer.context()
        long = SamplingParams(temperature=1.0, max_new_tokens=12, n=1, stop_token_ids=())
        first = ctx.run(generate_sample(ctx, group[0], SamplingParams(temperature=1.0, max_new_tokens=5, n=1,
                                                                      stop_token_ids=())))
        first.status = Status.ABORTED  # as an abort after 5 tokens leaves it
        assert first.weight_versions == [0] * 5
        pipeline.publisher.publish(pipeline.actor, version=1)
        sample = ctx.run(generate_sample(ctx, first, long))
        assert sample.status == Status.TRUNCATED and sample.response_length == 12
        assert sample.weight_versions == [0] * 5 + [1] * 7  # the prefix keeps its version
        assert sample.loss_mask == [0] * 5 + [1] * 7  # the older policy's tokens are masked out of the loss
        assert sample.metadata["num_resumes"] == 1
        sample.reward = 1.0
        data = samples_to_data([sample], pipeline.tokenizer.pad_token_id, 1.0)
        assert data.batch["response_mask"][0].tolist() == [0] * 5 + [1] * 7
        assert data.batch["attention_mask"][0, -12:].tolist() == [1] * 12
    finally:
        pipeline.shutdown()


def test_a_mismatched_loss_mask_names_the_sample():
    sample = Sample(group_index=3, sample_index=1, prompt="1+1=", prompt_ids=[1, 2], response_ids=[5, 6],
                    loss_mask=[1], rollout_log_probs=[0.0, 0.0], weight_versions=[0, 0], status=Status.COMPLETED,
                    reward=1.0)
    with pytest.raises(ValueError, match="group 3 sample 1: loss_mask has 1 entries but the response has 2"):
        samples_to_data([sample], 0, 1.0)


def prompt_length(response, ground_truth, prompt, **fields):
    return float(len(prompt))


def test_each_eval_set_gets_its_own_metrics(tmp_path):
    files = {"short": ["1+1=", "2+2="], "long": ["11+11=", "12+12=", "13+13="]}
    paths = {}
    for name, prompts in files.items():
        paths[name] = str(tmp_path / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            for prompt in prompts:
                f.write(json.dumps({"prompt": prompt, "answer": "0"}) + "\n")
    config = tiny(tmp_path / "run", num_steps=2)
    config.eval_files, config.reward_fn = paths, f"{THIS}:prompt_length"
    run_pipeline(RolloutRLVRPipeline, config)
    record = steps(tmp_path / "run")[2]
    assert record["eval/short/reward/mean"] == 4.0 and record["eval/long/reward/mean"] == 6.0
    for name in files:
        for key in ("accuracy", "truncated_ratio", "response_length/mean"):
            assert f"eval/{name}/{key}" in record
    assert "val/accuracy" in record


def test_engines_sharing_the_actors_device_sleep_while_it_trains(tmp_path, capfd):
    config = tiny(tmp_path, num_steps=2, engines=1)  # engine 0 and the actor both on device 0
    config.trainer.offload_idle_roles = True
    run_pipeline(RolloutRLVRPipeline, config)
    by_step = steps(tmp_path)
    assert all("timing_s/offload" in by_step[s] and "timing_s/reload" in by_step[s] for s in (1, 2))
    assert capfd.readouterr().err.count("offload/onload hold their steps but free no memory") == 1  # said once


async def never_returns(args, sample, params):
    await asyncio.sleep(3600)


def test_a_rollout_that_gets_no_samples_stops_with_the_silent_stage(tmp_path):
    from baton.rollout.functions import RolloutStalledError

    config = tiny(tmp_path, num_steps=1, engines=1, generate_function=f"{THIS}:never_returns", watchdog_s=0.5)
    config.trainer.val_before_train = False
    with pytest.raises(RolloutStalledError, match=r"rollout 1: no group finished within 0.5 s .*watchdog_s.*engine 0"):
        run_pipeline(RolloutRLVRPipeline, config)


async def rollout_that_never_returns(args, rollout_id, data_source, evaluation=False):
    await asyncio.sleep(3600)


def test_a_custom_rollout_function_that_never_returns_is_bounded(tmp_path):
    from baton.rollout.functions import RolloutStalledError

    config = tiny(tmp_path, num_steps=1, engines=1, rollout_function=f"{THIS}:rollout_that_never_returns",
                  rollout_timeout_s=0.5)
    config.trainer.val_before_train = False
    with pytest.raises(RolloutStalledError, match=r"rollout 1 did not finish within 0.5 s .*rollout_timeout_s.*"
                                                  r"no engine request in flight"):
        run_pipeline(RolloutRLVRPipeline, config)


def only_group_zero(args, group):
    return group[0].group_index == 0, "not_zero"


def test_a_filter_that_drops_nearly_everything_stops_at_the_started_groups_limit(tmp_path):
    config = tiny(tmp_path, num_steps=1, engines=1, dynamic_filter=f"{THIS}:only_group_zero",
                  max_groups_started_factor=2.0)
    config.trainer.val_before_train = False
    run_pipeline(RolloutRLVRPipeline, config)
    record = steps(tmp_path)[1]
    assert record["rollout/num_groups_started"] == 8  # 2 × the 4 groups the step needs, no more
    assert record["rollout/num_groups"] == 1 and record["rollout/num_dropped/not_zero"] == 7


def test_the_weight_sync_probe_checks_the_first_and_every_nth_sync(tmp_path):
    pipeline = RolloutRLVRPipeline(tiny(tmp_path, num_steps=1, engines=1, probe_every_syncs=2))
    try:  # the sync at start-up was the first (probed); then 1, 2, 3
        probed = ["weight_sync/max_logprob_diff" in pipeline.publisher.publish(pipeline.actor, version=v)
                  for v in (1, 2, 3)]
        assert probed == [False, True, False]
    finally:
        pipeline.shutdown()
    with pytest.raises(ValueError, match="probe_every_syncs must be >= 1"):
        RolloutSystemConfig(probe_every_syncs=0)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_failed_probe_stops_the_sync_or_the_next_one_in_overlapped_modes(tmp_path, mode):
    """Sync mode scores the probe before the sync returns; the overlapped modes score it while the next step trains,
    and the next sync (or `settle`) reports its diff or raises its error, before newer weights go in."""
    pipeline = RolloutRLVRPipeline(tiny(tmp_path, num_steps=1, engines=1, mode=mode))
    try:
        publisher = pipeline.publisher
        first = publisher.publish(pipeline.actor, version=1)  # reports the start-up sync's probe, if pending
        second = publisher.publish(pipeline.actor, version=2)
        assert second["weight_sync/max_logprob_diff"] <= publisher.probe_atol
        if mode == "sync":
            assert "weight_sync/max_logprob_diff" in first and publisher.settle() == {}
        else:
            assert "weight_sync/max_logprob_diff" in publisher.settle()  # version 2's, scored meanwhile
        publisher.probe_atol = -1.0  # no difference passes: every probe fails
        if mode == "sync":
            with pytest.raises(WeightSyncError, match="differ by up to"):
                publisher.publish(pipeline.actor, version=3)
        else:
            publisher.publish(pipeline.actor, version=3)  # returns; its probe fails meanwhile
            with pytest.raises(WeightSyncError, match="differ by up to"):
                publisher.publish(pipeline.actor, version=4)
            assert pipeline.pool.version == 3  # version 4's weights did not go in
    finally:
        pipeline.shutdown()


def test_a_long_lived_context_forgets_the_requests_that_finished(tmp_path):
    """The async producer's context lives for the whole run: a finished request's id is not kept (nor aborted)."""
    pipeline = RolloutRLVRPipeline(tiny(tmp_path, num_steps=1, engines=1))
    try:
        ctx = pipeline.producer.context()
        for group in pipeline.producer.data_source.get_samples(2):
            for sample in group:
                ctx.run(generate_sample(ctx, sample, SamplingParams(temperature=1.0, max_new_tokens=3, n=1)))
                assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
        assert ctx._request_ids == {} and ctx._request_keys == {}
    finally:
        pipeline.shutdown()


def test_the_wait_for_the_next_steps_batch_is_bounded(tmp_path):
    import concurrent.futures

    from baton.rollout.functions import RolloutStalledError

    pipeline = RolloutRLVRPipeline(tiny(tmp_path, num_steps=1, engines=1, mode="one_step_off",
                                        rollout_timeout_s=0.2, watchdog_s=0.2))
    try:
        with pytest.raises(RolloutStalledError, match="the next step's batch was not ready within 0.4 s"):
            pipeline.wait_rollout(concurrent.futures.Future())  # a preparation that never finishes
    finally:
        pipeline.shutdown()


HELD = threading.Event()  # set: the groups after the first step's are held before they generate
GROUPS_STARTED: list[int] = []  # group indices, in the order their first sample started


async def held_after_the_first_step(args, sample, params):
    if sample.group_index not in GROUPS_STARTED:
        GROUPS_STARTED.append(sample.group_index)
    if GROUPS_STARTED.index(sample.group_index) >= args.num_groups_per_step:
        for _ in range(6000):  # at most 60 s
            if not HELD.is_set():
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"group {sample.group_index} was held for 60 s")
    return await generate_sample(args, sample, params)


def test_an_async_step_waiting_on_its_started_groups_gets_the_engines_first(tmp_path, monkeypatch):
    """Once the trainer has synced and waits for its step's groups, all started, the producer starts no more
    until the step has them (they would only slow that step's); then it goes on."""
    GROUPS_STARTED.clear()
    HELD.set()
    pipeline = RolloutRLVRPipeline(tiny(tmp_path, num_steps=3, engines=1, mode="async", max_staleness=1,
                                        generate_function=f"{THIS}:held_after_the_first_step"))
    manager = pipeline.producer
    taken: list = []  # the groups the producer took from the data source to start them
    get_samples = manager.data_source.get_samples

    def counted_get_samples(num_groups):
        groups = get_samples(num_groups)
        taken.extend(groups)
        return groups

    monkeypatch.setattr(manager.data_source, "get_samples", counted_get_samples)
    try:
        manager.start_continuous()
        first, _ = manager.take()
        assert len(first) == 4
        second: list = []
        waiting = threading.Thread(target=lambda: second.append(manager.take()))
        waiting.start()
        wait_until(lambda: manager._taking and len(GROUPS_STARTED) == 8, "step 2's groups started and held, and its "
                   "take waiting", timeout_s=30)
        num_taken = len(taken)
        pipeline.publisher.publish(pipeline.actor, version=1)  # step 1 synced: step 3's groups are admissible now
        # The publish woke the producer (a call on its loop, run before this no-op); once it cleared the wake-up,
        # it has decided what to start under the new version.
        manager.pool.loop.run(asyncio.sleep(0))
        wait_until(lambda: not manager._wake.is_set(), "the producer to look at the new version")
        num_taken_after = len(taken)
        assert num_taken_after == num_taken, "groups started while the trainer waited on the ones it needs"
        assert len(GROUPS_STARTED) == 8
        HELD.clear()
        waiting.join(timeout=60)
        assert not waiting.is_alive() and len(second[0][0]) == 4
        wait_until(lambda: len(GROUPS_STARTED) == 12, "step 3's groups started once step 2 had its own", timeout_s=30)
    finally:
        HELD.clear()
        manager.stop_continuous()
        pipeline.shutdown()
