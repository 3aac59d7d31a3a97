"""Sandbox benchmark: cases per second of the code sandbox, hardened (cgroup, namespaces, minimal root, Landlock,
seccomp) against a baseline with those kernel layers left out (rlimits, the audit hook and, as root, the privilege
drop: what the sandbox keeps under `allow_weak` where the kernel offers none).

Both sides run the same trivial passing case (`def f(x): return x + 1` / `assert f(1) == 2`) `--concurrency` at a
time (default: one per core), in rounds of `cases` that alternate between the sides, so both see the same background
load. Prints cases/s and CPU ms per case (the case processes' user + system time) for each, and the cost of the
layers; `--json PATH` also writes the figures; `--check` exits 1 when a hardened case failed to pass.

    .venv/bin/python bench/sandbox.py [--quick] [--concurrency 2] [--json /tmp/sandbox.json] [--check]
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from common import finish, parser as common_parser

from baton.rewards.sandbox import SandboxLimits, run_case

CODE, TEST = "def f(x): return x + 1", "assert f(1) == 2"
ROUNDS, ROUNDS_QUICK = 6, 2
CASES_PER_ROUND, CASES_PER_ROUND_QUICK = 40, 8
SIDES = {"hardened": {}, "baseline": {"_kernel": False}}


def one_round(side: str, num_cases: int, concurrency: int) -> tuple[float, float, bool]:
    """Seconds of wall clock and of the cases' CPU for `num_cases` cases of `side`, and whether all passed."""
    limits = SandboxLimits(allow_weak=side == "baseline")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda _: run_case(CODE, TEST, limits, **SIDES[side]), range(num_cases)))
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall_s, cpu_s, all(r.passed for r in results)


def main() -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 1, help="cases at once")
    args = parser.parse_args()
    rounds = ROUNDS_QUICK if args.quick else ROUNDS
    num_cases = CASES_PER_ROUND_QUICK if args.quick else CASES_PER_ROUND
    layers = run_case(CODE, TEST).layers  # also the warm-up of both sides' imports
    run_case(CODE, TEST, SandboxLimits(allow_weak=True), _kernel=False)
    walls, cpus, passed = {side: [] for side in SIDES}, {side: [] for side in SIDES}, {side: True for side in SIDES}
    for i in range(rounds):
        for side in (SIDES if i % 2 == 0 else reversed(list(SIDES))):
            wall_s, cpu_s, ok = one_round(side, num_cases, args.concurrency)
            walls[side].append(wall_s)
            cpus[side].append(cpu_s)
            passed[side] &= ok
    figures = {"quick": args.quick, "num_cpus": os.cpu_count(), "concurrency": args.concurrency, "rounds": rounds,
               "cases_per_round": num_cases, "euid": os.geteuid(), "hardened_layers": list(layers)}
    for side in SIDES:
        figures[side] = {"cases_per_s": num_cases / statistics.median(walls[side]),
                         "cpu_ms_per_case": 1000 * statistics.median(cpus[side]) / num_cases,
                         "all_passed": passed[side]}
    hardened, baseline = figures["hardened"], figures["baseline"]
    figures["throughput_ratio"] = hardened["cases_per_s"] / baseline["cases_per_s"]
    figures["cpu_ms_added_per_case"] = hardened["cpu_ms_per_case"] - baseline["cpu_ms_per_case"]
    figures["passed"] = {"hardened_cases_pass": hardened["all_passed"]}
    print(f"sandbox, {num_cases} trivial cases per round, {args.concurrency} at a time, {rounds} rounds per side, "
          f"{os.cpu_count()} cores, euid {os.geteuid()}; hardened layers: {', '.join(layers) or 'none'}")
    for side in SIDES:
        print(f"  {side:9s} {figures[side]['cases_per_s']:7.1f} cases/s  {figures[side]['cpu_ms_per_case']:6.1f} "
              f"CPU ms/case  all passed: {figures[side]['all_passed']}")
    print(f"  hardened/baseline throughput {figures['throughput_ratio']:.2f}, "
          f"+{figures['cpu_ms_added_per_case']:.1f} CPU ms per case")
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
