"""Strategy benchmark: the `hf` strategy inside a baton Ray cluster against a plain transformers loop.

Measures, in one run: generate (sampling with a KV cache) through a 1-worker `RolloutWorker` cluster
vs `model.generate` in this process, and one optimizer step through a 1-worker `ActorWorker`
cluster vs a hand-written forward / log-prob / policy-gradient loss / backward / clip / AdamW loop.
Both sides run the same model (small-qwen2, same seed), the same batches and the same torch thread
count; calls are timed one by one in alternating order. Prints a table with the targets; `--json
PATH` also writes the figures, `--check` exits 1 when a target is missed, `--profile` adds a
cProfile of one call of each side.

    .venv/bin/python bench/strategy.py [--quick] [--threads 1] [--json /tmp/strategy.json] [--check] [--profile]
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# A stray Ray call after ray.shutdown() (e.g. a health-check thread) must fail, not attach to another
# Ray instance on this machine.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
# Ray starts worker processes at niceness 15; on a shared machine that alone slows the worker against
# other load while the plain loop runs in this nice-0 process. Same priority on both sides (override
# with RAY_worker_niceness=15 to see Ray's default).
os.environ.setdefault("RAY_worker_niceness", "0")

import torch

from common import finish, interleaved_times_s, local_ray, parser as common_parser

from baton import DataProto, Dispatch, ResourceManager, WorkerConfig, WorkerSpec, create_clusters_parallel, register
from baton.models import build_model
from baton.models.tokenizer import CHAR_VOCAB_SIZE, SPECIAL_TOKENS
from baton.strategy import OptimizerConfig, SamplingParams, StrategyConfig
from baton.strategy.logprobs import position_ids_from_mask
from baton.workers.roles import ActorWorker, RolloutWorker

MODEL = "small-qwen2"
SEED = 0
OPTIMIZER = OptimizerConfig(lr=1e-5)  # AdamW, shared by both sides
GRAD_CLIP = 1.0
NUM_RAY_CPUS = 4
PAD_ID = SPECIAL_TOKENS.index("<pad>")
FIRST_CHAR_ID = len(SPECIAL_TOKENS)
# Outside the vocabulary, so no row can stop early: both sides generate exactly NEW_TOKENS per row.
NEVER_SAMPLED_ID = CHAR_VOCAB_SIZE

NUM_PROMPTS, NUM_PROMPTS_QUICK = 32, 8  # --quick: a smoke run, its figures are not the bench's
SAMPLES_PER_PROMPT = 4
PROMPT_LEN = 16  # left-padded; real lengths 8..16
NEW_TOKENS = 32
TRAIN_ROWS, TRAIN_ROWS_QUICK = 128, 16
RESPONSE_LEN = 32  # right-padded; real lengths 16..32, so rows are 48 columns

TARGET_TIME_RATIO = 1.15  # baton / plain, per call


@dataclasses.dataclass(frozen=True)
class Reps:
    warmup: int  # untimed calls of each side, first
    generate_calls: int  # timed calls of each side
    train_steps: int

    @classmethod
    def for_mode(cls, quick: bool) -> "Reps":
        return cls(warmup=1, generate_calls=2, train_steps=2) if quick else cls(warmup=2, generate_calls=7, train_steps=5)


# --- workers -------------------------------------------------------------------------------------


def pg_loss(outputs: dict[str, torch.Tensor], batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss summed over response tokens (the strategy divides by the token count)."""
    data = batch.batch
    return -(data["advantages"] * outputs["log_probs"] * data["response_mask"]).sum(), {}


class BenchMethods:
    """Thread control, per-call strategy times and profiling, shared by both bench workers."""

    def _record_start(self) -> None:
        self.threads_at_construction = torch.get_num_threads()
        self.strategy_times_s: list[float] = []

    @register(Dispatch.ONE_TO_ALL)
    def set_num_threads(self, num_threads: int) -> dict:
        """torch's threads as built and after `torch.set_num_threads`; the process's OMP_NUM_THREADS and niceness.

        WorkerConfig.env_vars reach the process after torch has read OMP_NUM_THREADS (Ray sets it to 1
        for a fractional-CPU actor), so only this explicit call sets the thread count.
        """
        torch.set_num_threads(num_threads)
        return {"at_construction": self.threads_at_construction, "after_set": torch.get_num_threads(),
                "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"), "niceness": os.nice(0)}

    @register(Dispatch.ONE_TO_ALL)
    def pop_strategy_times(self) -> list[float]:
        """Seconds spent in the strategy call itself, per call since the last pop."""
        times, self.strategy_times_s = self.strategy_times_s, []
        return times

    @register(Dispatch.ONE_TO_ALL)
    def profile_strategy(self, method: str, *args) -> str:
        """cProfile of one `self.strategy.<method>(*args)` call, top functions by own time."""
        profiler = cProfile.Profile()
        profiler.runcall(getattr(self.strategy, method), *args)
        return profile_text(profiler)

    def _timed(self, fn: Callable, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.strategy_times_s.append(time.perf_counter() - start)
        return result


class BenchRolloutWorker(BenchMethods, RolloutWorker):
    def __init__(self, config: StrategyConfig):
        super().__init__(config)
        self._record_start()

    @register(Dispatch.DP_COMPUTE)
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        return self._timed(self.strategy.generate, prompts, params)


class BenchActorWorker(BenchMethods, ActorWorker):
    def __init__(self, config: StrategyConfig):
        super().__init__(config)
        self._record_start()

    @register(Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, batch: DataProto, loss_fn, loss_unit: str = "token") -> dict[str, float]:
        return self._timed(self.strategy.train_step, batch, loss_fn, loss_unit)


# --- the plain side --------------------------------------------------------------------------------


class PlainTrainer:
    """What a hand-written loop does for one policy-gradient step: no baton code on the path."""

    def __init__(self):
        self.model = build_model(MODEL, seed=SEED).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=OPTIMIZER.lr, betas=OPTIMIZER.betas,
                                           eps=OPTIMIZER.eps, weight_decay=OPTIMIZER.weight_decay)

    def step(self, data: dict[str, torch.Tensor]) -> dict[str, float]:
        responses, mask = data["responses"], data["response_mask"]
        response_len = responses.shape[1]
        # logits_to_keep: the LM head runs on the positions that predict response tokens (and the last), as in baton.
        logits = self.model(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                            position_ids=data["position_ids"], logits_to_keep=response_len + 1).logits
        # logits: [rows, response_len + 1, vocab]
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        token_log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)  # [rows, response_len]
        loss = -(data["advantages"] * token_log_probs * mask).sum() / mask.sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss.detach()), "grad_norm": float(grad_norm)}


def plain_generate(model, prompts: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            prompts["input_ids"], attention_mask=prompts["attention_mask"], do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=NEW_TOKENS, num_return_sequences=SAMPLES_PER_PROMPT, eos_token_id=NEVER_SAMPLED_ID,
            pad_token_id=PAD_ID,
        )


# --- batches -----------------------------------------------------------------------------------------


def left_padded(rows: int, width: int, min_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(min_len, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()  # [rows, width]
    ids = torch.randint(FIRST_CHAR_ID, CHAR_VOCAB_SIZE, (rows, width), generator=generator).masked_fill(mask == 0, PAD_ID)
    return ids, mask


def make_prompts(num_prompts: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    input_ids, attention_mask = left_padded(num_prompts, PROMPT_LEN, PROMPT_LEN // 2, generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def make_train_batch(num_rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Rows shaped like generate's output: left-padded prompts then right-padded responses, with advantages."""
    prompts, prompt_mask = left_padded(num_rows, PROMPT_LEN, PROMPT_LEN // 2, generator)
    responses, response_mask = left_padded(num_rows, RESPONSE_LEN, RESPONSE_LEN // 2, generator)
    responses, response_mask = responses.flip(1), response_mask.flip(1)  # right padding
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # [rows, prompt_len + response_len]
    advantages = torch.randn(num_rows, 1, generator=generator).expand(-1, RESPONSE_LEN).contiguous()
    return {"input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask), "responses": responses,
            "response_mask": response_mask, "advantages": advantages}


# --- measurement helpers -----------------------------------------------------------------------------


def profile_text(profiler: cProfile.Profile, top: int = 18) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def summary(baton_s: list[float], plain_s: list[float], in_worker_s: list[float], tokens_per_call: int) -> dict:
    baton, plain, worker = statistics.median(baton_s), statistics.median(plain_s), statistics.median(in_worker_s)
    return {
        "baton_s": baton, "plain_s": plain, "baton_in_worker_s": worker, "ratio": baton / plain,
        "tokens_per_call": tokens_per_call, "baton_tokens_per_s": tokens_per_call / baton,
        "plain_tokens_per_s": tokens_per_call / plain, "baton_times_s": baton_s, "plain_times_s": plain_s,
        "baton_in_worker_times_s": in_worker_s,
    }


# --- benchmarks ------------------------------------------------------------------------------------


def bench_generate(rollout, prompts: dict[str, torch.Tensor], reps: Reps, profile: bool) -> dict:
    model = build_model(MODEL, seed=SEED).eval()
    prompt_batch = DataProto.from_dict(dict(prompts))
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, n=SAMPLES_PER_PROMPT,
                            stop_token_ids=(NEVER_SAMPLED_ID,))
    expected_tokens = len(prompts["input_ids"]) * SAMPLES_PER_PROMPT * NEW_TOKENS

    def baton_side():
        tokens = int(rollout.generate(prompt_batch, params).batch["response_mask"].sum())
        assert tokens == expected_tokens, f"baton generated {tokens} tokens, expected {expected_tokens}"

    def plain_side():
        output = plain_generate(model, prompts)
        tokens = output.shape[0] * (output.shape[1] - PROMPT_LEN)
        assert tokens == expected_tokens, f"transformers generated {tokens} tokens, expected {expected_tokens}"

    baton_s, plain_s = interleaved_times_s(baton_side, plain_side, reps.generate_calls, reps.warmup)
    in_worker_s = rollout.pop_strategy_times()[0][-reps.generate_calls:]
    figures = summary(baton_s, plain_s, in_worker_s, expected_tokens)
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(plain_generate, model, prompts)
        figures["profile"] = {"baton_in_worker": rollout.profile_strategy("generate", prompt_batch, params)[0],
                              "plain": profile_text(profiler)}
    return figures


def bench_train(actor, batch: dict[str, torch.Tensor], reps: Reps, profile: bool) -> dict:
    trainer = PlainTrainer()
    train_batch = DataProto.from_dict(dict(batch))
    tokens = int(batch["attention_mask"].sum())

    # The first step of each side starts from the same weights on the same batch: it must give the same loss.
    [first_baton] = actor.train_step(train_batch, pg_loss)
    first_plain = trainer.step(batch)
    if abs(first_baton["loss"] - first_plain["loss"]) > 1e-4 * max(1.0, abs(first_plain["loss"])):
        raise RuntimeError(f"the two sides compute different losses on the first step: baton {first_baton}, "
                           f"plain {first_plain}; they are not doing the same work")

    baton_s, plain_s = interleaved_times_s(lambda: actor.train_step(train_batch, pg_loss), lambda: trainer.step(batch),
                                           reps.train_steps, max(0, reps.warmup - 1))
    in_worker_s = actor.pop_strategy_times()[0][-reps.train_steps:]
    figures = summary(baton_s, plain_s, in_worker_s, tokens)
    figures["first_step"] = {"baton": first_baton, "plain": first_plain}
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(trainer.step, batch)
        figures["profile"] = {"baton_in_worker": actor.profile_strategy("train_step", train_batch, pg_loss)[0],
                              "plain": profile_text(profiler)}
    return figures


# --- report ----------------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "PASS" if value <= target else "FAIL"


def print_report(figures: dict) -> None:
    threads = figures["threads"]
    print(f"\nbaton strategy benchmark: hf strategy, {MODEL} float32, 1-worker Ray clusters vs plain transformers "
          f"in one process; medians over interleaved calls")
    print(f"torch threads: driver {threads['driver']}; rollout worker {threads['rollout']['at_construction']} as built "
          f"-> {threads['rollout']['after_set']} after set_num_threads; actor worker {threads['actor']['at_construction']} "
          f"-> {threads['actor']['after_set']} (OMP_NUM_THREADS in workers: {threads['actor']['omp_num_threads_env']})")
    print(f"niceness: driver {figures['driver_niceness']}, rollout worker {threads['rollout']['niceness']}, "
          f"actor worker {threads['actor']['niceness']}")
    load = figures["load_average_1min"]
    print(f"1-min load average at start / end: {load['start']:.1f} / {load['end']:.1f} on {figures['os_cpu_count']} CPUs"
          + ("  (busy machine: ratios are noisier)" if max(load.values()) > figures["os_cpu_count"] else ""))
    reps = figures["repetitions"]
    gen, train = figures["generate"], figures["train"]
    print(f"generate: {figures['num_prompts']} prompts x {SAMPLES_PER_PROMPT} samples x {NEW_TOKENS} new tokens, "
          f"{reps['generate_calls']} calls per side; train: {figures['train_rows']} rows x {PROMPT_LEN + RESPONSE_LEN} columns "
          f"({train['tokens_per_call']} real tokens), {reps['train_steps']} steps per side; {reps['warmup']} warm-up calls each\n")
    header = (f"{'measurement':<22}{'baton s':>9}{'in worker':>11}{'plain s':>9}{'baton tok/s':>13}{'plain tok/s':>13}"
              f"{'ratio':>7}   {'target':<9}result")
    print(header)
    print("-" * len(header))
    for label, entry in (("generate (per call)", gen), ("train step", train)):
        print(f"{label:<22}{entry['baton_s']:>9.3f}{entry['baton_in_worker_s']:>11.3f}{entry['plain_s']:>9.3f}"
              f"{entry['baton_tokens_per_s']:>13.0f}{entry['plain_tokens_per_s']:>13.0f}{entry['ratio']:>7.2f}   "
              f"<= {TARGET_TIME_RATIO:<6}{verdict(entry['ratio'], TARGET_TIME_RATIO)}")
    print("(ratio = baton time / plain time; 'in worker' = the strategy call alone, without Ray dispatch and transfer)")
    first = train["first_step"]
    print(f"first train step, same weights and batch: loss baton {first['baton']['loss']:.6f} / plain "
          f"{first['plain']['loss']:.6f}, grad norm {first['baton']['grad_norm']:.5f} / {first['plain']['grad_norm']:.5f}\n")
    for name, entry in (("generate", gen), ("train step", train)):
        if "profile" in entry:
            for side, text in entry["profile"].items():
                print(f"--- cProfile, {name}, {side} ---\n{text}")


def run_benchmarks(reps: Reps, num_threads: int, quick: bool, profile: bool) -> dict:
    torch.set_num_threads(num_threads)
    config = StrategyConfig(name="hf", model=MODEL, seed=SEED, optimizer=OPTIMIZER, grad_clip=GRAD_CLIP)
    env = {"OMP_NUM_THREADS": str(num_threads)}
    manager = ResourceManager(num_nodes=1, num_devices_per_node=1, backend="ray")
    rollout, actor = create_clusters_parallel(
        [(WorkerSpec(BenchRolloutWorker, (config,)), WorkerConfig("rollout", world_size=1, env_vars=env)),
         (WorkerSpec(BenchActorWorker, (config,)), WorkerConfig("actor", world_size=1, env_vars=env,
                                                                share_devices_with=("rollout",)))],
        manager,
    )
    try:
        num_prompts, train_rows = (NUM_PROMPTS_QUICK, TRAIN_ROWS_QUICK) if quick else (NUM_PROMPTS, TRAIN_ROWS)
        figures = {"os_cpu_count": os.cpu_count(), "model": MODEL, "quick": quick, "repetitions": dataclasses.asdict(reps),
                   "num_prompts": num_prompts, "train_rows": train_rows,
                   "load_average_1min": {"start": os.getloadavg()[0]}, "driver_niceness": os.nice(0),
                   "threads": {"driver": torch.get_num_threads(), "rollout": rollout.set_num_threads(num_threads)[0],
                               "actor": actor.set_num_threads(num_threads)[0]}}
        generator = torch.Generator().manual_seed(SEED)
        figures["generate"] = bench_generate(rollout, make_prompts(num_prompts, generator), reps, profile)
        figures["train"] = bench_train(actor, make_train_batch(train_rows, generator), reps, profile)
        figures["load_average_1min"]["end"] = os.getloadavg()[0]
    finally:
        for cluster in (rollout, actor):
            cluster.shutdown()
        manager.shutdown()

    figures["generate_ratio_vs_plain"] = figures["generate"]["ratio"]
    figures["train_ratio_vs_plain"] = figures["train"]["ratio"]
    figures["targets"] = {"generate_ratio_vs_plain": TARGET_TIME_RATIO, "train_ratio_vs_plain": TARGET_TIME_RATIO}
    figures["passed"] = {key: figures[key] <= target for key, target in figures["targets"].items()}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1)")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of one call of each side")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads {args.threads} must be >= 1")

    with local_ray(NUM_RAY_CPUS):
        figures = run_benchmarks(Reps.for_mode(args.quick), args.threads, args.quick, args.profile)

    print_report(figures)
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
