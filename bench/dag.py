"""RLVR as a workflow graph (`DAGPipeline`) against the fixed loop (`RLVRPipeline`): what the graph costs a step.

Every run is tiny-qwen2 on the arithmetic task, `SAMPLES_PER_PROMPT` samples of ≤ `MAX_NEW_TOKENS` tokens per prompt,
on a local Ray instance with one torch thread per worker; the actor and the rollout engine are colocated (one
process on device slot 0, as the demo runs them: `colocate_actor_rollout: true`); the reward worker and the DAG's
compute worker are CPU-only workers of `AUX_WORKER_CPUS` Ray CPUs each. Same seed, same config on both sides.
`NUM_PROMPTS` prompts per step (64, the batch of the shipped DAG GRPO workflow, examples/dag_grpo.yaml); at 16
(`--num-prompts 16`) a step is ~0.14 s, and each COMPUTE node's fixed cost (a Ray call from the driver to its
worker, ~4 ms beyond the worker's own fetch and compute) is a larger share of it.

  step time (single controller): GRPO as a DAG on the single-controller executor vs `RLVRPipeline`, runs
      interleaved (DAG, loop, loop, DAG, …) so that background load hits both, `NUM_RAY_CPUS` Ray CPUs.
      `single_controller_ratio` = DAG median s/step ÷ loop median s/step (`timing_s/step`, every run's steps
      after the first `NUM_WARMUP_STEPS` pooled); target ≤ 1.05.
  multi-controller executor (`dag.executor: multi_controller`): the same ratio against the loop
      (`multi_controller_ratio`), and the driver's peak RSS: each executor runs at `RSS_PROMPTS` prompts per step
      and at 8× that, each run in a fresh subprocess of this script (`--child`) so that no run's peak carries into
      the next; a thread samples the whole driver process's RSS every `RSS_POLL_S` through the run.
      `driver_rss_growth` = peak RSS at 8× ÷ peak RSS at 1×; target ≤ 1.10. The single-controller executor's
      same ratio (`single_controller_rss_growth`) is printed beside it for comparison. Where the multi-controller
      executor is not built (`DAGConfig.check()` refuses the executor), its figures are left out of the JSON and
      reported as missing, not passed.
  parallel branches: the PPO workflow of examples/dag_ppo.yaml (critic_train and actor_train both depend on the
      advantage only), actor (with the rollout) on slot 0, reference on slot 1, critic on slot 2, on
      `PPO_RAY_CPUS` Ray CPUs (Ray reserves a CPU per device slot; the cores are still this machine's).
      Per step, from the executor's (node, start/end, time) events: the span from the earlier start to the
      later end of the two updates ÷ the longer of their two durations; `parallel_branch_ratio` is its median
      over the steps after the warm-up; 1.0 is full overlap, 2.0 none (for equal updates); target ≤ 1.15.

--quick is a smoke run (fewer steps and prompts, one run per side, the driver RSS of the executor the target is about
only: the multi-controller's where it is built); its figures are not the bench's.

    .venv/bin/python bench/dag.py [--quick] [--repeats 2] [--num-prompts 64] [--json /tmp/dag_bench.json] [--check]
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
os.environ.setdefault("RAY_worker_niceness", "0")  # workers at the driver's priority (Ray's default is 15)
os.environ["OMP_NUM_THREADS"] = "1"

import psutil
import torch

from common import finish, local_ray, parser as common_parser

from baton.cli import resolve
from baton.config import ConfigError
from baton.pipelines.config import AlgorithmConfig, DataConfig, RLVRConfig, RewardSettings, RoleConfig, \
    SamplingConfig, TrainerConfig
from baton.pipelines.dag import DAGConfig, DAGPipeline, DAGSettings
from baton.pipelines.rlvr import RLVRPipeline
from baton.strategy import StrategyConfig
from baton.tracking import read_metrics

NUM_RAY_CPUS = 2
PPO_RAY_CPUS = 4
AUX_WORKER_CPUS = 0.25
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 6
NUM_WARMUP_STEPS = 1
NUM_PROMPTS, NUM_PROMPTS_QUICK = 64, 4  # the shipped DAG GRPO workflow's batch (examples/dag_grpo.yaml)
NUM_STEPS, NUM_STEPS_QUICK = 12, 3
RSS_PROMPTS, RSS_PROMPTS_QUICK = 8, 2
RSS_STEPS, RSS_STEPS_QUICK = 4, 2
RSS_POLL_S = 0.02
SEED = 0
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

TARGET_STEP_RATIO = 1.05
TARGET_RSS_GROWTH = 1.10
TARGET_BRANCH_RATIO = 1.15


def config(cls, run_dir: str, num_prompts: int, num_steps: int, executor: str = "single_controller", **fields):
    """The bench's tiny RLVR setting as `cls` (RLVRConfig or DAGConfig), actor and rollout colocated on slot 0."""
    role = RoleConfig(device_mapping=[0], num_threads_per_worker=1, strategy=StrategyConfig(model="tiny-qwen2", seed=SEED))
    trainer = TrainerConfig(backend="ray", run_dir=run_dir, overwrite=True, num_prompts_per_step=num_prompts,
                            num_steps=num_steps, val_every_steps=num_steps, val_before_train=False,
                            save_every_steps=num_steps, keep_last_checkpoints=1, seed=SEED, progress_bar=False)
    if cls is DAGConfig:
        fields.setdefault("dag", DAGSettings(executor=executor))
    return cls(actor=role, rollout=role, colocate_actor_rollout=True,
               reward=RewardSettings(world_size=1, num_devices_per_worker=0, num_cpus_per_worker=AUX_WORKER_CPUS),
               data=DataConfig(max_operand=9, num_val_examples=8, seed=SEED),
               sampling=SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, num_samples_per_prompt=SAMPLES_PER_PROMPT),
               val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, num_samples_per_prompt=1),
               trainer=trainer, **fields)


class RecordingDAGPipeline(DAGPipeline):
    """DAGPipeline keeping each step's executor events (the executor clears them at every step)."""

    def __init__(self, config: DAGConfig):
        super().__init__(config)
        self.step_events: list[list[tuple[str, str, float]]] = []
        run_step = self.executor.run_step

        def recorded(step: int) -> dict:
            metrics = run_step(step)
            self.step_events.append(list(self.executor.events))
            return metrics

        self.executor.run_step = recorded


def run(pipeline_cls, cfg):
    """(pipeline, its per-step `timing_s/step`), shutting its clusters down however it ends."""
    pipeline = pipeline_cls(cfg)
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    records = read_metrics(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"))
    return pipeline, [r["timing_s/step"] for r in records if "timing_s/step" in r]


def multi_controller_built(run_dir: str) -> bool:
    try:
        config(DAGConfig, run_dir, 1, 1, executor="multi_controller").check()
    except ConfigError as error:
        if "executor" in str(error):
            return False
        raise
    return True


def step_times(run_dir: str, num_prompts: int, num_steps: int, repeats: int, executors: list[str]) -> dict:
    """name → pooled s/step after the warm-up, the loop and each DAG executor's runs interleaved in alternating order."""
    sides = ["loop", *executors]
    times: dict[str, list[float]] = {side: [] for side in sides}
    with local_ray(NUM_RAY_CPUS):
        for repeat in range(repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                path = os.path.join(run_dir, f"{side}_{repeat}")
                cfg = config(RLVRConfig, path, num_prompts, num_steps) if side == "loop" else \
                    config(DAGConfig, path, num_prompts, num_steps, executor=side)
                _, per_step = run(RLVRPipeline if side == "loop" else DAGPipeline, cfg)
                times[side] += per_step[NUM_WARMUP_STEPS:]
                print(f"  repeat {repeat} {side:>17}: {statistics.median(per_step[NUM_WARMUP_STEPS:]):.3f} s/step",
                      flush=True)
    return times


def child(executor: str, num_prompts: int, num_steps: int, run_dir: str) -> None:
    """One DAG run in this fresh process; prints the driver's RSS (baseline before the pipeline, peak during) as JSON."""
    process, peak, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not stop.wait(RSS_POLL_S):
            peak[0] = max(peak[0], process.memory_info().rss)

    torch.set_num_threads(1)
    with local_ray(NUM_RAY_CPUS):
        baseline = process.memory_info().rss
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            run(DAGPipeline, config(DAGConfig, run_dir, num_prompts, num_steps, executor=executor))
        finally:
            stop.set()
            sampler.join()
    print("RSS " + json.dumps({"baseline": baseline, "peak": max(peak[0], baseline)}), flush=True)


def driver_rss(executor: str, num_prompts: int, num_steps: int, run_dir: str) -> dict:
    path = os.path.join(run_dir, f"rss_{executor}_{num_prompts}")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", executor, str(num_prompts),
                          str(num_steps), path], capture_output=True, text=True, check=False)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RSS ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"--child {executor} {num_prompts} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[4:])


def parallel_branches(run_dir: str, num_prompts: int, num_steps: int) -> dict:
    """PPO as examples/dag_ppo.yaml's workflow; per step (after the warm-up) the two updates' span ÷ the longer one."""
    _, demo = resolve(os.path.join(EXAMPLES, "dag_ppo.yaml"), [])
    on_slot = lambda slot, **strategy: RoleConfig(device_mapping=[slot], num_threads_per_worker=1, strategy=StrategyConfig(
        model="tiny-qwen2", seed=SEED, **strategy))
    cfg = config(DAGConfig, run_dir, num_prompts, num_steps, workflow=demo.rlvr.workflow,
                 reference=on_slot(1), critic=on_slot(2, kind="value"),
                 algorithm=AlgorithmConfig(adv_estimator="gae", use_kl_loss=True))
    cfg.dag.compute = dataclasses.replace(cfg.dag.compute, num_cpus_per_worker=AUX_WORKER_CPUS)
    with local_ray(PPO_RAY_CPUS):
        pipeline, _ = run(RecordingDAGPipeline, cfg)
    steps = []
    for events in pipeline.step_events[NUM_WARMUP_STEPS:]:
        span = {node: (min(t for n, k, t in events if n == node and k == "start"),
                       max(t for n, k, t in events if n == node and k == "end")) for node in ("critic_train", "actor_train")}
        durations = {node: end - start for node, (start, end) in span.items()}
        both_s = max(end for _, end in span.values()) - min(start for start, _ in span.values())
        steps.append({**durations, "both": both_s, "ratio": both_s / max(durations.values())})
    return {key: statistics.median(s[key] for s in steps) for key in ("critic_train", "actor_train", "both", "ratio")}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        executor, num_prompts, num_steps, run_dir = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        child(executor, num_prompts, num_steps, run_dir)
        return 0
    parser = common_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, help="runs per side of the step-time comparison (default 2; 1 with --quick)")
    parser.add_argument("--run-dir", default="runs/bench_dag")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"prompts per step of the step-time and branch runs (default {NUM_PROMPTS}, the demo's GRPO batch; "
                             "at 16 the steps are ~0.14 s and the compute nodes' fixed cost shows)")
    args = parser.parse_args()
    q = args.quick
    num_prompts, num_steps = (NUM_PROMPTS_QUICK, NUM_STEPS_QUICK) if q else (NUM_PROMPTS, NUM_STEPS)
    num_prompts = args.num_prompts or num_prompts
    args.repeats = args.repeats or (1 if q else 2)
    rss_prompts, rss_steps = (RSS_PROMPTS_QUICK, RSS_STEPS_QUICK) if q else (RSS_PROMPTS, RSS_STEPS)
    torch.set_num_threads(1)
    multi = multi_controller_built(args.run_dir)
    executors = ["single_controller", "multi_controller"] if multi else ["single_controller"]
    if not multi:
        print("the multi-controller executor is not built (DAGConfig.check() refuses dag.executor: multi_controller): "
              "multi_controller_ratio and driver_rss_growth are missing")
    print(f"tiny-qwen2, {num_prompts} prompts × {SAMPLES_PER_PROMPT} samples (≤ {MAX_NEW_TOKENS} tokens), {num_steps} "
          f"steps per run, {args.repeats} run(s) per side, actor and rollout colocated; {os.cpu_count()} cores", flush=True)
    times = step_times(args.run_dir, num_prompts, num_steps, args.repeats, executors)
    step_s = {side: statistics.median(t) for side, t in times.items()}

    print(f"driver RSS: {rss_prompts} and {8 * rss_prompts} prompts per step, {rss_steps} steps, fresh processes", flush=True)
    rss_executors = executors[-1:] if q else executors  # the target's: multi_controller where built
    rss = {executor: {scale: driver_rss(executor, scale * rss_prompts, rss_steps, args.run_dir) for scale in (1, 8)}
           for executor in rss_executors}
    rss_growth = {executor: r[8]["peak"] / r[1]["peak"] for executor, r in rss.items()}

    print("parallel branches: PPO, actor/reference/critic on slots 0/1/2", flush=True)
    branches = parallel_branches(os.path.join(args.run_dir, "ppo"), num_prompts, num_steps)

    mib = 2 ** 20
    print(f"\n{'':>17}  {'s/step':>7}  {'÷ loop':>6}  {'RSS 1× MiB':>10}  {'RSS 8× MiB':>10}  {'8× ÷ 1×':>7}")
    for side in ["loop", *executors]:
        r = rss.get(side)
        rss_cols = f"{r[1]['peak'] / mib:>10.0f}  {r[8]['peak'] / mib:>10.0f}  {rss_growth[side]:>7.3f}" if r else \
            f"{'':>10}  {'':>10}  {'':>7}"
        print(f"{side:>17}  {step_s[side]:>7.3f}  {step_s[side] / step_s['loop']:>6.3f}  {rss_cols}")
    if not multi:
        print(f"{'multi_controller':>17}  not built")
    print(f"PPO updates: critic_train {branches['critic_train']:.3f} s, actor_train {branches['actor_train']:.3f} s, "
          f"both (first start → last end) {branches['both']:.3f} s; span ÷ longer {branches['ratio']:.3f}")
    print(f"(medians over steps {NUM_WARMUP_STEPS + 1}–{num_steps} of every run; RSS: the driver process's peak, "
          f"baselines " + ", ".join(f"{e} {r[1]['baseline'] / mib:.0f} MiB" for e, r in rss.items()) + ")")

    figures = {
        "single_controller_ratio": step_s["single_controller"] / step_s["loop"],
        "parallel_branch_ratio": branches["ratio"], "branches_s": branches, "step_s": step_s, "step_times_s": times,
        "driver_rss_bytes": {e: {f"{s}x": v for s, v in r.items()} for e, r in rss.items()},
        "multi_controller_built": multi, "num_prompts_per_step": num_prompts, "num_steps": num_steps,
        "samples_per_prompt": SAMPLES_PER_PROMPT, "max_new_tokens": MAX_NEW_TOKENS, "repeats": args.repeats,
        "rss_prompts_per_step": [rss_prompts, 8 * rss_prompts], "seed": SEED, "quick": q, "num_cpus": os.cpu_count(),
    }
    if "single_controller" in rss_growth:
        figures["single_controller_rss_growth"] = rss_growth["single_controller"]
    figures["passed"] = {"single_controller_ratio": figures["single_controller_ratio"] <= TARGET_STEP_RATIO,
                         "parallel_branch_ratio": branches["ratio"] <= TARGET_BRANCH_RATIO}
    if multi:
        figures["multi_controller_ratio"] = step_s["multi_controller"] / step_s["loop"]
        figures["driver_rss_growth"] = rss_growth["multi_controller"]
        figures["passed"].update(multi_controller_ratio=figures["multi_controller_ratio"] <= TARGET_STEP_RATIO,
                                 driver_rss_growth=figures["driver_rss_growth"] <= TARGET_RSS_GROWTH)
    else:
        figures["missing"] = ["multi_controller_ratio", "driver_rss_growth"]
        print("missing (multi-controller executor not built): multi_controller_ratio, driver_rss_growth")
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
