"""The rollout system's three modes side by side: `sync`, `one_step_off` and `async` GRPO on the demo task, and the
two overlapped ones in deterministic mode (`rollout_system.deterministic`; async with max_staleness 2 there, so that
two steps' rollouts run ahead of training).

One run takes the demo's SFT checkpoint (tiny-qwen2 on the weak teacher's arithmetic: trained once by the demo's
SFT stage and cached in the run directory, `--fresh` redoes it; or `--sft-checkpoint PATH`), then runs the same
GRPO from it in each mode on a local Ray instance of `NUM_RAY_CPUS` CPUs: the actor in one worker on device slot
0, one rollout engine in another on slot 1, each with one torch thread, so generation and training can run at
the same time on two cores; the driver (router, manager, rewards) keeps one thread. As GPUs would be, the cores are
the trainer's and the engine's own: the actor runs on core 0 (`actor.cpu_cores`), the engine on core 1
(`rollout.cpu_cores`), and the driver, with the Ray processes it starts, runs on core 1 too (what `taskset -c 1`
does for a `baton run`: Ray's raylet, GCS and agents use about 6% of a core, none of it on the trainer's).
Unpinned (`--no-pin`), three busy processes share two cores as the OS sees fit, and the trainer, the critical path
of an overlapped step, is slowed by the others. Every mode trains on the same
number of samples (steps × prompts × samples per prompt) from the same seed.

The setting makes generation and training each take 35–65% of a `sync` step: 64 prompts × 16 samples per step
(the demo: 64 × 8) and one update in micro-batches of `MICRO_BATCH_SIZE` rows at lr `LR`. The demo's answers stay
~3 tokens whatever `max_new_tokens` allows (the SFT model stops at eos), so the responses cannot be made longer.

Each seed runs the five modes one after another, in an order rotated by one from the last seed's (seed list
position 0: sync, one_step_off, async, then the deterministic two; 1: one_step_off, ..., sync), so that no mode always
has the same place: timings drift within minutes on a shared machine, and a mode always run last would carry the
drift.

Per mode it prints the median seconds per step (the first `NUM_WARMUP_STEPS` dropped), the greedy held-out
accuracy at the end (`val/accuracy`, 200 problems) and the split of a step:
  gen   = `timing_s/gen`: the wait for the step's training batch (in `sync` all of generation; in the overlapped
          modes only what training did not hide: the next step's batch is generated or taken, and made training
          data, while this step trains);
  train = step − gen: everything else in the step (old log-probs, advantages, the update, the weight sync),
          as the median step minus the median gen, so that a sync step is gen + train.
The sync run's gen and train are the work a step holds; an overlapped step takes at best max(gen, train) of
them, so a mode's overlap efficiency is (sync gen + sync train) / its step, against the ideal
(gen + train) / max(gen, train); `overlap_efficiency` in the JSON is the better overlapped mode's.

Per mode it also meters the CPU seconds a step uses in the driver and every Ray worker process together (`CPU s`,
sampled with psutil) and divides them by the machine's cores (`floor s`): no schedule runs that work in less wall
time on this machine, so where the floor is above max(gen, train) the cores, not the overlap, bound the step.

Before the runs it measures the machine's core contention (pinned runs only): how many times longer a one-thread
torch forward/backward takes on the trainer's core while another process runs torch on the engine's core. Where it
is above 1, the cores share their vector units or memory path, the update runs slower beside generation than alone,
and an overlapped step's train (printed over the sync run's) is longer than the sync run's max(gen, train).

`--long-traces` is the setting where responses are long and their lengths vary 10× within a batch, as reasoning
traces do: each sample's budget is `LONG_TRACE_MIN_TOKENS` times 1 to 10 (by its seed), eos ignored, so a step's
groups finish far apart and the long ones meet weight updates on the way. It runs sync and free-running async under
each stale policy (`rollout_system.stale_policy`: drop, withhold, pace; partial rollouts on) and prints, beside the
speed-up, what each policy did: groups sent back per step, tokens withheld from the loss, and the trained responses'
mean length against sync's (dropping skews training toward short responses; withholding and pacing do not). Its
responses are not answers (eos ignored): accuracy is not its figure.

`--quick` is a smoke run (a 10-step SFT checkpoint, one seed, 3 steps of 4 prompts, one contention timing): its
figures are not the bench's.

    .venv/bin/python bench/rollout.py [--quick] [--steps 12] [--seeds 0 1 2] [--run-dir runs/bench_rollout]
                                      [--sft-checkpoint PATH] [--fresh] [--no-trim-padding] [--probe-every-syncs N]
                                      [--no-pin] [--long-traces]
                                      [--json /tmp/rollout.json]
                                      [--check]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import shutil
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
# Ray starts its workers at niceness 15; the driver polls the engine and scores the rewards at 0. One priority.
os.environ.setdefault("RAY_worker_niceness", "0")

import psutil
import torch

from common import finish, local_ray, parser as common_parser

from baton.distributed.worker import pin_to_cores
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import SamplingConfig
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.pipelines.run_dir import checkpoint_path, list_checkpoints
from baton.pipelines.sft import SFTPipeline
from baton.recipes.demo import DemoConfig, from_checkpoint
from baton.recipes.rollout_demo import rlvr_default
from baton.rollout.config import STALE_POLICIES, RolloutSystemConfig
from baton.rollout.functions import generate_sample
from baton.tracking import read_metrics

MODES = ("sync", "one_step_off", "async", "one_step_off_deterministic", "async_deterministic")
OVERLAPPED = MODES[1:]
LONG_TRACE_MODES = ("sync", "async", "async_withhold", "async_pace")
NUM_RAY_CPUS = 2
TRAINER_CORES, ENGINE_CORES = [0], [1]  # the driver's threads go on the engine's core

SFT_STEPS, SFT_STEPS_QUICK = 1500, 10  # the demo's SFT stage (about 2 minutes on two idle cores; 56.5% held-out accuracy)
NUM_STEPS, NUM_STEPS_QUICK = 30, 3
NUM_WARMUP_STEPS = 1
NUM_PROMPTS_PER_STEP, NUM_PROMPTS_PER_STEP_QUICK = 64, 4  # --quick: a smoke run, its figures are not the bench's
SEEDS, SEEDS_QUICK = [0, 1, 2], [0]
CONTENTION_REPS, CONTENTION_REPS_QUICK = 7, 1
SAMPLES_PER_PROMPT = 16
MAX_NEW_TOKENS = 8
MAX_STALENESS = 1
MAX_STALENESS_DETERMINISTIC_ASYNC = 2  # two steps' rollouts ahead of training (with 1, it is one_step_off's schedule)
NUM_PPO_EPOCHS = 1
NUM_MINI_BATCHES_PER_STEP = 1
MICRO_BATCH_SIZE = 128
LR = 1e-4
POLL_S = 0.02  # how long one poll of the engine collects results (rollout_system.poll_s)

LONG_TRACE_MIN_TOKENS = 4  # --long-traces: each sample's budget is 1 to 10 times this
LONG_TRACE_NUM_PROMPTS_PER_STEP, LONG_TRACE_SAMPLES_PER_PROMPT = 16, 8

TARGET_SPEEDUP = 1.3  # sync s/step ÷ mode s/step
TARGET_ACCURACY_POINTS = 3.0  # |mode accuracy − sync accuracy|
TARGET_STEP_OVER_MAX = 1.15  # mode s/step ÷ max(sync gen, sync train)
TARGET_GEN_SHARE = (0.35, 0.65)  # of a sync step


def sft_checkpoint(run_dir: str, fresh: bool, num_steps: int) -> str:
    """The demo's SFT stage (its config, `num_steps` steps), trained once in this process and reused."""
    demo = DemoConfig(run_dir=os.path.join(run_dir, f"sft_{num_steps}"), overwrite=True)
    config = demo.stage("sft")
    sft_dir = config.trainer.run_dir
    final = os.path.join(checkpoint_path(sft_dir, num_steps), "actor")
    if fresh:
        shutil.rmtree(sft_dir, ignore_errors=True)
    if os.path.isdir(final):
        print(f"SFT checkpoint: reusing {final} (--fresh to redo it)")
        return os.path.abspath(final)
    print(f"SFT stage: the demo's, {num_steps} steps, in this process ...", flush=True)
    trainer = dataclasses.replace(config.trainer, num_steps=num_steps, val_every_steps=num_steps, val_before_train=False,
                                  save_every_steps=num_steps, keep_last_checkpoints=1, backend="local", progress_bar=False)
    run_pipeline(SFTPipeline, dataclasses.replace(config, trainer=trainer))
    assert list_checkpoints(sft_dir)[-1].endswith(f"step_{num_steps}")
    return os.path.abspath(final)


async def long_trace_sample(args, sample, params):
    """(--long-traces, the rollout system's generate function) One sample's response of `LONG_TRACE_MIN_TOKENS` × 1 to
    10 tokens (by its seed), eos ignored."""
    budget = LONG_TRACE_MIN_TOKENS * (1 + (sample.seed or 0) % 10)
    return await generate_sample(args, sample, dataclasses.replace(params, max_new_tokens=budget, stop_token_ids=()))


def grpo_config(mode: str, checkpoint: str, run_dir: str, num_steps: int, num_prompts_per_step: int,
                seed: int, trim_padding: bool = True, probe_every_syncs: int = 1, pin: bool = True,
                long_traces: bool = False) -> RolloutRLVRConfig:
    """The demo's GRPO stage on the rollout system in `mode`, from `checkpoint`, with the bench's batch and update."""
    base = rlvr_default()
    trainer = dataclasses.replace(
        base.trainer, num_steps=num_steps, num_prompts_per_step=num_prompts_per_step, val_every_steps=num_steps,
        val_before_train=mode == "sync", save_every_steps=num_steps, keep_last_checkpoints=1, seed=seed,
        run_dir=run_dir, overwrite=True, backend="ray", num_cpus=NUM_RAY_CPUS, progress_bar=False)
    actor, rollout = from_checkpoint(base.actor, checkpoint), from_checkpoint(base.rollout, checkpoint)
    actor = dataclasses.replace(actor, device_mapping=[0], num_threads_per_worker=1,
                                cpu_cores=TRAINER_CORES if pin else None, strategy=dataclasses.replace(
        actor.strategy, seed=seed, micro_batch_size_per_worker=MICRO_BATCH_SIZE, trim_padding=trim_padding,
        optimizer=dataclasses.replace(actor.strategy.optimizer, lr=LR)))
    rollout = dataclasses.replace(rollout, world_size=1, device_mapping=[1], num_threads_per_worker=1,
                                  cpu_cores=ENGINE_CORES if pin else None,
                                  strategy=dataclasses.replace(rollout.strategy, seed=seed))
    algorithm = dataclasses.replace(base.algorithm, num_ppo_epochs=NUM_PPO_EPOCHS,
                                    num_mini_batches_per_step=NUM_MINI_BATCHES_PER_STEP)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, num_samples_per_prompt=SAMPLES_PER_PROMPT)
    system = rollout_system(mode, probe_every_syncs)
    if long_traces:
        sampling = dataclasses.replace(sampling, max_new_tokens=10 * LONG_TRACE_MIN_TOKENS,
                                       num_samples_per_prompt=LONG_TRACE_SAMPLES_PER_PROMPT)
        system = dataclasses.replace(system, generate_function="rollout:long_trace_sample", partial_rollout=True)
    return dataclasses.replace(base, actor=actor, rollout=rollout, data=DemoConfig().data, trainer=trainer,
                               algorithm=algorithm, sampling=sampling, rollout_system=system)


def rollout_system(mode: str, probe_every_syncs: int) -> RolloutSystemConfig:
    """A bench mode's settings: "<mode>" free-running, "<mode>_deterministic" in deterministic mode, "async_<policy>"
    free-running with that stale policy."""
    deterministic = mode.endswith("_deterministic")
    mode, policy = mode.removesuffix("_deterministic"), "drop"
    for name in STALE_POLICIES:
        if mode.endswith(f"_{name}"):
            mode, policy = mode.removesuffix(f"_{name}"), name
    staleness = MAX_STALENESS_DETERMINISTIC_ASYNC if deterministic and mode == "async" else MAX_STALENESS
    return RolloutSystemConfig(mode=mode, max_staleness=staleness, deterministic=deterministic, poll_s=POLL_S,
                               probe_every_syncs=probe_every_syncs, stale_policy=policy)


class CpuMeter:
    """CPU seconds used by this process and every Ray worker process (`ray::…`), and the steps written to a
    metrics file, sampled every `interval_s` in a thread: the CPU work a step takes, wherever it runs."""

    def __init__(self, metrics_path: str, interval_s: float = 0.25):
        self.metrics_path, self.interval_s = metrics_path, interval_s
        self.samples: list[tuple[int, float]] = []  # (steps written, CPU seconds so far)
        self._processes: list[psutil.Process] = []
        self._listed_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> "CpuMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append((self._steps_written(), self._cpu_s()))

    def _steps_written(self) -> int:
        try:
            with open(self.metrics_path, "rb") as f:
                return sum(b'"timing_s/step"' in line for line in f)
        except OSError:
            return 0

    def _cpu_s(self) -> float:
        """The processes are listed once a second (a full listing every sample cost the engine's core ~18 ms a step);
        each sample reads only theirs."""
        now = time.monotonic()
        if now >= self._listed_at + 1.0:
            self._listed_at = now
            self._processes = [p for p in psutil.process_iter(["pid", "cmdline"])
                               if p.info["pid"] == os.getpid() or (p.info["cmdline"] or [""])[0].startswith("ray::")]
        total = 0.0
        for process in self._processes:
            with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
                times = process.cpu_times()
                total += times.user + times.system
        return total

    def cpu_s_per_step(self, first_step: int, last_step: int) -> float | None:
        """CPU seconds per step over steps first_step+1 … last_step (from the first sample that saw first_step
        written to the first that saw last_step); None when the samples don't span them."""
        start = next((cpu for steps, cpu in self.samples if steps >= first_step), None)
        end = next((cpu for steps, cpu in self.samples if steps >= last_step), None)
        if start is None or end is None or last_step <= first_step:
            return None
        return (end - start) / (last_step - first_step)


def run_mode(mode: str, checkpoint: str, run_dir: str, num_steps: int, num_prompts_per_step: int, seed: int,
             trim_padding: bool = True, probe_every_syncs: int = 1, pin: bool = True, long_traces: bool = False) -> dict:
    """One GRPO run; its step split (medians over the steps after the warm-up), the CPU seconds a step used (all
    processes), accuracies, wall time, and what the stale policy did."""
    start = time.perf_counter()
    config = grpo_config(mode, checkpoint, run_dir, num_steps, num_prompts_per_step, seed, trim_padding,
                         probe_every_syncs, pin, long_traces)
    with contextlib.suppress(FileNotFoundError):  # the meter counts this run's steps only (overwrite=True)
        os.remove(os.path.join(run_dir, "metrics.jsonl"))
    with CpuMeter(os.path.join(run_dir, "metrics.jsonl")) as meter:
        summary = run_pipeline(RolloutRLVRPipeline, config)
    wall_s = time.perf_counter() - start
    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "timing_s/step" in r]
    timed = records[NUM_WARMUP_STEPS:]
    step_s = statistics.median(r["timing_s/step"] for r in timed)
    gen_s = statistics.median(r["timing_s/gen"] for r in timed)
    # The last step also validates and saves: its CPU is left out.
    return {"mode": mode, "seed": seed, "step_s": step_s, "gen_s": gen_s, "train_s": step_s - gen_s,
            "cpu_s_per_step": meter.cpu_s_per_step(NUM_WARMUP_STEPS, num_steps - 1),
            "start_accuracy": summary["start_val_accuracy"], "accuracy": summary["final_val_accuracy"],
            "final_reward": summary.get("final_reward"), "wall_s": wall_s,
            "step_times_s": [r["timing_s/step"] for r in records], "gen_times_s": [r["timing_s/gen"] for r in records],
            "stale_groups_per_step": statistics.mean(r.get("rollout/num_dropped/stale", 0.0) for r in records),
            "withheld_tokens": records[-1].get("rollout/staleness/withheld_tokens", 0.0),
            "restarted_samples": records[-1].get("rollout/staleness/restarted_samples", 0.0),
            "staleness_max": max(r["rollout/staleness/max"] for r in records),
            "response_length": statistics.mean(r["response_length/mean"] for r in records),
            "stages_s": {k.removeprefix("timing_s/"): statistics.median(r.get(k, 0.0) for r in timed)
                         for k in records[0] if k.startswith("timing_s/")}}


# A process that keeps one torch thread busy with matmuls on the given core until killed; it moves there before it
# imports torch and says "ready" once it computes.
_COMPETITOR = ("import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nimport torch\ntorch.set_num_threads(1)\n"
               "a = torch.randn(256, 256)\na @ a\nprint('ready', flush=True)\nwhile True:\n    a @ a")


def core_contention(core: int, other_core: int, num_reps: int) -> float:
    """How many times longer a one-thread torch forward and backward takes on `core` while another process runs torch
    matmuls on `other_core` than while that core idles: medians of `num_reps` timings each, alternated. On a machine
    whose cores share their vector units or memory path, the trainer runs this much slower while an engine
    generates beside it, so an overlapped step cannot reach the sync run's max(gen, train)."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 256), torch.randn(256, 256, requires_grad=True)

    def work_s() -> float:
        start = time.perf_counter()
        for _ in range(300):
            (x @ w).tanh().sum().backward()
        return time.perf_counter() - start

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        work_s()  # warm-up
        alone, beside = [], []
        for _ in range(num_reps):
            alone.append(work_s())
            competitor = subprocess.Popen([sys.executable, "-c", _COMPETITOR, str(other_core)], stdout=subprocess.PIPE)
            try:
                ready, _, _ = select.select([competitor.stdout], [], [], 60.0)
                if not ready or competitor.stdout.readline().strip() != b"ready":
                    raise RuntimeError("the core-contention competitor did not start computing within 60 s")
                beside.append(work_s())
            finally:
                competitor.kill()
                competitor.wait(timeout=10)
    finally:
        os.sched_setaffinity(0, before)
    return statistics.median(beside) / statistics.median(alone)


def long_trace_figures(runs: list[dict], num_steps: int, num_prompts_per_step: int, seeds: list[int]) -> dict:
    """--long-traces: per mode its median s/step and speed-up over sync, and what its stale policy did (medians over
    seeds); printed as a table."""
    per_mode = {}
    for mode in LONG_TRACE_MODES:
        mine = [r for r in runs if r["mode"] == mode]
        per_mode[mode] = {key: statistics.median(r[key] for r in mine) for key in (
            "step_s", "gen_s", "stale_groups_per_step", "withheld_tokens", "restarted_samples", "response_length")}
        per_mode[mode]["staleness_max"] = max(r["staleness_max"] for r in mine)
    sync = per_mode["sync"]
    print(f"\n{'mode':>16}  {'s/step':>7}  {'speedup':>7}  {'gen s':>6}  {'stale groups/step':>17}  {'withheld tok':>12}  "
          f"{'restarted':>9}  {'resp len':>8}  {'vs sync':>7}  {'max stale':>9}")
    for mode, m in per_mode.items():
        m["speedup"], m["length_over_sync"] = sync["step_s"] / m["step_s"], m["response_length"] / sync["response_length"]
        print(f"{mode:>16}  {m['step_s']:>7.2f}  {m['speedup']:>6.2f}×  {m['gen_s']:>6.2f}  {m['stale_groups_per_step']:>17.2f}  "
              f"{m['withheld_tokens']:>12.0f}  {m['restarted_samples']:>9.0f}  {m['response_length']:>8.1f}  "
              f"{m['length_over_sync']:>6.2f}×  {m['staleness_max']:>9.0f}")
    print(f"(medians over steps {NUM_WARMUP_STEPS + 1}–{num_steps} and over seeds {seeds}; stale groups/step: sent back "
          "by the drop policy; withheld tok, restarted: the whole run's; resp len: the trained responses' mean length)")
    return {"modes": per_mode, "runs": runs, "num_steps": num_steps, "num_prompts_per_step": num_prompts_per_step,
            "samples_per_prompt": LONG_TRACE_SAMPLES_PER_PROMPT, "min_tokens": LONG_TRACE_MIN_TOKENS,
            "max_staleness": MAX_STALENESS, "seeds": seeds,
            "passed": {"bound_kept": all(m["staleness_max"] <= MAX_STALENESS for m in per_mode.values()),
                       "withhold_and_pace_send_none_back": all(per_mode[mode]["stale_groups_per_step"] == 0
                                                               for mode in ("async_withhold", "async_pace"))}}


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()


def main() -> int:
    parser = common_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help=f"GRPO steps per mode (default {NUM_STEPS}; "
                                                                 f"--quick {NUM_STEPS_QUICK})")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help=f"one run per mode and seed (default {SEEDS}: each mode once in each place of the order; "
                             f"{SEEDS_QUICK} with --quick)")
    parser.add_argument("--run-dir", default="runs/bench_rollout")
    parser.add_argument("--sft-checkpoint", metavar="PATH", help="an HF checkpoint directory to start GRPO from")
    parser.add_argument("--sft-steps", type=int, help=f"SFT steps (default {SFT_STEPS}; {SFT_STEPS_QUICK} with --quick)")
    parser.add_argument("--fresh", action="store_true", help="train the SFT checkpoint again")
    parser.add_argument("--no-trim-padding", dest="trim_padding", action="store_false",
                        help="the actor's micro-batches keep their all-padding columns (strategy.trim_padding off)")
    parser.add_argument("--probe-every-syncs", type=int, default=1, metavar="N",
                        help="rollout_system.probe_every_syncs: check the weight sync on the first and every N-th "
                             "sync (default 1, every sync, as the library's default)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the trainer, the engine and the driver wherever the OS puts them")
    parser.add_argument("--long-traces", action="store_true",
                        help="responses 1 to 10 times LONG_TRACE_MIN_TOKENS long, eos ignored; sync and async under "
                             "each stale policy")
    args = parser.parse_args()
    num_steps = args.steps or (NUM_STEPS_QUICK if args.quick else NUM_STEPS)
    num_prompts_per_step = NUM_PROMPTS_PER_STEP_QUICK if args.quick else \
        LONG_TRACE_NUM_PROMPTS_PER_STEP if args.long_traces else NUM_PROMPTS_PER_STEP
    modes = LONG_TRACE_MODES if args.long_traces else MODES
    samples_per_prompt, max_new_tokens = (LONG_TRACE_SAMPLES_PER_PROMPT, 10 * LONG_TRACE_MIN_TOKENS) \
        if args.long_traces else (SAMPLES_PER_PROMPT, MAX_NEW_TOKENS)
    args.seeds = args.seeds or (SEEDS_QUICK if args.quick else SEEDS)
    sft_steps = args.sft_steps or (SFT_STEPS_QUICK if args.quick else SFT_STEPS)
    if num_steps <= NUM_WARMUP_STEPS:
        parser.error(f"--steps must be > {NUM_WARMUP_STEPS} (the first steps are a warm-up)")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(NUM_RAY_CPUS)  # the SFT stage runs here, alone
    load_start = load_average()
    checkpoint = os.path.abspath(args.sft_checkpoint) if args.sft_checkpoint else \
        sft_checkpoint(args.run_dir, args.fresh, sft_steps)
    torch.set_num_threads(1)  # the driver of the GRPO runs stays light
    contention = core_contention(TRAINER_CORES[0], ENGINE_CORES[0], CONTENTION_REPS_QUICK if args.quick else
                                 CONTENTION_REPS) if args.pin else None
    print(f"GRPO from {checkpoint}: {num_steps} steps × {num_prompts_per_step} prompts × {samples_per_prompt} samples "
          f"(≤ {max_new_tokens} tokens) per mode, seeds {args.seeds}; actor and engine in separate Ray workers, "
          f"1 torch thread each, {NUM_RAY_CPUS} Ray CPUs, {os.cpu_count()} cores"
          f"{f' (actor on core {TRAINER_CORES}, engine and driver on {ENGINE_CORES})' if args.pin else ', unpinned'}; "
          f"load average {load_start}", flush=True)
    runs = []
    if args.pin:  # the driver, and the Ray processes it starts (they inherit it); the actor's worker moves to its own
        pin_to_cores(ENGINE_CORES)
    with local_ray(NUM_RAY_CPUS):
        for index, seed in enumerate(args.seeds):
            # Each seed runs the modes in another order (rotated by one), so that no mode always has the same
            # place in the hour: this machine's speed drifts by up to a third from one minute to the next.
            for mode in modes[index % len(modes):] + modes[:index % len(modes)]:
                run = run_mode(mode, checkpoint, os.path.join(args.run_dir, f"seed_{seed}", mode), num_steps,
                               num_prompts_per_step, seed, args.trim_padding, args.probe_every_syncs, args.pin,
                               args.long_traces)
                runs.append(run)
                print(f"  seed {seed} {mode:>26}: {run['step_s']:.2f} s/step, accuracy {run['accuracy']:.1%}, "
                      f"{run['wall_s']:.0f} s, load average {load_average()}", flush=True)
    load_end = load_average()
    if args.long_traces:
        figures = long_trace_figures(runs, num_steps, num_prompts_per_step, args.seeds)
        figures.update(quick=args.quick, checkpoint=checkpoint, pinned=args.pin, num_cpus=os.cpu_count(),
                       core_contention=contention, load_average_start=load_start, load_average_end=load_end)
        return finish(figures, args.json, args.check)

    def median_of(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    sync_step_s, sync_gen_s = median_of("sync", "step_s"), median_of("sync", "gen_s")
    sync_train_s = sync_step_s - sync_gen_s
    bound_s = max(sync_gen_s, sync_train_s)
    ideal_efficiency = (sync_gen_s + sync_train_s) / bound_s
    sync_runs = {r["seed"]: r for r in runs if r["mode"] == "sync"}

    def over_own_seeds_bound(run: dict) -> float:
        """A run's step over max(gen, train) of the same seed's sync run (minutes apart, not the medians')."""
        sync = sync_runs[run["seed"]]
        return run["step_s"] / max(sync["gen_s"], sync["train_s"])

    per_mode = {}
    for mode in MODES:
        step_s = median_of(mode, "step_s")
        accuracies = [r["accuracy"] for r in runs if r["mode"] == mode]
        cpu_s = [r["cpu_s_per_step"] for r in runs if r["mode"] == mode and r["cpu_s_per_step"] is not None]
        cpu_s_per_step = statistics.median(cpu_s) if cpu_s else None
        cpu_floor_s = cpu_s_per_step / os.cpu_count() if cpu_s else None
        per_mode[mode] = {"step_s": step_s, "gen_s": median_of(mode, "gen_s"), "train_s": step_s - median_of(mode, "gen_s"),
                          "cpu_s_per_step": cpu_s_per_step, "cpu_floor_s": cpu_floor_s,
                          "step_over_cpu_floor": step_s / cpu_floor_s if cpu_floor_s else None,
                          "speedup": sync_step_s / step_s, "accuracy": statistics.median(accuracies),
                          "accuracy_min": min(accuracies), "accuracy_max": max(accuracies),
                          "overlap_efficiency": (sync_gen_s + sync_train_s) / step_s, "step_over_bound": step_s / bound_s,
                          "train_over_sync_train": (step_s - median_of(mode, "gen_s")) / sync_train_s,
                          "step_over_bound_per_seed": [over_own_seeds_bound(r) for r in runs if r["mode"] == mode]}
    start_accuracy = statistics.median(r["start_accuracy"] for r in runs if r["mode"] == "sync")

    print(f"\nSFT checkpoint accuracy {start_accuracy:.1%}; sync step: gen {sync_gen_s:.2f} s "
          f"({sync_gen_s / sync_step_s:.0%}), train {sync_train_s:.2f} s ({sync_train_s / sync_step_s:.0%}); "
          f"max(gen, train) {bound_s:.2f} s; ideal overlap efficiency {ideal_efficiency:.2f}")
    if contention is not None:
        print(f"core contention: a torch forward/backward on core {TRAINER_CORES[0]} takes {contention:.2f}× as long while "
              f"another process runs torch on core {ENGINE_CORES[0]} (the engine's) as while that core idles")
    print(f"{'mode':>26}  {'s/step':>7}  {'speedup':>7}  {'gen s':>6}  {'train s':>7}  {'(gen+train)/step':>16}  "
          f"{'step/max':>8}  {'CPU s':>6}  {'floor s':>7}  {'accuracy':>9}")
    for mode, m in per_mode.items():
        spread = f" ({m['accuracy_min']:.0%}–{m['accuracy_max']:.0%})" if len(args.seeds) > 1 else ""
        print(f"{mode:>26}  {m['step_s']:>7.2f}  {m['speedup']:>6.2f}×  {m['gen_s']:>6.2f}  {m['train_s']:>7.2f}  "
              f"{m['overlap_efficiency']:>16.2f}  {m['step_over_bound']:>7.2f}×  {m['cpu_s_per_step'] or 0:>6.2f}  "
              f"{m['cpu_floor_s'] or 0:>7.2f}  {m['accuracy']:>9.1%}{spread}")
    print("train over sync train (the trainer's critical path, slowed beside generation): " + "; ".join(
        f"{mode} {per_mode[mode]['train_over_sync_train']:.2f}×" for mode in OVERLAPPED))
    if len(args.seeds) > 1:
        print("step/max per seed, against that seed's sync run: " + "; ".join(
            f"{mode} " + " ".join(f"{ratio:.2f}×" for ratio in per_mode[mode]["step_over_bound_per_seed"])
            for mode in OVERLAPPED))
    print(f"(medians over steps {NUM_WARMUP_STEPS + 1}–{num_steps}"
          f"{' and over seeds' if len(args.seeds) > 1 else ', one seed'}; gen, train: the wait for samples and the "
          f"rest of the step; CPU s: the CPU seconds a step used in the driver and every Ray worker, floor s: that over "
          f"the {os.cpu_count()} cores, the shortest step this machine can run that work in, overlapped or not; load "
          f"average at start {load_start}, at end {load_end})")

    best = max(OVERLAPPED, key=lambda mode: per_mode[mode]["overlap_efficiency"])
    figures = {
        "one_step_off_speedup": per_mode["one_step_off"]["speedup"], "async_speedup": per_mode["async"]["speedup"],
        "sync_accuracy": per_mode["sync"]["accuracy"], "one_step_off_accuracy": per_mode["one_step_off"]["accuracy"],
        "async_accuracy": per_mode["async"]["accuracy"], "start_accuracy": start_accuracy,
        "deterministic_one_step_off_speedup": per_mode["one_step_off_deterministic"]["speedup"],
        "deterministic_async_speedup": per_mode["async_deterministic"]["speedup"],
        "overlap_efficiency": per_mode[best]["overlap_efficiency"], "overlap_efficiency_mode": best,
        "ideal_overlap_efficiency": ideal_efficiency, "sync_gen_share": sync_gen_s / sync_step_s,
        "sync_gen_s": sync_gen_s, "sync_train_s": sync_train_s, "modes": per_mode,
        "num_steps": num_steps, "num_prompts_per_step": num_prompts_per_step, "samples_per_prompt": SAMPLES_PER_PROMPT,
        "max_new_tokens": MAX_NEW_TOKENS, "max_staleness": MAX_STALENESS,
        "max_staleness_deterministic_async": MAX_STALENESS_DETERMINISTIC_ASYNC, "seeds": args.seeds, "quick": args.quick,
        "trim_padding": args.trim_padding, "probe_every_syncs": args.probe_every_syncs, "pinned": args.pin,
        "checkpoint": checkpoint, "num_cpus": os.cpu_count(), "core_contention": contention, "load_average_start": load_start,
        "load_average_end": load_end, "runs": runs,
    }
    low, high = TARGET_GEN_SHARE
    figures["passed"] = {
        "sync_gen_share": low <= figures["sync_gen_share"] <= high,
        **{f"{mode}_speedup": per_mode[mode]["speedup"] >= TARGET_SPEEDUP for mode in OVERLAPPED},
        **{f"{mode}_accuracy": 100 * abs(per_mode[mode]["accuracy"] - per_mode["sync"]["accuracy"]) <= TARGET_ACCURACY_POINTS
           for mode in OVERLAPPED},
        **{f"{mode}_step_over_bound": per_mode[mode]["step_over_bound"] <= TARGET_STEP_OVER_MAX
           for mode in OVERLAPPED},
    }
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
