"""What every benchmark does after measuring: write the JSON, list missed targets, choose the exit code."""

from __future__ import annotations

import json


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
