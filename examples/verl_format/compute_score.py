"""A reward function exactly as verl users write one: `compute_score(data_source, solution_str, ground_truth,
extra_info=None)`, returning verl's dict (`score`, plus fields logged as metrics; `pred` is the extracted answer that
validation's maj@k votes over). baton recognises the signature and calls it as verl does."""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    if not data_source.startswith("arithmetic/"):
        raise ValueError(f"compute_score scores the arithmetic task only, not data_source {data_source!r}")
    found = _INTEGER.match(solution_str.strip())
    pred = found.group() if found else ""
    correct = float(pred == ground_truth)
    return {"score": correct, "acc": correct, "pred": pred}
