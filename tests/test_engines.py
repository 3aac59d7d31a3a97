"""The engine protocol's records and the `hf` engine: continuous batching against the batch path, abort and
resume, weights in place, pause, sleep and health, on tiny-qwen2."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from baton.data import DataProto
from baton.engines import Engine, GenerationRequest, GenerationResult, HFEngine
from baton.engines.batch import generate_batch
from baton.engines.loop import LoopThread
from baton.models import build_model
from baton.models.tokenizer import CHAR_VOCAB_SIZE
from baton.strategy import SamplingParams, StrategyConfig
from baton.strategy.hf import HFStrategy
from baton.strategy.sampling import row_seeds

NEVER = CHAR_VOCAB_SIZE  # a stop id outside the vocabulary: rows run to max_new_tokens
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(NEVER,))
PROMPTS = ["1+2=", "hello there", "abc", "3*4*5=", "the quick brown fox", "1+2="]


@pytest.fixture(scope="module")
def strategy() -> HFStrategy:
    return HFStrategy(StrategyConfig(model="tiny-qwen2", seed=0))


@pytest.fixture(scope="module")
def other_strategy() -> HFStrategy:
    return HFStrategy(StrategyConfig(model="tiny-qwen2", seed=1))


@pytest.fixture(scope="module")
def prompt_ids(strategy) -> list[list[int]]:
    return [strategy.tokenizer(p)["input_ids"] for p in PROMPTS]


def make_engine(strategy: HFStrategy, seed: int = 0, **kwargs) -> HFEngine:
    """An engine on its own copy of tiny-qwen2 with `seed`'s weights (the same as a strategy built with that seed)."""
    return HFEngine(build_model("tiny-qwen2", seed=seed), strategy.tokenizer, **kwargs)


def batch_generate(strategy: HFStrategy, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """One `HFStrategy.generate` call over left-padded prompts: (tokens, log_probs, finish_reason) per row."""
    pad = strategy.tokenizer.pad_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = strategy.generate(DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask}), params)
    rows = []
    for tokens, log_probs, row_mask, reason in zip(out.batch["responses"], out.batch["rollout_log_probs"],
                                                   out.batch["response_mask"], out.non_tensor_batch["finish_reason"]):
        keep = row_mask.bool()
        rows.append((tokens[keep].tolist(), log_probs[keep].tolist(), reason))
    return rows


def assert_same(result: GenerationResult, expected: tuple, atol: float = 1e-5) -> None:
    tokens, log_probs, reason = expected
    assert list(result.response_ids) == tokens
    assert result.finish_reason == reason
    torch.testing.assert_close(torch.tensor(result.log_probs), torch.tensor(log_probs), atol=atol, rtol=0)


async def staggered(engine: Engine, requests: list[GenerationRequest], gap_s: float = 0.002
                    ) -> list[GenerationResult]:
    """Submit the requests one by one, `gap_s` (a decode step or more) apart, so that most join a running batch."""
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(engine.generate(request)))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


async def after_tokens(engine: HFEngine, num_tokens: int, request_id: str = "clock") -> None:
    """Return once the engine has run `num_tokens` sampling steps of a request started now (its finish)."""
    await engine.generate(GenerationRequest(request_id, [5, 6, 7], SamplingParams(
        temperature=0, max_new_tokens=num_tokens, stop_token_ids=(NEVER,))))


async def until_running(engine: HFEngine):
    """The engine's health once a step has admitted requests (polled every event-loop turn, so right after that step)."""
    while not (health := await engine.health()).num_running:
        await asyncio.sleep(0)
    return health


# --- the records -----------------------------------------------------------------------------------


def test_requests_are_one_sample_and_consistent():
    with pytest.raises(ValueError, match="send 4 requests"):
        GenerationRequest("a", [1, 2], SamplingParams(n=4))
    with pytest.raises(ValueError, match="one entry per token"):
        GenerationRequest("a", [1, 2], prefix_response_ids=[3, 4], prefix_log_probs=[-0.5], prefix_weight_versions=[0])
    with pytest.raises(ValueError, match="it is finished"):
        GenerationRequest("a", [1], SamplingParams(max_new_tokens=2), [3, 4], [-0.1, -0.2], [0, 0])
    with pytest.raises(ValueError, match="empty prompt"):
        GenerationRequest("a", [])
    request = GenerationRequest("a", [1, 2], SamplingParams(max_new_tokens=8))
    partial = GenerationResult("a", (7, 8), (-0.5, -1.5), (3, 4), 4, "abort")
    resumed = request.resumed(partial)
    assert (resumed.prompt_ids, resumed.prefix_response_ids, resumed.prefix_log_probs,
            resumed.prefix_weight_versions) == ((1, 2), (7, 8), (-0.5, -1.5), (3, 4))
    with pytest.raises(ValueError, match="only an aborted"):
        request.resumed(GenerationResult("a", (7,), (-0.5,), (0,), 0, "stop"))


def test_hf_engine_is_an_engine(strategy):
    assert isinstance(make_engine(strategy), Engine)


# --- numerics against the batch path --------------------------------------------------------------------


def test_concurrent_greedy_requests_equal_one_batch_call(strategy, prompt_ids):
    expected = batch_generate(strategy, prompt_ids, GREEDY)
    assert len({tuple(tokens) for tokens, _, _ in expected}) > 1  # the prompts do lead to different responses
    engine = make_engine(strategy)
    requests = [GenerationRequest(f"r{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids)]
    results = asyncio.run(staggered(engine, requests))
    for request, result, row in zip(requests, results, expected):
        assert result.request_id == request.request_id
        assert_same(result, row)
        assert result.weight_versions == (0,) * GREEDY.max_new_tokens and result.weight_version == 0


def test_a_running_batch_admits_new_requests_between_steps(strategy, prompt_ids):
    """At most two rows run at once: the rest wait and join as rows finish, still with the batch path's tokens."""
    params = [dataclasses.replace(GREEDY, max_new_tokens=n) for n in (3, 20, 7, 12, 5, 9)]
    expected = [batch_generate(strategy, [ids], p)[0] for ids, p in zip(prompt_ids, params)]
    engine = make_engine(strategy, max_num_seqs=2)

    async def run():
        tasks = [asyncio.create_task(engine.generate(GenerationRequest(f"r{i}", ids, p)))
                 for i, (ids, p) in enumerate(zip(prompt_ids, params))]
        health = await until_running(engine)
        return await asyncio.gather(*tasks), health

    results, health = asyncio.run(run())
    assert health.num_running == 2 and health.num_waiting == 4
    for result, row in zip(results, expected):
        assert_same(result, row)


def test_sampled_requests_with_the_batch_path_row_seeds_equal_one_batch_call(strategy, prompt_ids):
    """The batch path seeds row k with `row_seeds(generator, rows)[k]`: requests with those seeds, submitted one by
    one into a running batch, give its tokens (a prompt's 3 samples share the prompt, not the seed)."""
    params = SamplingParams(temperature=1.0, n=3, max_new_tokens=16, stop_token_ids=(NEVER,), seed=123)
    expected = batch_generate(strategy, prompt_ids, params)
    seeds = row_seeds(torch.Generator().manual_seed(123), len(expected))
    one = [dataclasses.replace(params, n=1, seed=seed) for seed in seeds]
    requests = [GenerationRequest(f"r{k}", prompt_ids[k // 3], one[k]) for k in range(len(expected))]
    results = asyncio.run(staggered(make_engine(strategy), requests))
    for result, row in zip(results, expected):
        assert_same(result, row)
    assert len({r.response_ids for r in results[:3]}) > 1  # a prompt's samples differ


def test_a_request_samples_the_same_alone_or_beside_others(strategy, prompt_ids):
    """Each request samples with its own seeded generator: run concurrently with other sampling settings beside it,
    each gives what it gives alone in an engine."""
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.2, top_p=0.8),
                dict(temperature=1.0), dict(temperature=0.0), dict(temperature=1.0)]
    requests = [GenerationRequest(f"r{i}", ids, SamplingParams(max_new_tokens=16, stop_token_ids=(NEVER,),
                                                               seed=100 + i, **s))
                for i, (ids, s) in enumerate(zip(prompt_ids, settings))]
    engine = make_engine(strategy)

    async def alone():
        return [await engine.generate(request) for request in requests]

    expected = asyncio.run(alone())
    results = asyncio.run(staggered(engine, [dataclasses.replace(r, request_id=f"again-{r.request_id}")
                                             for r in requests]))
    for result, row in zip(results, expected):
        assert_same(result, (list(row.response_ids), list(row.log_probs), row.finish_reason))
    # The first and last requests share a prompt (and their prefill) but not a seed: different samples.
    assert results[0].response_ids != results[5].response_ids


def test_the_batch_generate_over_the_hf_engine_is_the_hf_strategys_generate(strategy, prompt_ids):
    """`generate_batch` (the batch rollout over any engine) on the hf engine: the hf strategy's output, greedy and
    sampled, column for column; an unseeded call draws its row seeds from the generator it is given."""
    pad = strategy.tokenizer.pad_token_id
    width = max(map(len, prompt_ids))
    prompts = DataProto.from_dict(
        {"input_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids]),
         "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])},
        {"uid": np.array([f"p{i}" for i in range(len(prompt_ids))], dtype=object)})
    sampled = SamplingParams(temperature=1.0, n=3, max_new_tokens=16, stop_token_ids=(NEVER, 6), seed=123)
    engine, runner = make_engine(strategy), LoopThread("test-batch")

    def generate(params: SamplingParams, generator: torch.Generator | None = None) -> DataProto:
        return generate_batch(engine, runner, prompts, params, generator=generator or torch.Generator(),
                              pad_token_id=pad, call_id="call")

    try:
        for params in (dataclasses.replace(GREEDY, n=2), sampled):
            ours, theirs = generate(params), strategy.generate(prompts, params)
            for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
                assert torch.equal(ours.batch[key], theirs.batch[key]), key
            torch.testing.assert_close(ours.batch["rollout_log_probs"], theirs.batch["rollout_log_probs"], atol=1e-5,
                                       rtol=0)
            for key in ("uid", "finish_reason"):
                assert list(ours.non_tensor_batch[key]) == list(theirs.non_tensor_batch[key])
            assert ours.meta_info["temperature"] == params.temperature
        assert set(ours.non_tensor_batch["finish_reason"]) == {"stop", "length"}
        generator = torch.Generator().manual_seed(123)
        unseeded = dataclasses.replace(sampled, seed=None)
        assert torch.equal(generate(unseeded, generator).batch["responses"], ours.batch["responses"])
        assert not torch.equal(generate(unseeded, generator).batch["responses"], ours.batch["responses"])  # advanced
        right_padded = DataProto.from_dict({"input_ids": torch.tensor([[5, 6, pad]]),
                                            "attention_mask": torch.tensor([[1, 1, 0]])})
        with pytest.raises(ValueError, match="LEFT-padded"):
            generate_batch(engine, runner, right_padded, GREEDY, generator=torch.Generator(), pad_token_id=pad,
                           call_id="bad")
    finally:
        runner.run(engine.close())
        runner.close()


def test_a_stop_token_ends_the_request(strategy, prompt_ids):
    tokens, _, _ = batch_generate(strategy, [prompt_ids[1]], GREEDY)[0]
    stop = tokens[5]
    first = tokens.index(stop)
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    [result] = asyncio.run(staggered(make_engine(strategy), [GenerationRequest("a", prompt_ids[1], params)]))
    assert result.finish_reason == "stop" and list(result.response_ids) == tokens[: first + 1]
    assert result.response_ids[-1] == stop


# --- abort and resume -------------------------------------------------------------------------------------


def test_abort_returns_the_partial_response_and_a_resumed_request_completes_it(strategy, prompt_ids):
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    expected = batch_generate(strategy, [prompt_ids[4]], params)[0]
    engine = make_engine(strategy)
    request = GenerationRequest("long", prompt_ids[4], params)

    async def run():
        task = asyncio.create_task(engine.generate(request))
        await after_tokens(engine, 4)
        [partial] = await engine.abort(["long", "unknown"])
        returned = await task
        assert (await engine.health()).num_running == 0
        resumed = await engine.generate(request.resumed(partial))
        return partial, returned, resumed

    partial, returned, resumed = asyncio.run(run())
    assert partial == returned and partial.finish_reason == "abort"
    num_partial = len(partial.response_ids)
    assert 4 <= num_partial < 40
    assert_same(partial, (expected[0][:num_partial], expected[1][:num_partial], "abort"))
    assert_same(resumed, expected)  # greedy: the resumed request ends where the uninterrupted one does
    assert resumed.log_probs[:num_partial] == partial.log_probs  # carried, not recomputed


def test_abort_while_paused_and_of_waiting_requests(strategy, prompt_ids):
    engine = make_engine(strategy, max_num_seqs=1)

    async def paused_abort():
        running = asyncio.create_task(engine.generate(GenerationRequest("a", prompt_ids[2], GREEDY)))
        waiting = asyncio.create_task(engine.generate(GenerationRequest("b", prompt_ids[3], GREEDY)))
        await until_running(engine)
        await engine.pause()
        results = await engine.abort(["b", "a"])
        assert await running == results[1] and await waiting == results[0]
        health = await engine.health()
        await engine.resume()
        return results, health

    results, health = asyncio.run(paused_abort())
    assert [r.request_id for r in results] == ["b", "a"] and all(r.finish_reason == "abort" for r in results)
    assert results[0].response_ids == ()  # never admitted
    assert results[0].weight_version == 0
    assert 1 <= len(results[1].response_ids) < GREEDY.max_new_tokens
    assert (health.num_running, health.num_waiting) == (0, 0)


def test_a_cancelled_generate_call_leaves_the_engine(strategy, prompt_ids):
    engine = make_engine(strategy)
    long = dataclasses.replace(GREEDY, max_new_tokens=200)

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("a", prompt_ids[0], long)))
        await until_running(engine)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await after_tokens(engine, 2)  # a step that drops the cancelled row
        return await engine.health(), await engine.generate(GenerationRequest("a", prompt_ids[0], GREEDY))

    health, again = asyncio.run(run())
    assert (health.num_running, health.num_waiting) == (0, 0)
    assert_same(again, batch_generate(strategy, [prompt_ids[0]], GREEDY)[0])  # the id is free again


# --- weights -------------------------------------------------------------------------------------------


def test_update_weights_switches_outputs_to_the_new_weights(strategy, other_strategy, prompt_ids):
    before = batch_generate(strategy, prompt_ids[:3], GREEDY)
    after = batch_generate(other_strategy, prompt_ids[:3], GREEDY)
    assert [row[0] for row in before] != [row[0] for row in after]
    engine = make_engine(strategy)

    async def run():
        old = await staggered(engine, [GenerationRequest(f"old{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids[:3])])
        await engine.update_weights(other_strategy.export_weights(bucket_bytes=1 << 16), version=3)
        new = await staggered(engine, [GenerationRequest(f"new{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids[:3])])
        with pytest.raises(ValueError, match="older"):
            await engine.update_weights([], version=2)
        with pytest.raises(ValueError, match="do not exist"):
            await engine.update_weights([{"no.such.weight": torch.zeros(1)}], version=4)
        return old, new

    old, new = asyncio.run(run())
    assert engine.weight_version == 3
    for result, row in zip(old, before):
        assert_same(result, row)
        assert result.weight_version == 0
    for result, row in zip(new, after):
        assert_same(result, row)
        assert result.weight_versions == (3,) * GREEDY.max_new_tokens and result.weight_version == 3


def test_weights_updated_mid_request_are_recorded_per_token(strategy, other_strategy, prompt_ids):
    params = dataclasses.replace(GREEDY, max_new_tokens=30)
    engine = make_engine(strategy)

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("long", prompt_ids[4], params)))
        await after_tokens(engine, 3)
        await engine.update_weights(other_strategy.export_weights(), version=1)
        return await task

    result = asyncio.run(run())
    versions = list(result.weight_versions)
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1 == result.weight_version
    num_old = versions.count(0)
    assert 3 <= num_old < 30
    old_only = batch_generate(strategy, [prompt_ids[4]], params)[0]
    assert list(result.response_ids[:num_old]) == old_only[0][:num_old]  # before the update: the old weights' tokens
    assert list(result.response_ids) != old_only[0]
    # A token's version is that of the forward pass behind its distribution: the version-0 tokens' log-probs are
    # the old weights' (recomputed), the first version-1 token's are not.
    old_log_probs = recomputed_log_probs(strategy, prompt_ids[4], list(result.response_ids))
    torch.testing.assert_close(torch.tensor(result.log_probs[:num_old]), old_log_probs[:num_old], atol=1e-4, rtol=0)
    assert abs(result.log_probs[num_old] - float(old_log_probs[num_old])) > 1e-2


def recomputed_log_probs(strategy: HFStrategy, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The strategy's forward log-probs of `response` after `prompt` at temperature 1: [len(response)]."""
    out = strategy.forward(DataProto.from_dict({"input_ids": torch.tensor([prompt + response]),
                                                "attention_mask": torch.ones(1, len(prompt) + len(response), dtype=torch.long),
                                                "responses": torch.tensor([response])}))
    return out.batch["log_probs"][0]


# --- pause, sleep, health --------------------------------------------------------------------------------


def test_pause_holds_decode_steps_until_resume(strategy, prompt_ids):
    params = dataclasses.replace(GREEDY, max_new_tokens=30)
    expected = batch_generate(strategy, [prompt_ids[4], prompt_ids[0]], params)
    engine = make_engine(strategy)

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("long", prompt_ids[4], params)))
        await after_tokens(engine, 2)
        await engine.pause()
        late = asyncio.create_task(engine.generate(GenerationRequest("late", prompt_ids[0], params)))
        await asyncio.sleep(0.3)  # ample time for the remaining steps, were they to run
        held = (task.done(), late.done(), await engine.health())
        await engine.resume()
        return held, await task, await late

    (long_done, late_done, health), long_result, late_result = asyncio.run(run())
    assert not long_done and not late_done
    assert (health.paused, health.num_running, health.num_waiting) == (True, 1, 1)
    assert_same(long_result, expected[0])
    assert_same(late_result, expected[1])


def test_sleep_needs_an_idle_engine_and_wake_up_serves_again(strategy, prompt_ids):
    engine = make_engine(strategy)

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("a", prompt_ids[0], GREEDY)))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.sleep()
        await task
        await engine.sleep()
        asleep = await engine.health()
        waiting = asyncio.create_task(engine.generate(GenerationRequest("b", prompt_ids[0], GREEDY)))
        await asyncio.sleep(0.1)
        held = waiting.done()
        await engine.wake_up()
        return asleep, held, await waiting

    asleep, held, result = asyncio.run(run())
    assert asleep.sleeping and asleep.healthy and not held
    assert_same(result, batch_generate(strategy, [prompt_ids[0]], GREEDY)[0])


def test_bad_requests_fail_alone(strategy, prompt_ids):
    engine = make_engine(strategy)

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("a", prompt_ids[0], GREEDY)))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(GenerationRequest("a", prompt_ids[1], GREEDY))
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            await engine.generate(GenerationRequest("b", [1, CHAR_VOCAB_SIZE], GREEDY))
        with pytest.raises(ValueError, match="ends with a stop token"):
            stop_at_5 = dataclasses.replace(GREEDY, stop_token_ids=(5,))
            await engine.generate(GenerationRequest("c", [1, 2], stop_at_5, [4, 5], [-1.0, -1.0], [0, 0]))
        return await task, await engine.health()

    result, health = asyncio.run(run())
    assert_same(result, batch_generate(strategy, [prompt_ids[0]], GREEDY)[0])
    assert health.healthy and health.error is None


def test_close_aborts_what_is_in_flight_and_serves_nothing_after(strategy, prompt_ids):
    engine = make_engine(strategy)
    long = dataclasses.replace(GREEDY, max_new_tokens=200)

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("a", prompt_ids[0], long)))
        await until_running(engine)
        await engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate(GenerationRequest("b", prompt_ids[0], GREEDY))
        return await task, await engine.health()

    result, health = asyncio.run(run())
    assert result.finish_reason == "abort" and 1 <= len(result.response_ids) < 200
    assert not health.healthy and "closed" in health.error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_requests_equal_the_batch_path_and_sleep_releases_the_model(prompt_ids):
    cuda = torch.device("cuda")
    strategy = HFStrategy(StrategyConfig(model="tiny-qwen2", seed=0), device=cuda)
    params = [SamplingParams(max_new_tokens=16, stop_token_ids=(NEVER,), seed=7 + i, temperature=t)
              for i, t in enumerate([0.0, 1.0, 0.7])]
    expected = [batch_generate(strategy, [ids], p)[0] for ids, p in zip(prompt_ids, params)]
    engine = HFEngine(build_model("tiny-qwen2", seed=0).to(cuda), strategy.tokenizer)
    # The batch path's one row draws its seed from a CUDA generator seeded with params.seed.
    seeds = [row_seeds(torch.Generator(cuda).manual_seed(p.seed), 1)[0] for p in params]
    requests = [GenerationRequest(f"r{i}", ids, dataclasses.replace(p, seed=seed))
                for i, (ids, p, seed) in enumerate(zip(prompt_ids, params, seeds))]

    async def run():
        first = await staggered(engine, requests)
        await engine.sleep()
        device_asleep = next(engine.model.parameters()).device
        await engine.wake_up()
        return first, device_asleep, await staggered(engine, [GenerationRequest(f"again{i}", r.prompt_ids, r.params)
                                                              for i, r in enumerate(requests)])

    first, device_asleep, again = asyncio.run(run())
    assert device_asleep.type == "cpu"
    for results in (first, again):
        for result, row in zip(results, expected):
            assert_same(result, row, atol=1e-4)
