"""The `baton` command: `run` a pipeline from a YAML config (or the built-in demo), print a resolved
`config`, or `plot` a run directory."""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_PIPELINE = "baton.pipelines.demo:DemoPipeline"


def resolve(config_path: str | None, overrides: list[str]):
    """(pipeline class, typed config) from an optional YAML file and `key.sub=value` overrides."""
    from baton.config import import_object, load_config, load_yaml

    data = load_yaml(config_path) if config_path else {}
    pipeline_override = [o.split("=", 1)[1] for o in overrides if o.startswith("pipeline_cls=")]
    pipeline_cls = import_object(pipeline_override[-1] if pipeline_override else data.get("pipeline_cls", DEFAULT_PIPELINE))
    return pipeline_cls, load_config(pipeline_cls.config_cls, config_path, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description="Distributed RL post-training of language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a pipeline (default: the SFT → GRPO demo on the arithmetic task)")
    show = commands.add_parser("config", help="print the resolved config without running")
    for sub in (run, show):
        sub.add_argument("config", nargs="?", default=None, help="a YAML config; omitted: the built-in demo")
        sub.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. trainer.num_steps=10")
    run.add_argument("--ray-address", default=None, help="run on an existing Ray cluster (HOST:PORT) instead of a local one")
    plot = commands.add_parser("plot", help="write metrics.png for a run directory")
    plot.add_argument("run_dir")
    args = parser.parse_args(argv)

    if args.command == "plot":
        from baton.tracking import plot_run

        print(plot_run(args.run_dir))
        return 0
    # A config path that looks like an override is an override (e.g. `baton run trainer.num_steps=5`).
    if args.config is not None and "=" in args.config and not os.path.isfile(args.config):
        args.overrides.insert(0, args.config)
        args.config = None
    from baton.config import ConfigError
    from baton.distributed import LayoutError
    from baton.pipelines.base import TrainingInterrupted

    try:
        pipeline_cls, config = resolve(args.config, args.overrides)
        if args.command == "config":
            from baton.config import dump_yaml

            print(dump_yaml(config), end="")
            return 0
        summary = run_on_ray(pipeline_cls, config, args.ray_address)
    except (ConfigError, LayoutError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        resume = "resume" if hasattr(config, "resume") else "trainer.resume"  # the demo resumes both of its stages
        print(f"baton: {e}; to continue, rerun the same command with {resume}=latest", file=sys.stderr)
        return 130
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}, indent=2))
    return 0


def run_on_ray(pipeline_cls, config, ray_address: str | None) -> dict:
    """Run the pipeline on the cluster at `ray_address` (None: the pipeline starts a local Ray); Ray is shut down after."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from baton.pipelines.base import run_pipeline

    if ray_address:
        ray.init(address=ray_address, logging_level="ERROR")
    try:
        return run_pipeline(pipeline_cls, config)
    finally:
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
