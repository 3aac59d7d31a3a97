"""Engine benchmark: generated tokens/s of the `hf` batch path, the `hf` engine and the `vllm` engine under 64 concurrent
requests.

Every side runs the same model (same seed, float32), the same torch thread count and the same work: 16 prompts x 4
samples (a prompt's samples share its prefill), sampled at temperature 1, each row exactly NEW_TOKENS long (no stop
token). The batch side is one `HFStrategy.generate` call; an engine side submits 64 `GenerationRequest`s at once on
one event loop and awaits them all. The hf engine is timed against the batch path in this process, call by call in
alternating order. The vllm engine runs in a child process of its own (vLLM takes over the process's torch thread
settings), timed alone right after, so its ratio pairs it with the batch calls of the same model measured just
before it; it runs where vLLM is installed (`scripts/setup.sh --vllm`) and is left out with a note elsewhere.
Medians are reported, with each engine's start-up (building the model and the engine) and `update_weights` (the
full model, in place) times. Models: small-qwen2 (~7.9M parameters) and a ~40M-parameter Qwen2 built from config
("medium", no download). Prints a table with the target; `--json PATH` also writes the figures
(`hf_engine_ratio_vs_batch`, `hf_tokens_per_s` (the hf engine's), `hf_batch_tokens_per_s`, `vllm_tokens_per_s` and
`weight_update_s` (per engine) are small-qwen2's); `--check` exits 1 when a target is missed.

    .venv/bin/python bench/engines.py [--quick] [--threads 1] [--models small-qwen2,medium]
        [--engines hf_engine,vllm_engine] [--json /tmp/engines.json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import finish, interleaved_times_s, parser as common_parser

from baton.data import DataProto
from baton.engines import Engine, GenerationRequest, HFEngine
from baton.models import build_model, count_parameters, load_tokenizer
from baton.models.tokenizer import CHAR_VOCAB_SIZE, SPECIAL_TOKENS
from baton.strategy import SamplingParams, StrategyConfig
from baton.strategy.hf import HFStrategy

MODELS = {
    "small-qwen2": "small-qwen2",
    "medium": {"base": "small-qwen2", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 10,
               "num_attention_heads": 8, "num_key_value_heads": 4},
}
QUICK_MODEL = "small-qwen2"  # --quick: a smoke run, its figures are not the bench's
SEED = 0
PAD_ID = SPECIAL_TOKENS.index("<pad>")
FIRST_CHAR_ID = len(SPECIAL_TOKENS)

NUM_PROMPTS = 16
SAMPLES_PER_PROMPT = 4  # 64 rows, 64 concurrent requests
PROMPT_LEN = 16  # left-padded; real lengths 8..16
NEW_TOKENS = 32

TARGETS = {"hf_engine": 0.9}  # engine tokens/s / batch-path tokens/s, at least
HAS_VLLM = importlib.util.find_spec("vllm") is not None
CHILD_TIMEOUT_S = 900  # the vllm child: start-up, warm-up and the timed calls of one model


@dataclasses.dataclass(frozen=True)
class Reps:
    warmup: int
    calls: int

    @classmethod
    def for_mode(cls, quick: bool) -> "Reps":
        return cls(warmup=1, calls=3) if quick else cls(warmup=2, calls=7)


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


def engine_side(engine: Engine, loop: asyncio.AbstractEventLoop, prompts: list[list[int]], params: SamplingParams):
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
        assert tokens == expected, f"the engine generated {tokens} tokens, expected {expected}"

    return call


def build_hf_engine(model) -> HFEngine:
    return HFEngine(build_model(model, seed=SEED), load_tokenizer(), seed=SEED)


def build_vllm_engine(model):
    from baton.engines.vllm import VLLMEngine

    return VLLMEngine.from_config(StrategyConfig(model=model, seed=SEED))


# name -> model spec -> a started engine with SEED's weights, which has `close()`. Each runs the same 64 requests.
ENGINES = {"hf_engine": build_hf_engine, "vllm_engine": build_vllm_engine}
IN_CHILD = {"vllm_engine"}  # timed in a child process of its own, after the batch path


def bench_engine(build, model, strategy: HFStrategy, prompts: list[list[int]], params: SamplingParams,
                 reps: Reps, batch_call=None) -> tuple[list[float], dict]:
    """The engine's seconds per call, with its start-up and weight-update times. With `batch_call`, the batch path's
    seconds per call too, timed in alternation with the engine's; else only the engine is timed ([] for the batch)."""
    start = time.perf_counter()
    engine = build(model)
    start_s = time.perf_counter() - start
    loop = asyncio.new_event_loop()
    try:
        engine_call = engine_side(engine, loop, prompts, params)
        if batch_call is None:
            batch_s, engine_s = [], timed_calls(engine_call, reps)
        else:
            batch_s, engine_s = interleaved_times_s(batch_call, engine_call, reps.calls, reps.warmup)
        start = time.perf_counter()
        loop.run_until_complete(engine.update_weights(strategy.export_weights(), version=1))
        weight_update_s = time.perf_counter() - start
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    return batch_s, {"s": statistics.median(engine_s), "times_s": engine_s, "start_s": start_s,
                     "weight_update_s": weight_update_s}


def timed_calls(call, reps: Reps) -> list[float]:
    for _ in range(reps.warmup):
        call()
    times_s = []
    for _ in range(reps.calls):
        start = time.perf_counter()
        call()
        times_s.append(time.perf_counter() - start)
    return times_s


def bench_in_child(engine: str, name: str, threads: int, quick: bool) -> dict:
    """`engine` on model `name`, timed by this script in a child process (`--child`); its figures."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as directory:
        out = os.path.join(directory, "child.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", engine, "--models", name,
                   "--threads", str(threads), "--json", out] + (["--quick"] if quick else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{engine} on {name} did not finish within {CHILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"{engine} on {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def child_main(engine: str, name: str, threads: int, quick: bool, json_path: str) -> int:
    strategy = HFStrategy(StrategyConfig(name="hf", model=MODELS[name], seed=SEED))
    _, figures = bench_engine(ENGINES[engine], MODELS[name], strategy, make_prompts(torch.Generator().manual_seed(SEED)),
                              sampling_params(), Reps.for_mode(quick))
    figures["threads_after_start"] = torch.get_num_threads()
    with open(json_path, "w") as f:
        json.dump(figures, f)
    return 0


def sampling_params() -> SamplingParams:
    """Temperature 1, no stop token (every row runs NEW_TOKENS), one seed per request (see `engine_side`)."""
    return SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, n=SAMPLES_PER_PROMPT, stop_token_ids=(),
                          seed=SEED)


def bench_model(name: str, engines: list[str], quick: bool, threads: int) -> dict:
    reps = Reps.for_mode(quick)
    strategy = HFStrategy(StrategyConfig(name="hf", model=MODELS[name], seed=SEED))
    params = sampling_params()
    prompts = make_prompts(torch.Generator().manual_seed(SEED))
    tokens = NUM_PROMPTS * SAMPLES_PER_PROMPT * NEW_TOKENS
    batch_call = batch_side(strategy, prompts, params)
    all_batch_s, figures = [], {}
    for engine in engines:
        if engine in IN_CHILD:
            batch_s = timed_calls(batch_call, reps)  # the batch path just before the child, on the same machine state
            figures[engine] = bench_in_child(engine, name, threads, quick)
        else:
            batch_s, figures[engine] = bench_engine(ENGINES[engine], MODELS[name], strategy, prompts, params, reps,
                                                    batch_call)
        figures[engine]["tokens_per_s"] = tokens / figures[engine]["s"]
        figures[engine]["ratio_vs_batch"] = statistics.median(batch_s) / figures[engine]["s"]  # its own pairing
        all_batch_s += batch_s
    batch = statistics.median(all_batch_s)
    return {"num_parameters": count_parameters(strategy.hf_model), "tokens_per_call": tokens,
            "hf_batch": {"s": batch, "tokens_per_s": tokens / batch, "times_s": all_batch_s}, "engines": figures}


def print_report(figures: dict) -> None:
    load = figures["load_average_1min"]
    print(f"\nbaton engine benchmark: {NUM_PROMPTS} prompts x {SAMPLES_PER_PROMPT} samples x {NEW_TOKENS} new tokens "
          f"(64 concurrent requests on an engine), float32, {figures['threads']} torch thread(s), "
          f"medians over {figures['repetitions']['calls']} interleaved calls per side")
    print(f"1-min load average at start / end: {load['start']:.1f} / {load['end']:.1f} on {figures['os_cpu_count']} CPUs"
          + ("  (busy machine: ratios are noisier)" if max(load.values()) > figures["os_cpu_count"] else "") + "\n")
    header = (f"{'model':<13}{'params':>8}  {'engine':<12}{'batch tok/s':>12}{'engine tok/s':>14}{'ratio':>7}"
              f"{'start s':>9}{'update s':>10}   {'target':<8}result")
    print(header)
    print("-" * len(header))
    for name, entry in figures["models"].items():
        for engine, e in entry["engines"].items():
            target = TARGETS.get(engine)
            verdict = "" if target is None else f">= {target:<5}{'PASS' if e['ratio_vs_batch'] >= target else 'FAIL'}"
            print(f"{name:<13}{entry['num_parameters'] / 1e6:>7.1f}M  {engine:<12}{entry['hf_batch']['tokens_per_s']:>12.0f}"
                  f"{e['tokens_per_s']:>14.0f}{e['ratio_vs_batch']:>7.2f}{e['start_s']:>9.2f}{e['weight_update_s']:>10.3f}"
                  f"   {verdict}")
    print("(ratio = engine tokens/s / hf batch-path tokens/s: the hf engine timed in alternation with the batch path, "
          "vllm in a child process right after batch calls of its own; start = building the model and the engine; "
          "update = update_weights with the full model)\n")


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--models", help=f"comma-separated, of {sorted(MODELS)} (default: all; small-qwen2 with --quick)")
    default_engines = [e for e in ENGINES if HAS_VLLM or e != "vllm_engine"]
    parser.add_argument("--engines", default=",".join(default_engines),
                        help=f"comma-separated, of {sorted(ENGINES)} (default: those installed)")
    parser.add_argument("--child", metavar="ENGINE", help=argparse.SUPPRESS)  # run one engine and write its figures
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else [QUICK_MODEL] if args.quick else list(MODELS)
    engines = args.engines.split(",")
    if args.threads < 1:
        parser.error(f"--threads {args.threads} must be >= 1")
    if any(m not in MODELS for m in models):
        parser.error(f"--models {args.models}: each must be one of {sorted(MODELS)}")
    if any(e not in ENGINES for e in engines):
        parser.error(f"--engines {args.engines}: each must be one of {sorted(ENGINES)}")
    if "vllm_engine" in engines and not HAS_VLLM:
        parser.error("--engines vllm_engine needs vLLM, which is not installed; install it with scripts/setup.sh --vllm")
    torch.set_num_threads(args.threads)
    if args.child:
        return child_main(args.child, models[0], args.threads, args.quick, args.json)
    if not HAS_VLLM:
        print("vllm_engine left out: vLLM is not installed (scripts/setup.sh --vllm adds it)")
    reps = Reps.for_mode(args.quick)
    figures = {"os_cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "quick": args.quick,
               "repetitions": dataclasses.asdict(reps), "load_average_1min": {"start": os.getloadavg()[0]},
               "models": {name: bench_model(name, engines, args.quick, args.threads) for name in models}}
    figures["load_average_1min"]["end"] = os.getloadavg()[0]
    primary = figures["models"].get("small-qwen2", next(iter(figures["models"].values())))
    figures["hf_batch_tokens_per_s"] = primary["hf_batch"]["tokens_per_s"]
    if "hf_engine" in primary["engines"]:
        figures["hf_engine_ratio_vs_batch"] = primary["engines"]["hf_engine"]["ratio_vs_batch"]
        figures["hf_tokens_per_s"] = primary["engines"]["hf_engine"]["tokens_per_s"]
    if "vllm_engine" in primary["engines"]:
        figures["vllm_tokens_per_s"] = primary["engines"]["vllm_engine"]["tokens_per_s"]
    figures["weight_update_s"] = {e: entry["weight_update_s"] for e, entry in primary["engines"].items()}
    figures["targets"] = {f"{e}_ratio_vs_batch": t for e, t in TARGETS.items() if e in engines}
    figures["passed"] = {f"{e}_ratio_vs_batch": primary["engines"][e]["ratio_vs_batch"] >= t
                         for e, t in TARGETS.items() if e in engines}
    print_report(figures)
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
