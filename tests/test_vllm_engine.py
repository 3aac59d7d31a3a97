"""The `vllm` engine on CPU: concurrent requests against HF's batch path, log-probs against an HF forward, weights in
place, abort and resume, pause, stop tokens and health, on tiny-qwen2 (float32).

Needs vLLM (`scripts/setup.sh --vllm`); the module skips without it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed; install it with scripts/setup.sh --vllm")

from baton.data import DataProto  # noqa: E402
from baton.engines import Engine, GenerationRequest, GenerationResult  # noqa: E402
from baton.engines.vllm import VLLMEngine  # noqa: E402
from baton.models.tokenizer import CHAR_VOCAB_SIZE  # noqa: E402
from baton.strategy import SamplingParams, StrategyConfig  # noqa: E402
from baton.strategy.hf import HFStrategy  # noqa: E402

NEVER = CHAR_VOCAB_SIZE - 1  # '~': a stop id these prompts' greedy responses never reach (checked below)
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(NEVER,))
PROMPTS = ["1+2=", "hello there", "abc", "3*4*5=", "the quick brown fox", "1+2=", "x", "reverse: hello="]
LOG_PROB_ATOL = 1e-4  # float32 vLLM against an HF forward of the same weights (measured ~1e-6)


@pytest.fixture(scope="module")
def strategy() -> HFStrategy:
    return HFStrategy(StrategyConfig(model="tiny-qwen2", seed=0))


@pytest.fixture(scope="module")
def other_strategy() -> HFStrategy:
    return HFStrategy(StrategyConfig(model="tiny-qwen2", seed=1))


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (start-up takes seconds): tiny-qwen2 with seed 0's weights, as `strategy` holds.
    A test that changes its weights puts seed 0's back before it returns."""
    engine = VLLMEngine.from_config(StrategyConfig(model="tiny-qwen2", seed=0), kv_cache_memory_bytes=64 << 20)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def prompt_ids(strategy) -> list[list[int]]:
    return [strategy.tokenizer(p)["input_ids"] for p in PROMPTS]


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


def actor_log_probs(strategy: HFStrategy, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log p(response token) as an actor recomputes them (`HFStrategy.forward` at the sampling temperature)."""
    sequence = torch.tensor([prompt + response])
    batch = DataProto.from_dict({"input_ids": sequence, "attention_mask": torch.ones_like(sequence),
                                 "responses": torch.tensor([response])})
    return strategy.forward(batch, temperature=temperature).batch["log_probs"][0]


def assert_same(result: GenerationResult, expected: tuple) -> None:
    tokens, log_probs, reason = expected
    assert list(result.response_ids) == tokens
    assert result.finish_reason == reason
    torch.testing.assert_close(torch.tensor(result.log_probs), torch.tensor(log_probs), atol=LOG_PROB_ATOL, rtol=0)


async def staggered(engine: VLLMEngine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """Submit the requests one by one, a little apart, so that most join a running batch."""
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(engine.generate(request)))
        await asyncio.sleep(0.005)
    return await asyncio.gather(*tasks)


async def after_tokens(engine: VLLMEngine, num_tokens: int, request_id: str = "clock") -> None:
    """Return once the engine has run `num_tokens` steps of a request started now (its finish)."""
    params = dataclasses.replace(GREEDY, max_new_tokens=num_tokens)
    await engine.generate(GenerationRequest(request_id, [5, 6, 7], params))


def test_vllm_engine_is_an_engine(engine):
    assert isinstance(engine, Engine)


def test_concurrent_greedy_requests_equal_one_batch_call(engine, strategy, prompt_ids):
    """Many requests in flight (each prompt four times, arriving one by one) give the tokens of one HF batch call,
    with log-probs that match its forward pass."""
    expected = batch_generate(strategy, prompt_ids, GREEDY)
    assert len({tuple(tokens) for tokens, _, _ in expected}) > 1  # the prompts do lead to different responses
    assert all(NEVER not in tokens for tokens, _, _ in expected)
    requests = [GenerationRequest(f"r{i}", prompt_ids[i % len(prompt_ids)], GREEDY) for i in range(4 * len(prompt_ids))]
    results = asyncio.run(staggered(engine, requests))
    for i, (request, result) in enumerate(zip(requests, results)):
        assert result.request_id == request.request_id
        assert_same(result, expected[i % len(prompt_ids)])
        assert result.weight_versions == (0,) * GREEDY.max_new_tokens and result.weight_version == 0


def test_sampled_log_probs_match_an_hf_forward_at_the_temperature(engine, strategy, prompt_ids):
    """Sampled tokens' log-probs are those an actor recomputes at the sampling temperature (float32: within 1e-4),
    and a seeded request gives the same sample alone as in a crowd."""
    params = [SamplingParams(temperature=t, max_new_tokens=16, stop_token_ids=(NEVER,), seed=7 + i)
              for i, t in enumerate([0.7, 1.0, 1.3, 1.0])]
    requests = [GenerationRequest(f"s{i}", prompt_ids[i], p) for i, p in enumerate(params)]
    crowd = asyncio.run(staggered(engine, requests + [GenerationRequest(f"c{i}", ids, GREEDY)
                                                      for i, ids in enumerate(prompt_ids)]))[: len(requests)]
    alone = [asyncio.run(engine.generate(r)) for r in requests[:2]]
    assert [r.response_ids for r in alone] == [r.response_ids for r in crowd[:2]]
    for request, result in zip(requests, crowd):
        expected = actor_log_probs(strategy, list(request.prompt_ids), list(result.response_ids),
                                   request.params.temperature)
        assert (torch.tensor(result.log_probs) - expected).abs().max().item() <= LOG_PROB_ATOL


def test_update_weights_changes_greedy_outputs_to_the_new_weights(engine, strategy, other_strategy, prompt_ids):
    """Buckets exported by an actor (small buckets: layers split across them) replace the weights in place; greedy
    outputs become HF's for the new weights and carry the new version. Seed 0's weights go back at the end."""
    old = batch_generate(strategy, prompt_ids, GREEDY)
    new = batch_generate(other_strategy, prompt_ids, GREEDY)
    assert [tokens for tokens, _, _ in old] != [tokens for tokens, _, _ in new]
    # Without lm_head.weight, as an actor that exports tied weights once would send them: the engine sends the
    # embedding as the LM head too (vLLM keeps its own copy; left alone, greedy outputs stay the old weights').
    buckets = [{k: v for k, v in b.items() if k != "lm_head.weight"}
               for b in other_strategy.export_weights(bucket_bytes=64 << 10)]
    assert len(buckets) > 4
    asyncio.run(engine.update_weights(buckets, version=3))
    assert engine.weight_version == 3
    results = asyncio.run(staggered(engine, [GenerationRequest(f"n{i}", ids, GREEDY)
                                             for i, ids in enumerate(prompt_ids)]))
    for result, row in zip(results, new):
        assert_same(result, row)
        assert result.weight_versions == (3,) * GREEDY.max_new_tokens and result.weight_version == 3
    with pytest.raises(ValueError, match="older than"):
        asyncio.run(engine.update_weights([], version=2))
    # Seed 0's weights back, in the default (one) bucket.
    asyncio.run(engine.update_weights(strategy.export_weights(), version=4))
    results = asyncio.run(staggered(engine, [GenerationRequest(f"o{i}", ids, GREEDY)
                                             for i, ids in enumerate(prompt_ids)]))
    for result, row in zip(results, old):
        assert_same(result, row)


def test_abort_returns_the_partial_response_and_a_resumed_request_completes_it(engine, strategy, prompt_ids):
    params = dataclasses.replace(GREEDY, max_new_tokens=200)
    expected = batch_generate(strategy, [prompt_ids[4]], params)[0]
    request = GenerationRequest("long", prompt_ids[4], params)

    async def run():
        task = asyncio.create_task(engine.generate(request))
        await asyncio.sleep(0)  # "long" is handed to the engine before the clock
        await after_tokens(engine, 6)
        [partial] = await engine.abort(["long", "unknown"])
        returned = await task
        health = await engine.health()
        resumed = await engine.generate(request.resumed(partial))
        return partial, returned, health, resumed

    partial, returned, health, resumed = asyncio.run(run())
    assert partial == returned and partial.finish_reason == "abort"
    assert health.num_running == 0 and health.num_waiting == 0
    num_partial = len(partial.response_ids)
    assert 4 <= num_partial < 200
    assert_same(partial, (expected[0][:num_partial], expected[1][:num_partial], "abort"))
    assert_same(resumed, expected)
    assert resumed.log_probs[:num_partial] == partial.log_probs


def test_a_stop_token_ends_the_request_and_includes_it(engine, strategy, prompt_ids):
    tokens, _, _ = batch_generate(strategy, [prompt_ids[1]], GREEDY)[0]
    stop = tokens[5]
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    result = asyncio.run(engine.generate(GenerationRequest("stop", prompt_ids[1], params)))
    assert result.finish_reason == "stop" and list(result.response_ids) == tokens[: tokens.index(stop) + 1]


def test_pause_holds_requests_until_resume(engine, strategy, prompt_ids):
    expected = batch_generate(strategy, [prompt_ids[0]], GREEDY)[0]

    async def run():
        await engine.pause()
        task = asyncio.create_task(engine.generate(GenerationRequest("held", prompt_ids[0], GREEDY)))
        await asyncio.sleep(0.3)
        paused = await engine.health()
        await engine.resume()
        return paused, await task

    paused, result = asyncio.run(run())
    assert paused.paused and paused.num_waiting == 1 and paused.num_running == 0
    assert_same(result, expected)


def test_sleep_is_a_no_op_on_cpu_and_refuses_requests_in_flight(engine, strategy, prompt_ids):
    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("busy", prompt_ids[2], GREEDY)))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.sleep()
        await task
        await engine.sleep()
        slept = await engine.health()
        await engine.wake_up()
        return slept, await engine.generate(GenerationRequest("after", prompt_ids[2], GREEDY))

    slept, result = asyncio.run(run())
    assert slept.sleeping and slept.healthy
    assert_same(result, batch_generate(strategy, [prompt_ids[2]], GREEDY)[0])


def test_bad_requests_fail_loudly(engine, prompt_ids):
    with pytest.raises(ValueError, match="top_k"):
        asyncio.run(engine.generate(GenerationRequest("k", prompt_ids[0], SamplingParams(temperature=1.0, top_k=5))))
    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(engine.generate(GenerationRequest("v", [CHAR_VOCAB_SIZE + 5], GREEDY)))


def test_weights_updated_mid_request_apply_to_its_next_tokens(engine, strategy, other_strategy, prompt_ids):
    """A running request's tokens after `update_weights` carry the new version and are the new weights' greedy
    continuation of what it had (vLLM recomputes its KV cache with the new weights)."""
    params = dataclasses.replace(GREEDY, max_new_tokens=120)
    request = GenerationRequest("mid", prompt_ids[3], params)

    old_version = engine.weight_version

    async def run():
        task = asyncio.create_task(engine.generate(request))
        await asyncio.sleep(0)
        await after_tokens(engine, 6)
        await engine.update_weights(other_strategy.export_weights(), version=old_version + 1)
        return await task

    try:
        result = asyncio.run(run())
    finally:  # seed 0's weights back
        asyncio.run(engine.update_weights(strategy.export_weights(), version=old_version + 2))
    num_old = result.weight_versions.count(old_version)
    assert 4 <= num_old < 120
    assert result.weight_versions == (old_version,) * num_old + (old_version + 1,) * (120 - num_old)
    old_part = list(result.response_ids[:num_old])
    assert old_part == batch_generate(strategy, [prompt_ids[3]], params)[0][0][:num_old]
    continuation = batch_generate(other_strategy, [prompt_ids[3] + old_part],
                                  dataclasses.replace(params, max_new_tokens=120 - num_old))[0]
    tail = dataclasses.replace(result, response_ids=result.response_ids[num_old:], log_probs=result.log_probs[num_old:],
                               weight_versions=result.weight_versions[num_old:])
    assert_same(tail, continuation)


def test_a_cancelled_generate_call_leaves_the_engine(engine, strategy, prompt_ids):
    """A caller that cancels its `generate` call frees the request's place: vLLM stops it, and the engine serves on."""
    params = dataclasses.replace(GREEDY, max_new_tokens=200)

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("dropped", prompt_ids[4], params)))
        await asyncio.sleep(0)
        await after_tokens(engine, 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        result = await engine.generate(GenerationRequest("next", prompt_ids[0], GREEDY))
        return await engine.health(), result

    health, result = asyncio.run(run())
    assert health.num_running == 0 and health.num_waiting == 0 and health.healthy
    assert_same(result, batch_generate(strategy, [prompt_ids[0]], GREEDY)[0])
