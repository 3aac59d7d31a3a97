"""The `baton` command."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description="Distributed RL post-training of language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the example pipeline")
    run.add_argument("--backend", choices=["ray", "local"], default="ray", help="Ray actors, or everything in this process")
    run.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting a local one")
    run.add_argument("--num-cpus", type=int, default=None, help="logical CPUs for the local Ray instance (default: this machine's, at least 4)")
    run.add_argument("--num-steps", type=int, default=5)
    run.add_argument("--num-rows-per-step", type=int, default=1000)
    args = parser.parse_args(argv)

    from baton import ResourceManager
    from baton.pipelines.transform import TransformConfig, run as run_transform

    config = TransformConfig(num_steps=args.num_steps, num_rows_per_step=args.num_rows_per_step)
    if args.backend == "local":
        run_transform(config, ResourceManager(backend="local"))
        return 0
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if args.ray_address:
        ray.init(address=args.ray_address, logging_level="ERROR")
    else:
        ray.init(address="local", num_cpus=args.num_cpus or max(4, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR")
    manager = ResourceManager(num_nodes=1, num_devices_per_node=1)
    try:
        run_transform(config, manager)
    finally:
        manager.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
