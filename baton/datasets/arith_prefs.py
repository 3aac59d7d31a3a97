"""The shipped preference pairs on the arithmetic task (`data/arith_prefs.jsonl`): chosen = the exact sum,
rejected = a near miss, on the demo task's training problems only (a+b for a, b <= 30; its 200 held-out problems
never appear).

Each training problem gives `NUM_PAIRS_PER_PROBLEM` pairs with different near misses. The first is the slip the
demo's weak teacher makes: a sum that carries with its carry dropped ("17+25=" → "32"), and, for a sum that does
not carry, the opposite slip, a carry added that is not there ("12+5=" → "27"); the others are drawn from an
off-by-one, an off-by-two and swapped digits. Regenerate the file (deterministic) with

    .venv/bin/python -m baton.datasets.arith_prefs
"""

from __future__ import annotations

import json
import os

import numpy as np

from baton.datasets.arithmetic import arithmetic_splits, drop_carry

SHIPPED_PAIRS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "arith_prefs.jsonl")
NUM_PAIRS_PER_PROBLEM = 2
# The demo's task (`baton.recipes.demo._demo_data`): its held-out split is fixed by these.
DEMO_TASK = {"max_operand": 30, "num_val": 200, "seed": 0}


def near_misses(a: int, b: int) -> dict[str, int]:
    """Wrong answers to a+b close to it, by the slip that makes each (the carry slip first), all >= 0 and distinct."""
    total = a + b
    carries = a % 10 + b % 10 >= 10
    misses = {"dropped_carry": drop_carry(a, b)} if carries else {"added_carry": total + 10}
    misses.update({"plus_one": total + 1, "minus_one": total - 1, "plus_two": total + 2, "minus_two": total - 2})
    if total >= 10 and str(total)[::-1] != str(total):
        misses["swapped_digits"] = int(str(total)[::-1])
    unique: dict[str, int] = {}
    for slip, value in misses.items():
        if value >= 0 and value != total and value not in unique.values():
            unique[slip] = value
    return unique


def arithmetic_pairs(max_operand: int = 30, num_val: int = 200, seed: int = 0,
                     num_pairs_per_problem: int = NUM_PAIRS_PER_PROBLEM) -> list[dict]:
    """The pairs of every training problem of `arithmetic_splits(max_operand, "+", num_val, seed)`, in its order:
    {"prompt": "a+b=", "chosen": str(a+b), "rejected": a near miss, "slip": the near miss's kind}. The first pair
    of a problem has the carry slip; the others near misses drawn (seeded) from the rest."""
    train, _ = arithmetic_splits(max_operand, "+", num_val, seed)
    rng = np.random.default_rng(seed)
    pairs = []
    for example in train.examples:
        a, b = (int(x) for x in example["prompt"].rstrip("=").split("+"))
        misses = near_misses(a, b)
        slips = list(misses)
        first, rest = slips[0], slips[1:]
        drawn = [rest[i] for i in rng.permutation(len(rest))[: num_pairs_per_problem - 1]]
        for slip in [first, *drawn]:
            pairs.append({"prompt": example["prompt"], "chosen": example["answer"], "rejected": str(misses[slip]),
                          "slip": slip})
    return pairs


def write_pairs(path: str = SHIPPED_PAIRS, **task) -> int:
    """Write `arithmetic_pairs(**task)` (the demo's task by default) to `path` as jsonl; returns the pair count."""
    pairs = arithmetic_pairs(**{**DEMO_TASK, **task})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for pair in pairs:
            f.write(json.dumps(pair) + "\n")
    return len(pairs)


if __name__ == "__main__":
    print(f"wrote {write_pairs()} pairs to {SHIPPED_PAIRS}")
