"""Engine benchmark: generated tokens/s of the `hf` batch path against the `hf` engine under 64 concurrent requests.

Both sides run in this process on the same model (same seed, float32), the same torch thread count and the
same work: 16 prompts x 4 samples (a prompt's samples share its prefill on both sides), sampled at
temperature 1, each row exactly NEW_TOKENS long (the stop id is outside the vocabulary). The batch side is
one `HFStrategy.generate` call; the engine side submits 64 `GenerationRequest`s at once on one event loop
and awaits them all. Calls are timed one by one in alternating order; medians are reported. Models:
small-qwen2 (~7.9M parameters) and a ~40M-parameter Qwen2 built from config ("medium", no download).
Prints a table with the target; `--json PATH` also writes the figures (`hf_engine_ratio_vs_batch` and
`hf_tokens_per_s`, the engine's, are small-qwen2's), `--check` exits 1 when a target is missed.

    .venv/bin/python bench/engines.py [--quick] [--threads 1] [--models small-qwen2,medium] [--json /tmp/engines.json] [--check]
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import sys
import time

import torch

from common import finish, interleaved_times_s, parser as common_parser

from baton.data import DataProto
from baton.engines import GenerationRequest, HFEngine
from baton.models import build_model, count_parameters
from baton.models.tokenizer import CHAR_VOCAB_SIZE, SPECIAL_TOKENS
from baton.strategy import SamplingParams, StrategyConfig
from baton.strategy.hf import HFStrategy

MODELS = {
    "small-qwen2": "small-qwen2",
    "medium": {"base": "small-qwen2", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 10,
               "num_attention_heads": 8, "num_key_value_heads": 4},
}
SEED = 0
PAD_ID = SPECIAL_TOKENS.index("<pad>")
FIRST_CHAR_ID = len(SPECIAL_TOKENS)
NEVER_SAMPLED_ID = CHAR_VOCAB_SIZE  # outside the vocabulary: no row stops early

NUM_PROMPTS = 16
SAMPLES_PER_PROMPT = 4  # 64 rows, 64 concurrent requests
PROMPT_LEN = 16  # left-padded; real lengths 8..16
NEW_TOKENS = 32

TARGET_ENGINE_RATIO = 0.9  # engine tokens/s / batch tokens/s, at least


@dataclasses.dataclass(frozen=True)
class Reps:
    warmup: int
    calls: int

    @classmethod
    def for_mode(cls, quick: bool) -> "Reps":
        return cls(warmup=1, calls=3) if quick else cls(warmup=1, calls=5)


def make_prompts(generator: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(PROMPT_LEN // 2, PROMPT_LEN + 1, (NUM_PROMPTS,), generator=generator)
    return [torch.randint(FIRST_CHAR_ID, CHAR_VOCAB_SIZE, (int(n),), generator=generator).tolist() for n in lengths]


def batch_side(strategy: HFStrategy, prompts: list[list[int]], params: SamplingParams):
    input_ids = torch.tensor([[PAD_ID] * (PROMPT_LEN - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (PROMPT_LEN - len(p)) + [1] * len(p) for p in prompts])
    batch = DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask})
    expected = len(prompts) * params.n * params.max_new_tokens

    def call():
        tokens = int(strategy.generate(batch, params).batch["response_mask"].sum())
        assert tokens == expected, f"the batch path generated {tokens} tokens, expected {expected}"

    return call


def hf_engine_side(engine: HFEngine, loop: asyncio.AbstractEventLoop, prompts: list[list[int]],
                   params: SamplingParams):
    """All requests submitted at once; a prompt's samples are consecutive requests with their own seeds."""
    calls = iter(range(1 << 30))
    expected = len(prompts) * params.n * params.max_new_tokens

    async def run(call_index: int) -> int:
        requests = [GenerationRequest(f"{call_index}-{i}-{j}", p, dataclasses.replace(params, n=1, seed=SEED + j))
                    for i, p in enumerate(prompts) for j in range(params.n)]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return sum(len(r.response_ids) for r in results)

    def call():
        tokens = loop.run_until_complete(run(next(calls)))
        assert tokens == expected, f"the hf engine generated {tokens} tokens, expected {expected}"

    return call


def bench_model(name: str, reps: Reps) -> dict:
    config = StrategyConfig(name="hf", model=MODELS[name], seed=SEED)
    strategy = HFStrategy(config)
    start = time.perf_counter()
    engine = HFEngine(build_model(MODELS[name], seed=SEED), strategy.tokenizer, seed=SEED)
    engine_start_s = time.perf_counter() - start
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, n=SAMPLES_PER_PROMPT,
                            stop_token_ids=(NEVER_SAMPLED_ID,), seed=SEED)
    prompts = make_prompts(torch.Generator().manual_seed(SEED))
    loop = asyncio.new_event_loop()
    try:
        batch_s, engine_s = interleaved_times_s(batch_side(strategy, prompts, params),
                                                hf_engine_side(engine, loop, prompts, params), reps.calls, reps.warmup)
        start = time.perf_counter()
        loop.run_until_complete(engine.update_weights(strategy.export_weights(), version=1))
        weight_update_s = time.perf_counter() - start
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    # Columns for other engines (vllm_engine: tokens/s under the same 64 requests, start-up and weight update
    # times) go beside "hf_engine" here.
    tokens = NUM_PROMPTS * SAMPLES_PER_PROMPT * NEW_TOKENS
    batch, hf_engine = statistics.median(batch_s), statistics.median(engine_s)
    return {
        "num_parameters": count_parameters(strategy.hf_model), "tokens_per_call": tokens,
        "hf_batch": {"s": batch, "tokens_per_s": tokens / batch, "times_s": batch_s},
        "hf_engine": {"s": hf_engine, "tokens_per_s": tokens / hf_engine, "times_s": engine_s,
                      "start_s": engine_start_s, "weight_update_s": weight_update_s},
        "hf_engine_ratio_vs_batch": batch / hf_engine,
    }


def print_report(figures: dict) -> None:
    load = figures["load_average_1min"]
    print(f"\nbaton engine benchmark: {NUM_PROMPTS} prompts x {SAMPLES_PER_PROMPT} samples x {NEW_TOKENS} new tokens "
          f"(64 concurrent requests on the engine), float32, {figures['threads']} torch thread(s), "
          f"medians over {figures['repetitions']['calls']} interleaved calls per side")
    print(f"1-min load average at start / end: {load['start']:.1f} / {load['end']:.1f} on {figures['os_cpu_count']} CPUs"
          + ("  (busy machine: ratios are noisier)" if max(load.values()) > figures["os_cpu_count"] else "") + "\n")
    header = (f"{'model':<13}{'params':>8}{'batch tok/s':>13}{'engine tok/s':>14}{'ratio':>7}{'start s':>9}"
              f"{'update s':>10}   {'target':<8}result")
    print(header)
    print("-" * len(header))
    for name, entry in figures["models"].items():
        ratio = entry["hf_engine_ratio_vs_batch"]
        print(f"{name:<13}{entry['num_parameters'] / 1e6:>7.1f}M{entry['hf_batch']['tokens_per_s']:>13.0f}"
              f"{entry['hf_engine']['tokens_per_s']:>14.0f}{ratio:>7.2f}{entry['hf_engine']['start_s']:>9.2f}"
              f"{entry['hf_engine']['weight_update_s']:>10.3f}   >= {TARGET_ENGINE_RATIO:<5}"
              f"{'PASS' if ratio >= TARGET_ENGINE_RATIO else 'FAIL'}")
    print("(ratio = engine tokens/s / batch tokens/s; start = building the model and the engine; update = "
          "update_weights with the full model)\n")


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {sorted(MODELS)}")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if args.threads < 1:
        parser.error(f"--threads {args.threads} must be >= 1")
    if any(m not in MODELS for m in models):
        parser.error(f"--models {args.models}: each must be one of {sorted(MODELS)}")
    torch.set_num_threads(args.threads)
    reps = Reps.for_mode(args.quick)
    figures = {"os_cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "quick": args.quick,
               "repetitions": dataclasses.asdict(reps), "load_average_1min": {"start": os.getloadavg()[0]},
               "models": {name: bench_model(name, reps) for name in models}}
    figures["load_average_1min"]["end"] = os.getloadavg()[0]
    primary = figures["models"].get("small-qwen2", next(iter(figures["models"].values())))
    figures["hf_engine_ratio_vs_batch"] = primary["hf_engine_ratio_vs_batch"]
    figures["hf_tokens_per_s"] = primary["hf_engine"]["tokens_per_s"]
    figures["hf_batch_tokens_per_s"] = primary["hf_batch"]["tokens_per_s"]
    figures["targets"] = {"hf_engine_ratio_vs_batch": TARGET_ENGINE_RATIO}
    figures["passed"] = {"hf_engine_ratio_vs_batch": figures["hf_engine_ratio_vs_batch"] >= TARGET_ENGINE_RATIO}
    print_report(figures)
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
