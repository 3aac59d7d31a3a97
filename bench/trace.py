"""What a trace per sample costs (`trainer.trace`, `baton.tracking.trace`): GRPO on the rollout system, async in
deterministic mode (two steps' rollouts ahead of training), the same run with the trace off and on, on a local Ray
instance of 2 CPUs: the actor in one worker, one engine in another, tiny-qwen2 from its config, 64 prompts x 16
samples of up to 8 tokens a step (bench/rollout.py's batch), every group traced.

Figures:
    tracer_share            the tracer's own seconds in the driver (every span recorded, the events appended to
                            trace.events.jsonl, trace.json written: `otherData.tracer_s`) over the traced run's step
                            seconds; the target is <= 0.03
    events_per_step         the events a step adds to the trace
    step_s_off, step_s_on   median seconds a step, off and on (the runs minutes apart on a shared machine: their ratio,
                            `step_ratio`, is noise at this size, the tracer's share is the measure)

    .venv/bin/python bench/trace.py [--quick] [--steps 8] [--json /tmp/trace.json] [--check]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

from common import finish, local_ray, parser as common_parser

from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.rollout.config import RolloutSystemConfig
from baton.strategy import StrategyConfig
from baton.tracking import read_metrics
from baton.tracking.trace import TRACE_FILE

NUM_STEPS, NUM_STEPS_QUICK = 8, 3
NUM_PROMPTS, NUM_PROMPTS_QUICK = 64, 4
SAMPLES_PER_PROMPT, MAX_NEW_TOKENS = 16, 8
TARGET_SHARE = 0.03


def config(run_dir: str, num_steps: int, num_prompts: int, traced: bool) -> RolloutRLVRConfig:
    strategy = StrategyConfig(model="tiny-qwen2", micro_batch_size_per_worker=128)
    return RolloutRLVRConfig(
        actor=RoleConfig(strategy=strategy, device_mapping=[0], num_threads_per_worker=1),
        rollout=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"), world_size=1, device_mapping=[1],
                           num_threads_per_worker=1),
        data=DataConfig(max_operand=99, num_val_examples=8),
        sampling=SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, num_samples_per_prompt=SAMPLES_PER_PROMPT),
        val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, num_samples_per_prompt=1),
        trainer=TrainerConfig(backend="ray", num_cpus=2, run_dir=run_dir, num_prompts_per_step=num_prompts,
                              num_steps=num_steps, val_every_steps=num_steps, val_before_train=False,
                              save_every_steps=num_steps, progress_bar=False, overwrite=True, trace=traced),
        rollout_system=RolloutSystemConfig(mode="async", max_staleness=2, deterministic=True))


def run(traced: bool, root: str, num_steps: int, num_prompts: int) -> dict:
    run_dir = os.path.join(root, "on" if traced else "off")
    run_pipeline(RolloutRLVRPipeline, config(run_dir, num_steps, num_prompts, traced))
    steps = [r["timing_s/step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "timing_s/step" in r]
    figures = {"step_s": statistics.median(steps[1:]), "total_step_s": sum(steps)}
    if traced:
        with open(os.path.join(run_dir, TRACE_FILE)) as f:
            trace = json.load(f)
        figures["tracer_s"] = trace["otherData"]["tracer_s"]
        figures["events"] = len(trace["traceEvents"])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    num_steps = args.steps or (NUM_STEPS_QUICK if args.quick else NUM_STEPS)
    num_prompts = NUM_PROMPTS_QUICK if args.quick else NUM_PROMPTS
    with tempfile.TemporaryDirectory() as root, local_ray(num_cpus=2):
        off = run(False, root, num_steps, num_prompts)
        on = run(True, root, num_steps, num_prompts)
    figures = {"tracer_share": on["tracer_s"] / on["total_step_s"], "events_per_step": on["events"] / num_steps,
               "step_s_off": off["step_s"], "step_s_on": on["step_s"], "step_ratio": on["step_s"] / off["step_s"],
               "tracer_s": on["tracer_s"], "num_steps": num_steps, "num_prompts_per_step": num_prompts,
               "samples_per_prompt": SAMPLES_PER_PROMPT, "quick": args.quick, "target_share": TARGET_SHARE}
    figures["passed"] = {"tracer_share": figures["tracer_share"] <= TARGET_SHARE}
    print(f"trace per sample: the tracer took {figures['tracer_s']:.3f} s of {on['total_step_s']:.1f} s of steps "
          f"({figures['tracer_share']:.2%}), {figures['events_per_step']:.0f} events a step; median step "
          f"{off['step_s']:.3f} s off, {on['step_s']:.3f} s on ({figures['step_ratio']:.2f}x, runs apart: noise)")
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
