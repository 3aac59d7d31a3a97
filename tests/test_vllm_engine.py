"""The `vllm` engine on CPU: concurrent requests against HF's batch path, log-probs against an HF forward, weights in
place, abort and resume, pause, stop tokens and health, on tiny-qwen2 (float32). The `vllm` strategy (a rollout over
the engine): the generate() layout, forward against HF, weights from hf and fsdp2 actors, a LoRA actor's adapter
served by vLLM (and a sync of it that does not reach the engine failing the probe), the config checks, and the demo's
GRPO stage with a vLLM rollout (examples/vllm_grpo.yaml).

Needs vLLM (`scripts/setup.sh --vllm`); without it these tests skip, but for the ones that check the refusals and
the install hint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
import yaml

from baton.cli import resolve
from baton.config import ConfigError
from baton.data import DataProto
from baton.engines import Engine, GenerationRequest
from baton.engines.vllm import VLLMEngine
from baton.models.tokenizer import CHAR_VOCAB_SIZE
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.preflight import check_roles
from baton.strategy import (InferenceStrategy, ModelStrategy, RolloutStrategy, SamplingParams, StrategyConfig,
                            create_strategy)
from baton.strategy.base import LoraConfig
from baton.strategy.hf import HFStrategy
from baton.strategy.logprobs import sampling_temperature
from baton.strategy.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter
from baton.tracking.tracker import read_metrics
from baton.workers.weight_sync import ModelUpdatePair, WeightSyncError, probe_batch
from test_engines import assert_same, staggered

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = "vLLM is not installed; install it with scripts/setup.sh --vllm"
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=SKIP_REASON)
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

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
    pytest.importorskip("vllm", reason=SKIP_REASON)
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
    results = asyncio.run(staggered(engine, requests, gap_s=0.005))
    for i, (request, result) in enumerate(zip(requests, results)):
        assert result.request_id == request.request_id
        assert_same(result, expected[i % len(prompt_ids)], atol=LOG_PROB_ATOL)
        assert result.weight_versions == (0,) * GREEDY.max_new_tokens and result.weight_version == 0


def test_sampled_log_probs_match_an_hf_forward_at_the_temperature(engine, strategy, prompt_ids):
    """Sampled tokens' log-probs are those an actor recomputes at the sampling temperature (float32: within 1e-4),
    and a seeded request gives the same sample alone as in a crowd."""
    params = [SamplingParams(temperature=t, max_new_tokens=16, stop_token_ids=(NEVER,), seed=7 + i)
              for i, t in enumerate([0.7, 1.0, 1.3, 1.0])]
    requests = [GenerationRequest(f"s{i}", prompt_ids[i], p) for i, p in enumerate(params)]
    crowd = asyncio.run(staggered(engine, requests + [GenerationRequest(f"c{i}", ids, GREEDY)
                                                      for i, ids in enumerate(prompt_ids)], gap_s=0.005))[: len(requests)]
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
                                             for i, ids in enumerate(prompt_ids)], gap_s=0.005))
    for result, row in zip(results, new):
        assert_same(result, row, atol=LOG_PROB_ATOL)
        assert result.weight_versions == (3,) * GREEDY.max_new_tokens and result.weight_version == 3
    with pytest.raises(ValueError, match="older than"):
        asyncio.run(engine.update_weights([], version=2))
    # Seed 0's weights back, in the default (one) bucket.
    asyncio.run(engine.update_weights(strategy.export_weights(), version=4))
    results = asyncio.run(staggered(engine, [GenerationRequest(f"o{i}", ids, GREEDY)
                                             for i, ids in enumerate(prompt_ids)], gap_s=0.005))
    for result, row in zip(results, old):
        assert_same(result, row, atol=LOG_PROB_ATOL)


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
    assert_same(partial, (expected[0][:num_partial], expected[1][:num_partial], "abort"), atol=LOG_PROB_ATOL)
    assert_same(resumed, expected, atol=LOG_PROB_ATOL)
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
    assert_same(result, expected, atol=LOG_PROB_ATOL)


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
    assert_same(result, batch_generate(strategy, [prompt_ids[2]], GREEDY)[0], atol=LOG_PROB_ATOL)


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
    assert_same(tail, continuation, atol=LOG_PROB_ATOL)


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
    assert_same(result, batch_generate(strategy, [prompt_ids[0]], GREEDY)[0], atol=LOG_PROB_ATOL)


# --- the `vllm` strategy: a rollout -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rollout():
    """One vllm strategy for the module: tiny-qwen2 with seed 0's weights. A test that changes them puts them back."""
    pytest.importorskip("vllm", reason=SKIP_REASON)
    config = StrategyConfig(name="vllm", model="tiny-qwen2", seed=0,
                            engine_kwargs={"kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 48})
    rollout = create_strategy(config)
    yield rollout
    rollout.close()


def left_padded(strategy: HFStrategy, prompts: list[str]) -> DataProto:
    strategy.tokenizer.padding_side = "left"
    enc = strategy.tokenizer(prompts, return_tensors="pt", padding=True)
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
                               {"uid": np.array([f"p{i}" for i in range(len(prompts))], dtype=object)})


def max_diff_on_responses(ours: DataProto, theirs: DataProto, batch: DataProto) -> float:
    mask = batch.batch["response_mask"].bool()
    return float((ours.batch["log_probs"] - theirs.batch["log_probs"]).abs()[mask].max())


def test_generate_gives_the_layout_with_the_actors_log_probs(rollout, strategy):
    """n consecutive rows per prompt, right-padded responses ending at their stop token, the prompts' columns
    repeated, the temperature recorded, and rollout_log_probs that the actor recomputes (float32: within 1e-4)."""
    prompts = left_padded(strategy, PROMPTS[:4])
    pad, stop = strategy.tokenizer.pad_token_id, 6  # a token these prompts' samples draw now and then
    params = SamplingParams(temperature=0.8, max_new_tokens=20, n=3, seed=11, stop_token_ids=(stop,))
    out = rollout.generate(prompts, params)
    rows, width = 12, prompts.batch["input_ids"].shape[1]
    assert out.batch["prompts"].shape == (rows, width) and out.meta_info["temperature"] == 0.8
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, 0))
    assert list(out.non_tensor_batch["uid"]) == [f"p{i // 3}" for i in range(rows)]
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], responses], 1))
    lengths = mask.sum(-1)
    assert torch.equal(mask, (torch.arange(responses.shape[1]) < lengths[:, None]).long())  # right padded
    assert bool((responses[mask == 0] == pad).all()) and bool((out.batch["rollout_log_probs"][mask == 0] == 0).all())
    reasons = list(out.non_tensor_batch["finish_reason"])
    assert set(reasons) == {"stop", "length"}  # both kinds occur with this seed
    for row, reason in enumerate(reasons):
        last = int(responses[row, lengths[row] - 1])
        assert (reason == "stop") == (last == stop) and (reason == "length") == (int(lengths[row]) == 20)
    assert len({tuple(r.tolist()) for r in responses[:3]}) > 1  # a prompt's samples have their own seeds
    recomputed = strategy.forward(out, temperature=0.8)
    diff = (out.batch["rollout_log_probs"] - recomputed.batch["log_probs"]).abs()[mask.bool()]
    assert float(diff.max()) <= LOG_PROB_ATOL
    again = rollout.generate(prompts, params)
    assert torch.equal(again.batch["responses"], responses)  # params.seed fixes every request's seed
    other = rollout.generate(prompts, dataclasses.replace(params, seed=12))
    assert not torch.equal(other.batch["responses"][:, :5], responses[:, :5])


def test_unseeded_generate_draws_its_seeds_from_the_generator_it_reports(rollout, strategy):
    """params.seed None: the request seeds come from `generator` (the rollout worker saves and restores its state)."""
    prompts = left_padded(strategy, PROMPTS[:2])
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, stop_token_ids=(NEVER,))
    state = rollout.generator.get_state()
    first = rollout.generate(prompts, params).batch["responses"]
    second = rollout.generate(prompts, params).batch["responses"]
    rollout.generator.set_state(state)
    assert not torch.equal(first, second)
    assert torch.equal(rollout.generate(prompts, params).batch["responses"], first)


def test_greedy_generate_equals_the_hf_strategy(rollout, strategy):
    prompts = left_padded(strategy, PROMPTS)
    ours, theirs = rollout.generate(prompts, GREEDY), strategy.generate(prompts, GREEDY)
    assert torch.equal(ours.batch["responses"], theirs.batch["responses"])
    assert list(ours.non_tensor_batch["finish_reason"]) == list(theirs.non_tensor_batch["finish_reason"])
    torch.testing.assert_close(ours.batch["rollout_log_probs"], theirs.batch["rollout_log_probs"], atol=LOG_PROB_ATOL,
                               rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_forward_matches_an_hf_forward(rollout, strategy, temperature):
    """vLLM's prompt log-probs of sampled responses (right-padded, ragged) and of a probe batch, at the temperature."""
    sampled = strategy.generate(left_padded(strategy, PROMPTS), SamplingParams(
        temperature=temperature, max_new_tokens=16, n=2, seed=3, stop_token_ids=(6,)))
    assert sampled.batch["response_mask"].sum(-1).unique().numel() > 1  # ragged responses
    ours = rollout.forward(sampled, temperature)
    assert max_diff_on_responses(ours, strategy.forward(sampled, temperature), sampled) <= LOG_PROB_ATOL
    assert bool((ours.batch["log_probs"][sampled.batch["response_mask"] == 0] == 0).all())
    probe = probe_batch(strategy.tokenizer, ["1+2=3", "hello there", "x=1"], 2)
    assert max_diff_on_responses(rollout.forward(probe, temperature), strategy.forward(probe, temperature),
                                 probe) <= LOG_PROB_ATOL


def test_weights_from_hf_and_fsdp2_actors_pass_the_sync_probe(rollout, strategy, other_strategy):
    """export_weights -> import_weights from an hf and an fsdp2 actor (other weights: seeds 1 and 2): the probe's log-probs
    agree at the float32 tolerance, and the rollout generates the new weights' greedy tokens."""
    from baton.strategy.fsdp2 import Fsdp2Strategy

    probe = probe_batch(strategy.tokenizer, ["1+2=3", "hello there", "abc"], 2)
    prompts = left_padded(strategy, PROMPTS)
    hf_seed_2 = HFStrategy(StrategyConfig(model="tiny-qwen2", seed=2))  # generates what the fsdp2 actor holds
    try:
        for actor, reference in ((other_strategy, other_strategy),
                                 (Fsdp2Strategy(StrategyConfig(name="fsdp2", model="tiny-qwen2", seed=2)), hf_seed_2)):
            assert max_diff_on_responses(rollout.forward(probe), actor.forward(probe), probe) > 0.1
            rollout.import_weights(actor.export_weights(bucket_bytes=64 << 10))  # layers split across buckets
            assert max_diff_on_responses(rollout.forward(probe), actor.forward(probe), probe) <= 1e-4
            assert torch.equal(rollout.generate(prompts, GREEDY).batch["responses"],
                               reference.generate(prompts, GREEDY).batch["responses"])
    finally:
        rollout.import_weights(strategy.export_weights())
    assert max_diff_on_responses(rollout.forward(probe), strategy.forward(probe), probe) <= 1e-4


def test_what_a_rollout_does_not_do_says_where_to_do_it(rollout, strategy):
    for name, where in [("export_weights", "from the actor"), ("save_checkpoint", "checkpoint the actor"),
                        ("train_step", "'hf' or 'fsdp2'"), ("share_weights_from", "copies them")]:
        with pytest.raises(AttributeError, match=where):
            getattr(rollout, name)
    assert not hasattr(rollout, "no_such_method")
    prompts = left_padded(strategy, PROMPTS[:1])
    rollout.offload()  # vLLM's sleep: on CPU nothing is freed
    try:
        with pytest.raises(RuntimeError, match="reload"):
            rollout.generate(prompts, GREEDY)
    finally:
        rollout.reload()
    assert torch.equal(rollout.generate(prompts, GREEDY).batch["responses"],
                       strategy.generate(prompts, GREEDY).batch["responses"])


# --- a LoRA actor's adapter, served by vLLM -----------------------------------------------------------------

LORA = LoraConfig(rank=8, alpha=16)


@pytest.fixture(scope="module")
def lora_rollout():
    """A vllm strategy that serves LoRA adapters up to rank 8 on tiny-qwen2 with seed 0's weights. A test that gives
    it an adapter puts seed 0's plain weights back (which drops the adapter) before it returns."""
    pytest.importorskip("vllm", reason=SKIP_REASON)
    config = StrategyConfig(name="vllm", model="tiny-qwen2", seed=0, engine_kwargs={
        "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 48, "enable_lora": True, "max_lora_rank": 8})
    rollout = create_strategy(config)
    yield rollout
    rollout.close()


def lora_actor(seed: int) -> HFStrategy:
    """An hf actor on seed 0's tiny-qwen2 whose adapter's B matrices are drawn from `seed`, as after training (peft
    starts them at 0, where the adapter changes nothing)."""
    actor = HFStrategy(StrategyConfig(model="tiny-qwen2", seed=0, lora=LORA))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in actor.hf_model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return actor


def adapter_of(actor: HFStrategy, directory) -> tuple[dict[str, torch.Tensor], dict]:
    """The actor's adapter as peft saves it (what a LoRA checkpoint holds): its tensors and adapter_config.json."""
    from safetensors.torch import load_file

    save_adapter(actor.peft_model, str(directory))
    with open(directory / ADAPTER_CONFIG) as f:
        return load_file(str(directory / ADAPTER_WEIGHTS)), json.load(f)


@dataclasses.dataclass
class InProcess:
    """A role's strategy answering `compute_log_probs` as its `ModelWorker` does, so that `ModelUpdatePair`'s probe
    compares two strategies of this process."""
    name: str
    strategy: object

    def compute_log_probs(self, batch: DataProto) -> DataProto:
        return self.strategy.forward(batch, temperature=sampling_temperature(batch))


def test_vllm_serves_a_peft_adapter_as_the_lora_actor_computes(lora_rollout, strategy, tmp_path):
    """vLLM's CPU build with enable_lora: the actor's adapter, on the base weights, gives the LoRA actor's probe
    log-probs (float32: within 1e-4), greedy tokens and sampling log-probs; without it the base is far from them."""
    actor = lora_actor(seed=1)
    probe = probe_batch(actor.tokenizer, ["1+2=3", "hello there", "abc"], 2)
    prompts = left_padded(actor, PROMPTS)
    assert max_diff_on_responses(lora_rollout.forward(probe), actor.forward(probe), probe) > 0.1
    version = lora_rollout.engine.weight_version
    try:
        lora_rollout.import_adapter(*adapter_of(actor, tmp_path))
        assert lora_rollout.engine.weight_version == version + 1
        assert max_diff_on_responses(lora_rollout.forward(probe), actor.forward(probe), probe) <= LOG_PROB_ATOL
        ours, theirs = lora_rollout.generate(prompts, GREEDY), actor.generate(prompts, GREEDY)
        assert torch.equal(ours.batch["responses"], theirs.batch["responses"])
        assert not torch.equal(ours.batch["responses"], strategy.generate(prompts, GREEDY).batch["responses"])
        torch.testing.assert_close(ours.batch["rollout_log_probs"], theirs.batch["rollout_log_probs"],
                                   atol=LOG_PROB_ATOL, rtol=0)
    finally:
        lora_rollout.import_weights(strategy.export_weights())
    assert max_diff_on_responses(lora_rollout.forward(probe), strategy.forward(probe), probe) <= LOG_PROB_ATOL


def test_each_adapter_is_a_new_version_and_merged_weights_drop_it(lora_rollout, strategy, tmp_path):
    """Every adapter is served as its own vLLM LoRA request whose id is the new weight version; the previous one is
    removed from vLLM, and plain weights sent after an adapter are served without it."""
    probe = probe_batch(strategy.tokenizer, ["1+2=3", "hello there", "abc"], 2)
    engine = lora_rollout.engine
    first, second = lora_actor(seed=1), lora_actor(seed=2)
    try:
        for actor, folder in ((first, "first"), (second, "second")):
            lora_rollout.import_adapter(*adapter_of(actor, tmp_path / folder))
            assert engine.lora_request.lora_int_id == engine.weight_version
            assert engine._engine.list_loras() == {engine.weight_version}
            assert max_diff_on_responses(lora_rollout.forward(probe), actor.forward(probe), probe) <= LOG_PROB_ATOL
        assert max_diff_on_responses(lora_rollout.forward(probe), first.forward(probe), probe) > 0.1
        with pytest.raises(ValueError, match="not newer"):
            lora_rollout.runner.run(engine.update_adapter(*adapter_of(first, tmp_path / "old"), engine.weight_version))
    finally:
        lora_rollout.import_weights(strategy.export_weights())
    assert engine.lora_request is None and engine._engine.list_loras() == set()
    assert max_diff_on_responses(lora_rollout.forward(probe), strategy.forward(probe), probe) <= LOG_PROB_ATOL


def test_an_adapter_sync_that_the_engine_does_not_serve_fails_the_probe(lora_rollout, strategy, tmp_path, monkeypatch):
    """Broken on purpose (the silent no-op of verl#7495): vLLM loads the adapter and the version goes up, but requests
    run without it. The sync probe (`ModelUpdatePair.check`) scores with the engine's requests, so it raises."""
    actor = lora_actor(seed=3)
    probe = probe_batch(actor.tokenizer, ["1+2=3", "hello there", "abc"], 2)
    pair = ModelUpdatePair(InProcess("actor", actor), InProcess("rollout", lora_rollout), probe)
    load = VLLMEngine._load_adapter

    def loaded_but_not_served(self, *args):
        load(self, *args)
        self.lora_request = None

    monkeypatch.setattr(VLLMEngine, "_load_adapter", loaded_but_not_served)
    version = lora_rollout.engine.weight_version
    try:
        lora_rollout.import_adapter(*adapter_of(actor, tmp_path / "broken"))
        assert lora_rollout.engine.weight_version == version + 1  # the version alone does not show what is served
        with pytest.raises(WeightSyncError, match="did not receive the trained weights"):
            pair.check()
        monkeypatch.undo()
        lora_rollout.import_adapter(*adapter_of(actor, tmp_path / "fixed"))
        assert pair.check() <= LOG_PROB_ATOL
    finally:
        lora_rollout.import_weights(strategy.export_weights())


def test_an_adapter_needs_an_engine_built_for_lora(rollout, tmp_path):
    with pytest.raises(ValueError, match="enable_lora=True"):
        rollout.import_adapter(*adapter_of(lora_actor(seed=1), tmp_path))


# --- the name `vllm` in configs --------------------------------------------------------------------------


def vllm_rlvr(**roles) -> RLVRConfig:
    return RLVRConfig(**{"rollout": RoleConfig(strategy=StrategyConfig(name="vllm")), **roles},
                      trainer=TrainerConfig(backend="local"))


@pytest.mark.parametrize("role", ["actor", "reference", "critic"])
def test_vllm_is_refused_for_roles_other_than_the_rollout(role):
    kind = "value" if role == "critic" else "causal_lm"
    config = vllm_rlvr(**{role: RoleConfig(strategy=StrategyConfig(name="vllm", kind=kind))})
    with pytest.raises(ConfigError, match=f"{role}.strategy.name is 'vllm', an inference engine.*{role}.strategy.name=fsdp2 / hf / mock "):
        check_roles(config, config.trainer)


@needs_vllm
def test_the_vllm_strategy_is_a_rollout_strategy_only(rollout):
    assert isinstance(rollout, RolloutStrategy) and not isinstance(rollout, ModelStrategy)
    assert isinstance(HFStrategy(StrategyConfig()), InferenceStrategy)


@needs_vllm
def test_the_config_engine_kwargs_reach_vllm(rollout):
    settings = rollout.engine._engine.vllm_config
    assert settings.cache_config.kv_cache_memory_bytes == 64 << 20 and settings.scheduler_config.max_num_seqs == 48


def test_engine_kwargs_are_refused_for_strategies_that_take_none():
    config = vllm_rlvr(actor=RoleConfig(strategy=StrategyConfig(engine_kwargs={"max_model_len": 64})))
    with pytest.raises(ConfigError, match=r"actor.strategy.engine_kwargs \['max_model_len'\] are an inference engine's"):
        check_roles(config, config.trainer)


def test_vllm_refuses_top_k_and_top_p_sampling():
    for sampling in (SamplingConfig(top_k=5), SamplingConfig(top_p=0.9)):
        with pytest.raises(ConfigError, match="sampling.top_k=0 and sampling.top_p=1.0"):
            dataclasses.replace(vllm_rlvr(), sampling=sampling).check()
    dataclasses.replace(vllm_rlvr(), sampling=SamplingConfig(temperature=0.0, top_k=5)).check()  # greedy: no filter
    RLVRConfig(sampling=SamplingConfig(top_k=5)).check()  # the hf rollout filters


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is not installed")
def test_without_vllm_the_name_says_how_to_install_it():
    with pytest.raises(ImportError, match="scripts/setup.sh --vllm"):
        create_strategy(StrategyConfig(name="vllm"))
    config = vllm_rlvr()
    with pytest.raises(ConfigError, match="rollout.strategy.name: .*scripts/setup.sh --vllm"):
        check_roles(config, config.trainer)


@needs_vllm
def test_with_vllm_a_vllm_rollout_passes_the_checks():
    config = vllm_rlvr()
    config.check()
    check_roles(config, config.trainer)


# --- examples/vllm_grpo.yaml ----------------------------------------------------------------------------

# As tests/test_pipeline_paths.py's TWO_STEP_DEMO, for 3 steps, with 2 epochs: the old log-prob pass logs
# rollout/logprob_diff, the gap between the vLLM rollout's log-probs and the actor's.
THREE_STEP_DEMO = ["sft.trainer.num_steps=2", "rlvr.trainer.num_steps=3", "data.max_operand=9",
                   "data.num_val_examples=4", "rlvr.sampling.num_samples_per_prompt=2", "rlvr.algorithm.num_ppo_epochs=2",
                   *[f"{stage}.trainer.{key}" for stage in ("sft", "rlvr")
                     for key in ("backend=local", "progress_bar=false", "num_prompts_per_step=4")]]


@needs_vllm
@pytest.mark.parametrize("actor, backend, colocated", [("hf", "local", False), ("fsdp2", "local", False),
                                                      ("hf", "ray", False), ("hf", "local", True)])
def test_the_vllm_grpo_example_runs_with_the_actors_log_probs(tmp_path, request, actor, backend, colocated):
    """The demo's GRPO stage with a vLLM rollout, in the driver's process or in a Ray worker of its own: every step
    syncs (the probe raises above 1e-4) and the rollout's log-probs of its samples are the actor's within 1e-4.
    Colocated with the actor, the sync still copies (sharing tensors is for two hf models: the vllm strategy has no
    share_weights_from, so an attempt would raise)."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, "vllm_grpo.yaml"),
                                   [*THREE_STEP_DEMO, f"rlvr.actor.strategy.name={actor}", f"rlvr.trainer.backend={backend}",
                                    f"rlvr.colocate_actor_rollout={str(colocated).lower()}", f"run_dir={tmp_path}"])
    summary = run_pipeline(pipeline_cls, config)
    assert summary["rlvr"]["num_steps"] == 3
    ran = yaml.safe_load(open(tmp_path / "rlvr" / "config.yaml"))
    assert ran["rollout"]["strategy"]["name"] == "vllm" and ran["actor"]["strategy"]["name"] == actor
    assert ran["colocate_actor_rollout"] is colocated
    records = [r for r in read_metrics(str(tmp_path / "rlvr" / "metrics.jsonl")) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert "timing_s/sync" in record  # synced, and the probe passed (WeightSyncError otherwise)
        assert 0 < record["rollout/logprob_diff/max"] <= 1e-4, record
        assert record["actor/grad_norm"] >= 0  # the exact-match reward may give these few samples no signal


LORA_DEMO = [*THREE_STEP_DEMO, "rlvr.actor.strategy.lora.rank=8", "rlvr.actor.strategy.lora.alpha=16",
             "rlvr.actor.strategy.optimizer.lr=3e-3", "rlvr.rollout.strategy.engine_kwargs.enable_lora=true",
             "rlvr.rollout.strategy.engine_kwargs.max_lora_rank=8",
             "rlvr.algorithm.entropy_coeff=0.1"]  # an update moves the adapter whatever the rewards


@needs_vllm
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_lora_actor_sends_only_its_adapter_to_a_vllm_rollout_built_for_adapters(tmp_path, request, monkeypatch,
                                                                                  backend):
    """The demo's GRPO stage with a LoRA actor and a vLLM rollout built with enable_lora, in the driver's process or
    in Ray workers: every sync sends the adapter (in the driver's process merged weights would fail here), the probe
    passes, and the rollout's log-probs are the actor's."""
    from baton.engines.vllm_rollout import VLLMRollout

    def merged(self, buckets):
        raise AssertionError("merged weights were sent to a rollout that serves adapters")

    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    monkeypatch.setattr(VLLMRollout, "import_weights", merged)
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, "vllm_grpo.yaml"),
                                   [*LORA_DEMO, f"rlvr.trainer.backend={backend}", f"run_dir={tmp_path}"])
    assert run_pipeline(pipeline_cls, config)["rlvr"]["num_steps"] == 3
    records = [r for r in read_metrics(str(tmp_path / "rlvr" / "metrics.jsonl")) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert "timing_s/sync" in record
        assert 0 < record["rollout/logprob_diff/max"] <= 1e-4, record


@needs_vllm
def test_an_adapter_sync_that_does_nothing_stops_the_run(tmp_path, monkeypatch):
    """Broken on purpose: the rollout drops the adapter it is sent (verl#7495's silent no-op). The first sync passes
    (peft's adapter starts as the identity), the one after the first update fails the probe."""
    from baton.engines.vllm_rollout import VLLMRollout

    monkeypatch.setattr(VLLMRollout, "import_adapter", lambda self, tensors, adapter_config: None)
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, "vllm_grpo.yaml"), [*LORA_DEMO, f"run_dir={tmp_path}"])
    with pytest.raises(WeightSyncError, match="did not receive the trained weights"):
        run_pipeline(pipeline_cls, config)
