"""What every benchmark shares: interleaved timing, the options, a local Ray, and the JSON, missed targets and exit code at the end."""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from typing import Callable


def interleaved_times_s(baton_fn: Callable[[], object], other_fn: Callable[[], object], num_calls: int,
                        warmup: int) -> tuple[list[float], list[float]]:
    """Seconds per call of each, after the same warm-up, timed call by call in alternating order.

    Interleaving puts both sides under the same background load (this machine is shared).
    """
    for _ in range(warmup):
        baton_fn()
        other_fn()
    fns, times_s = (baton_fn, other_fn), ([], [])
    for i in range(num_calls):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            start = time.perf_counter()
            fns[side]()
            times_s[side].append(time.perf_counter() - start)
    return times_s


@contextmanager
def local_ray(num_cpus: int):
    """A Ray instance of our own for the benchmark, shut down after (even if another one, e.g. a test
    session's, is running: address="local")."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --json PATH, --quick, --check."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    return parser


def finish(figures: dict, json_path: str | None, check: bool) -> int:
    """`figures["passed"]` maps target names to booleans; exit 1 on a miss only when `check` is set."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"figures written to {json_path}")
    missed = [key for key, ok in figures["passed"].items() if not ok]
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 1 if check and missed else 0
