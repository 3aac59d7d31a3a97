"""The default demo (`baton run`) for several seeds: does GRPO's lift over the SFT checkpoint hold on every one?

Each seed runs as its own `baton run seed=N` process, as a user would run it (Ray start-up included in
its wall time), into `RUN_DIR/seed_N`, replacing that seed's earlier run there (`overwrite=true`). Prints
one row per seed: the SFT checkpoint's held-out accuracy, the final accuracy after GRPO, the lift in
points and the wall time; then the spread. `--threads N` gives every worker N torch threads (the
rounding of the kernels changes with it), `--quick` runs one seed (unless `--seeds` says) with a few small
steps (a smoke run: its lifts are not the demo's), extra `key=value` arguments go to every run.

    .venv/bin/python bench/demo_seeds.py [--seeds 0 1 2 3 4] [--threads 1] [--quick] [--json out.json] [--check] [key=value ...]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

from baton.tracking import read_metrics
from common import finish, parser as common_parser

SEEDS, SEEDS_QUICK = [0, 1, 2, 3, 4], [0]
QUICK = ["sft.trainer.num_steps=10", "sft.trainer.val_every_steps=5", "sft.trainer.num_prompts_per_step=16",
         "rlvr.trainer.num_steps=2", "rlvr.trainer.val_every_steps=1", "rlvr.trainer.num_prompts_per_step=4",
         "data.num_val_examples=16"]
RUN_TIMEOUT_S = 1800  # one demo run; the target is 600 s, so this only catches a hung run
TARGETS = {"min_lift_points": 15.0, "median_lift_points": 20.0, "max_wall_s": 600.0}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def run_seed(seed: int, run_dir: str, overrides: list[str]) -> dict:
    """One `baton run` of the demo; its summary, wall time and the per-validation accuracies of both stages."""
    command = [sys.executable, "-m", "baton.cli", "run", f"seed={seed}", f"run_dir={run_dir}", "overwrite=true",
               *overrides]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"seed {seed}: `{' '.join(command)}` did not finish in {RUN_TIMEOUT_S} s "
                           f"(the demo's target is {TARGETS['max_wall_s']:.0f} s); see {run_dir}") from None
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"seed {seed}: `{' '.join(command)}` exited {done.returncode}:\n{done.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    curves = {}
    for stage in ("sft", "rlvr"):
        records = read_metrics(os.path.join(run_dir, stage, "metrics.jsonl"))
        curves[stage] = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    sft_acc, final_acc = summary["start_val_accuracy"], summary["final_val_accuracy"]
    return {"seed": seed, "sft_accuracy": sft_acc, "final_accuracy": final_acc,
            "lift_points": round(100 * (final_acc - sft_acc), 2), "wall_s": round(wall_s, 1),
            "train_s": round(summary["wall_s"], 1), "val_curves": curves}


def main() -> int:
    parser = common_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", help=f"default {SEEDS}; {SEEDS_QUICK} with --quick")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: the config's)")
    parser.add_argument("--run-dir", default="runs/demo_seeds")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    args.seeds = args.seeds or (SEEDS_QUICK if args.quick else SEEDS)
    overrides = (QUICK if args.quick else []) + list(args.overrides)
    if args.threads is not None:
        overrides += [f"sft.actor.num_threads_per_worker={args.threads}", f"rlvr.actor.num_threads_per_worker={args.threads}"]
    print(f"demo × seeds {args.seeds}, overrides {overrides or 'none'}; {cpu_model()}, {os.cpu_count()} CPUs")
    print(f"{'seed':>4}  {'SFT acc':>8}  {'final acc':>9}  {'lift':>7}  {'wall':>7}")
    rows = []
    for seed in args.seeds:
        row = run_seed(seed, os.path.join(args.run_dir, f"seed_{seed}"), overrides)
        rows.append(row)
        print(f"{seed:>4}  {row['sft_accuracy']:>8.1%}  {row['final_accuracy']:>9.1%}  {row['lift_points']:>+6.1f}p  "
              f"{row['wall_s']:>6.0f}s", flush=True)
    lifts = [r["lift_points"] for r in rows]
    figures = {
        "num_seeds": len(rows), "min_lift_points": min(lifts), "median_lift_points": statistics.median(lifts),
        "max_lift_points": max(lifts), "max_wall_s": max(r["wall_s"] for r in rows),
        "median_sft_accuracy": statistics.median(r["sft_accuracy"] for r in rows),
        "median_final_accuracy": statistics.median(r["final_accuracy"] for r in rows),
        "quick": args.quick, "overrides": overrides, "cpu": cpu_model(), "num_cpus": os.cpu_count(), "seeds": rows,
    }
    print(f"lift: min {figures['min_lift_points']:+.1f}, median {figures['median_lift_points']:+.1f}, "
          f"max {figures['max_lift_points']:+.1f} points; slowest run {figures['max_wall_s']:.0f} s")
    figures["passed"] = {
        "min_lift_points": figures["min_lift_points"] >= TARGETS["min_lift_points"],
        "median_lift_points": figures["median_lift_points"] >= TARGETS["median_lift_points"],
        "max_wall_s": figures["max_wall_s"] <= TARGETS["max_wall_s"],
        "num_seeds": len(rows) >= 5,
    }
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
