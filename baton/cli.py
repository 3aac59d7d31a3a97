"""The `baton` command: `run` a pipeline from a YAML config (or the built-in demo), print a resolved
`config`, `plot` a run directory or `trace` one sample's path through it, `eval`, `generate` or `export` (a plain
HF directory) from a checkpoint.

Imports stay inside the commands: `baton --help` must not pay for torch and Ray."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEFAULT_PIPELINE = "baton.recipes.demo:DemoPipeline"  # the built-in demo
NEUTRAL_PIPELINE = "baton.recipes.demo:SFTRLVRPipeline"  # the same two stages, under the recipe's own name

# The demo pipelines' import paths before they moved to baton.recipes, as (module, name): written "module:name",
# each would be a plug-in path naming nothing.
MOVED_PIPELINES = {
    ("baton.pipelines.demo", "DemoPipeline"): "baton.recipes.demo:DemoPipeline",
    ("baton.pipelines.distill_demo", "DistillDemoPipeline"): "baton.recipes.distill:DistillDemoPipeline",
    ("baton.pipelines.dpo_demo", "DPODemoPipeline"): "baton.recipes.dpo:DPODemoPipeline",
    ("baton.pipelines.rollout_rlvr", "RolloutDemoPipeline"): "baton.recipes.rollout_demo:RolloutDemoPipeline",
    ("baton.pipelines.dag", "DAGDemoPipeline"): "baton.recipes.dag_demo:DAGDemoPipeline",
    ("baton.pipelines.agentic", "AgenticDemoPipeline"): "baton.recipes.agentic:AgenticDemoPipeline",
}


def resolve(config_path: str | None, overrides: list[str], stage: str | None = None, init_from: str | None = None):
    """(pipeline class, typed config) from an optional YAML file and `key.sub=value` overrides; `stage` and
    `init_from` (`--stage`, `--init-from`) run one stage of a multi-stage config (its `only_stage`, `init_from`)."""
    from baton.config import ConfigError, add_config_dir, import_object, load_config, load_yaml

    data = load_yaml(config_path) if config_path else {}
    if config_path:
        add_config_dir(config_path)  # before pipeline_cls is imported: it may live beside the config
    pipeline_override = [o.split("=", 1)[1] for o in overrides if o.startswith("pipeline_cls=")]
    path = pipeline_override[-1] if pipeline_override else data.get("pipeline_cls", DEFAULT_PIPELINE)
    if not isinstance(path, str):
        raise ConfigError(f"{config_path}: pipeline_cls is {path!r}, not an import path 'package.module:Class'")
    module, _, name = path.partition(":")
    if (module, name) in MOVED_PIPELINES:
        raise ConfigError(f"pipeline_cls {path!r} has moved; write pipeline_cls: {MOVED_PIPELINES[module, name]}")
    pipeline_cls = import_object(path)
    if not (isinstance(pipeline_cls, type) and isinstance(getattr(pipeline_cls, "config_cls", None), type)):
        where = "the override pipeline_cls" if pipeline_override else f"{config_path}: pipeline_cls"
        raise ConfigError(f"{where} {path!r} names an object of type {type(pipeline_cls).__name__}, not a pipeline "
                          f"class (a class with a config_cls, such as {DEFAULT_PIPELINE})")
    if stage is not None or init_from is not None:
        if "only_stage" not in getattr(pipeline_cls.config_cls, "__dataclass_fields__", {}):
            flag = "--stage" if stage is not None else "--init-from"
            raise ConfigError(f"{flag}: {path} runs a single stage, so there is no stage to choose; --stage and "
                              f"--init-from run one stage of a multi-stage config (such as {NEUTRAL_PIPELINE}). To "
                              "start this one from a checkpoint, set actor.strategy.model=CHECKPOINT (and the "
                              "other model roles')")
        overrides = [*overrides, *([f"only_stage={stage}"] if stage is not None else []),
                     *([f"init_from={init_from}"] if init_from is not None else [])]
    return pipeline_cls, load_config(pipeline_cls.config_cls, config_path, overrides)


def temperature(text: str) -> float:
    """A sampling temperature from the command line: a finite number, at least 0."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite temperature of at least 0")
    return value


def count(text: str) -> int:
    """A whole number of at least 1 from the command line."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description="Distributed RL post-training of language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a pipeline (default: the SFT → GRPO demo on the arithmetic task)")
    show = commands.add_parser("config", help="print the resolved config without running")
    for sub in (run, show):
        sub.add_argument("config", nargs="?", default=None, help="a YAML config; omitted: the built-in demo")
        sub.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. trainer.num_steps=10")
    run.add_argument("--ray-address", default=None, help="run on an existing Ray cluster (HOST:PORT) instead of a local one")
    for sub in (run, show):
        sub.add_argument("--stage", default=None, help="run this stage of a multi-stage config alone (e.g. rlvr), into "
                         "its usual directory run_dir/STAGE")
        sub.add_argument("--init-from", default=None, help="with --stage of the second stage: the checkpoint it starts "
                         "from, a stage directory (runs/x/sft: its latest checkpoint) or a checkpoint directory; "
                         "default: this run's own first stage's latest")
    plot = commands.add_parser("plot", help="write metrics.png for a run directory")
    plot.add_argument("run_dir")
    trace_cmd = commands.add_parser("trace", help="print one sample's path through a traced run (trainer.trace), or "
                                    "write its trace.json",
                                    description="Every span and mark of the run's trace that names the sample: its "
                                    "requests and their engines, its group's reward and buffer wait, the step that "
                                    "trained it and its tokens' weight versions.")
    trace_cmd.add_argument("run_dir")
    trace_cmd.add_argument("--sample", default=None, help="the sample's id, g<group>-s<sample> (e.g. g12-s3); "
                           "without it: write the run's trace.json from its events (a run that was killed)")
    checkpoint_help = ("a checkpoint: a role directory (runs/demo/rlvr/checkpoints/step_200/actor), a step directory "
                       "(its actor), a run directory (its latest step), or runs/demo (its last stage)")
    evaluate = commands.add_parser("eval", help="held-out accuracy, pass@k (with --num-samples > 1) and mean reward of a "
                                   "checkpoint, as its run validated it",
                                   description="Score a checkpoint with its run's tokenizer, held-out data, reward and "
                                   "val_sampling (from the run directory's config.yaml); prints a JSON summary.")
    generate = commands.add_parser("generate", help="print a checkpoint's completions of prompts",
                                   description="Sample completions with the run's val_sampling (greedy by default); "
                                   "prints one JSON object per completion.")
    export = commands.add_parser("export", help="write a checkpoint as a plain HF model directory (a LoRA adapter "
                                 "merged into its base)", description="Load a checkpoint as `baton eval` does and write "
                                 "its model (safetensors, config.json, tokenizer) to OUT_DIR, loadable without peft.")
    export.add_argument("checkpoint", help=checkpoint_help)
    export.add_argument("out_dir", help="a new (or empty) directory")
    for sub in (evaluate, generate):
        sub.add_argument("checkpoint", help=checkpoint_help)
        sub.add_argument("--temperature", type=temperature, default=None, help="default: the run's val_sampling")
        sub.add_argument("--max-new-tokens", type=count, default=None, help="default: the run's val_sampling")
        sub.add_argument("--num-samples", type=count, default=None, help="samples per prompt; default: the run's val_sampling")
    evaluate.add_argument("--data", default=None, help="a .jsonl or .parquet prompt file (the run's prompt/answer keys); "
                          "default: the run's held-out data")
    evaluate.add_argument("--reward", default=None, help="a reward name or import path; default: the run's reward_fn")
    for sub in (evaluate, generate, export):
        sub.add_argument("--trust-run-dir", action="store_true",
                         help="import the modules the run's config names (its reward, pipeline) from the run directory "
                         "and the directories its import_dirs.txt records; without it a run directory is data only")
    generate.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    generate.add_argument("--prompts-file", default=None, help="a text file with one prompt per line, or a .jsonl/.parquet "
                          "prompt file (its prompts in the field --prompt-key names)")
    generate.add_argument("--prompt-key", default=None, help="the field of a .jsonl/.parquet --prompts-file that holds "
                          "the prompt; default: the run's data.prompt_key ('prompt' without a run config)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    dag = commands.add_parser("dag", help="workflow graphs: `baton dag plan CONFIG` prints how one is scheduled")
    dag_commands = dag.add_subparsers(dest="dag_command", required=True)
    plan = dag_commands.add_parser(
        "plan", help="split a workflow into subgraphs, apportion and place workers, print the table",
        description="CONFIG: a workflow YAML (dag_id, nodes) or a run config with `workflow:` (a DAG pipeline's, "
        "or the demo's under rlvr:). Prints subgraph -> ranks -> nodes, the process groups and the edges between "
        "subgraphs; --png draws the graph.")
    plan.add_argument("config")
    plan.add_argument("--nodes", type=int, default=1, help="machine nodes (default 1)")
    plan.add_argument("--slots-per-node", type=int, default=8, help="device slots per machine node (default 8)")
    plan.add_argument("--apportion", default="even", choices=["even", "model_size"],
                      help="workers per subgraph: even, or by the nodes' config model_size")
    plan.add_argument("--colocate", action="store_true",
                      help="every subgraph on every slot, as the multi-controller executor runs it")
    plan.add_argument("--png", default=None, help="also draw the graph to this PNG file (never overwritten)")
    args, extra = parser.parse_known_args(argv)
    # Overrides after an option (`baton run CFG --stage rlvr lr=...`) are overrides too: argparse leaves them over.
    if extra and args.command in ("run", "config") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "dag":
        return dag_plan(args)
    if args.command == "plot":
        from baton.tracking import plot_run

        print(plot_run(args.run_dir))
        return 0
    if args.command == "trace":
        from baton.tracking.trace import sample_path, write_trace

        try:
            if args.sample is None:
                print(write_trace(args.run_dir))
                return 0
            lines = sample_path(args.run_dir, args.sample)
        except ValueError as error:
            parser.error(str(error))
        if not lines:
            print(f"baton trace: no event names sample {args.sample} in {args.run_dir} (was it run with "
                  "trainer.trace: true, and is its group among those traced, trainer.trace_every_groups?)",
                  file=sys.stderr)
            return 1
        print("\n".join(lines))
        return 0
    if args.command in ("eval", "generate", "export"):
        return evaluate_or_generate(args)
    # A config path that looks like an override is an override (e.g. `baton run trainer.num_steps=5`).
    if args.config is not None and "=" in args.config and not os.path.isfile(args.config):
        args.overrides.insert(0, args.config)
        args.config = None
    from baton.config import ConfigError
    from baton.distributed import LayoutError
    from baton.pipelines.signals import TrainingInterrupted

    config = None
    try:
        pipeline_cls, config = resolve(args.config, args.overrides, args.stage, args.init_from)
        if args.command == "config":
            return show_config(pipeline_cls, config)
        summary = run_on_ray(pipeline_cls, config, args.ray_address)
    except (ConfigError, LayoutError) as e:
        print(f"baton: error: {in_config(args.config, e)}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        print(f"baton: {e}; to continue, rerun the same command with {resume_key(config)}=latest", file=sys.stderr)
        return 130
    except _run_failures() as e:
        log = write_error_log(config, e) if args.command == "run" else None  # `baton config` writes nothing
        print(f"baton: error: {one_line(e)}" + (f"\n  to continue: {next_step(e, config)}" if args.command == "run" else "")
              + (f"\n  full traceback: {log}" if log else ""), file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}, indent=2))
    return 0


def in_config(config_path: str | None, exc: BaseException) -> str:
    """The message of `exc`, led by the config file it comes from where it does not name it already."""
    text = str(exc)
    if config_path is None or text.startswith((config_path, os.path.normpath(config_path))):
        return text
    return f"{config_path}: {text}"


def dag_plan(args) -> int:
    """`baton dag plan`: the scheduler's plan of a workflow, without starting anything."""
    from baton.config import ConfigError, load_yaml
    from baton.dag import ClusterLayout, WorkflowError, load_workflow, schedule

    try:
        data = load_yaml(args.config)
        if "dag_id" not in data:  # a run config: its workflow (the demo's: its rlvr stage's)
            pipeline_cls, config = resolve(args.config, [])
            config = config.stage("rlvr") if hasattr(config, "stage") else config
            if not hasattr(config, "graph"):
                raise ConfigError(f"{args.config}: {type(config).__name__} runs no workflow; give a workflow YAML or "
                                  "a DAG pipeline's config (pipeline_cls: baton.pipelines.dag:DAGPipeline)")
            graph = config.graph()
        else:
            graph = load_workflow(data)
        plan = schedule(graph, ClusterLayout.uniform(args.nodes, args.slots_per_node), apportion_by=args.apportion,
                        colocate=args.colocate)
        print(plan.table())
        if args.png:
            print(f"graph drawn to {plan.draw(args.png)}")
    except (ConfigError, WorkflowError, FileExistsError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    return 0


def show_config(pipeline_cls, config) -> int:
    """`baton config`: print the resolved config, then run what `baton run` checks before Ray starts."""
    from baton.config import dump_yaml

    print(dump_yaml(config), end="", flush=True)
    if hasattr(pipeline_cls, "dry_run"):
        pipeline_cls.dry_run(config)
        print("baton: checks passed: config, models, machine and data; `baton run` with these arguments would start",
              file=sys.stderr)
    return 0


def evaluate_or_generate(args) -> int:
    """`baton eval` / `baton generate` / `baton export`: in this process, no Ray."""
    from transformers.utils import logging as hf_logging

    from baton.pipelines import evaluate

    hf_logging.disable_progress_bar()  # per-file "Loading weights" bars would bury the result
    try:
        if args.command == "export":  # the model only: no reward, data or sampling settings are used
            policy = evaluate.load_policy(args.checkpoint, reward="exact_match", trust_run_dir=args.trust_run_dir)
            print(evaluate.export_merged(policy, args.out_dir))
            return 0
        if args.command == "generate" and not (args.prompt or args.prompts_file):
            raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
        # generate scores nothing: the run's reward is not loaded, the built-in stands in
        reward = args.reward if args.command == "eval" else "exact_match"
        policy = evaluate.load_policy(args.checkpoint, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                      num_samples=args.num_samples, reward=reward, trust_run_dir=args.trust_run_dir)
        prompts = ([*(check_text(p, "--prompt") for p in args.prompt),
                    *read_prompts(args.prompts_file, policy.strategy.tokenizer, args.prompt_key or policy.data.prompt_key)]
                   if args.command == "generate" else [])
        if args.command == "generate" and not prompts:
            raise ValueError(f"no prompts in {args.prompts_file}: pass --prompt TEXT or a file with prompts")
        if not policy.from_run_config:
            print(f"baton: no run config.yaml above {policy.model_dir}; using its own tokenizer (else baton's), "
                  "the default arithmetic task, exact_match and greedy decoding", file=sys.stderr)
        if args.command == "eval":
            print(json.dumps(evaluate.evaluate(policy, args.data), indent=2))
        else:
            for completion in evaluate.generate(policy, prompts, seed=args.seed):
                print(json.dumps(completion))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    return 0


def read_prompts(path: str | None, tokenizer, prompt_key: str = "prompt") -> list[str]:
    """The prompts of a .jsonl/.parquet prompt file (its `prompt_key` field; chat messages rendered by `tokenizer`'s
    chat template), or the lines of a text file."""
    if path is None:
        return []
    if path.endswith((".jsonl", ".parquet")):
        from baton.datasets import PromptDataset
        from baton.datasets.files import read_rows
        from baton.datasets.prompts import has_field

        rows, positions, unit = read_rows(path, {prompt_key: "..."})
        missing = next((i for i, row in enumerate(rows) if not (isinstance(row, dict) and has_field(row, prompt_key))),
                       None)
        if missing is not None:
            fields = sorted(rows[missing]) if isinstance(rows[missing], dict) else []
            raise ValueError(f"{path}, {unit} {positions[missing]}: no {prompt_key!r} field (fields: {fields}); pass "
                             "--prompt-key FIELD, the field that holds the prompt (default: the run's data.prompt_key)")
        dataset = PromptDataset(rows, prompt_key, answer_key=None, source=path, positions=positions, unit=unit)
        return dataset.render_chat(tokenizer).text_prompts()
    with open(path, "rb") as f:
        lines = [check_text(raw, f"{path}, line {number}") for number, raw in enumerate(f, start=1)]
    return [line.rstrip("\r\n") for line in lines if line.strip()]


def check_text(text: str | bytes, where: str) -> str:
    """`text` (bytes: decoded as UTF-8) if it is text that can be tokenized; ValueError naming `where` if it holds bytes
    that are not UTF-8 (on the command line they come as lone surrogates) or a lone surrogate."""
    try:
        return text.decode("utf-8") if isinstance(text, bytes) else (text.encode("utf-8") and text)
    except UnicodeError as e:
        raise ValueError(f"{where}: {text[e.start:e.start + 1]!r} at position {e.start + 1} is not UTF-8 text; "
                         "give UTF-8") from None


def run_on_ray(pipeline_cls, config, ray_address: str | None) -> dict:
    """Run the pipeline on the cluster at `ray_address` (None: the pipeline starts a local Ray). The connection this
    command made (or the local Ray the pipeline started) is shut down after; a Ray that was already up stays up."""
    from baton.pipelines.base import run_pipeline

    def ray_is_up() -> bool:
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    already_up = ray_is_up()
    if ray_address and not already_up:
        import ray

        from baton.config import ray_runtime_env

        ray.init(address=ray_address, logging_level="ERROR", runtime_env=ray_runtime_env())
    try:
        return run_pipeline(pipeline_cls, config)
    finally:
        if ray_is_up() and not already_up:
            sys.modules["ray"].shutdown()


# --- failures: one line and the next step on the terminal, the traceback in the run directory -------------------

def _run_failures() -> tuple[type, ...]:
    """The failures reported in one line (imported when one is caught: importing them imports torch)."""
    from baton.distributed import CallTimeoutError, ClusterStoppedError, WorkerError

    return (WorkerError, CallTimeoutError, ClusterStoppedError, OSError, ValueError)


def one_line(exc: BaseException) -> str:
    """A failure in one line: a worker's error as cluster, rank, method and the remote exception's last line."""
    from baton.distributed import WorkerError

    if isinstance(exc, WorkerError):
        what = exc.what  # raised, died or froze
        cause = exc.__cause__  # the worker's own exception, where it could be sent back
        if cause is not None:
            reason = f"{type(cause).__name__}: {' '.join(str(cause).split())}"
        else:
            lines = [line.strip() for line in exc.remote_traceback.strip().splitlines() if line.strip()]
            reason = lines[-1] if lines else "?"
        return f"worker {exc.cluster}[rank {exc.rank}] {what} in {exc.method}(): {reason}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, (ValueError, OSError)) or not text else text


def resume_key(config) -> str:
    return "resume" if hasattr(config, "resume") else "trainer.resume"  # the demo resumes both of its stages


def next_step(exc: BaseException, config) -> str:
    """What to do after a failed run: resume it where it left a checkpoint, else run it (or its failed stage) again."""
    import errno

    resume = rerun_advice(config)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free disk space (or lower trainer.keep_last_checkpoints), then {resume}"
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"make the run directory writable (or choose another trainer.run_dir), then {resume}"
    return f"fix the cause above, then {resume}"


def rerun_advice(config) -> str:
    """How to run a failed run again: resume=latest only where the run (in a multi-stage run: the stage that failed,
    the first without a summary) left a checkpoint; a later stage that left none runs alone from the finished one's
    (`--stage`); a run that left records but no checkpoint is replaced (overwrite=true), as a plain rerun is refused."""
    from baton.pipelines.run_dir import list_checkpoints, previous_run

    stages = getattr(config, "stages_to_run", None)
    if stages is None:
        run_dir, prefix, failed = run_dir_of(config), "trainer.", None
    else:
        failed = next((name for name in stages if not os.path.isfile(
            os.path.join(config.stage(name).trainer.run_dir, "summary.json"))), stages[-1])
        run_dir, prefix = config.stage(failed).trainer.run_dir, ""
    if list_checkpoints(run_dir):
        return (f"rerun the same command with {prefix}resume=latest (it continues from "
                f"{os.path.relpath(list_checkpoints(run_dir)[-1], run_dir)}{f' of the {failed} stage' if failed else ''})")
    if failed is not None and failed != stages[0]:
        return (f"run the {failed} stage alone: rerun the same command with --stage {failed} overwrite=true (the stages "
                f"before it finished and are kept; {failed} left no checkpoint to continue from)")
    if previous_run(run_dir):
        return f"rerun the same command with {prefix}overwrite=true (it left no checkpoint to continue from)"
    return "rerun the same command"


def run_dir_of(config) -> str:
    return getattr(config, "run_dir", None) or getattr(getattr(config, "trainer", None), "run_dir", None) or "."


def write_error_log(config, exc: BaseException) -> str:
    """Append the full traceback to the run directory's error.log; returns its path."""
    import time
    import traceback

    run_dir = run_dir_of(config)
    path = os.path.join(run_dir, "error.log")
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} baton {' '.join(sys.argv[1:])}\n")
        f.write("".join(traceback.format_exception(exc)))
        remote = getattr(exc, "remote_traceback", None)
        if remote:
            f.write(f"remote traceback:\n{remote.rstrip()}\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
