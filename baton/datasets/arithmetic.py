"""The synthetic verifiable task: integer arithmetic prompts like "23+45=" with exact answers.

The held-out split is fixed by the task's seed: every problem in the space is enumerated, shuffled
once, and the first `num_val` are held out; training draws only from the rest.
"""

from __future__ import annotations

import itertools

import numpy as np

from baton.datasets.prompts import PromptDataset

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_splits(max_operand: int = 99, ops: str = "+", num_val: int = 200, seed: int = 0) -> tuple[PromptDataset, PromptDataset]:
    """(train, val) datasets of "a<op>b=" → str(result), for 0 <= a, b <= max_operand."""
    unknown = set(ops) - set(_APPLY)
    if unknown or not ops:
        raise ValueError(f"ops {ops!r}: use a non-empty string of {''.join(_APPLY)}")
    problems = list(itertools.product(range(max_operand + 1), ops, range(max_operand + 1)))
    if num_val >= len(problems):
        raise ValueError(f"num_val={num_val} leaves no training problems out of {len(problems)}; lower it")
    order = np.random.default_rng(seed).permutation(len(problems))
    examples = [
        {"prompt": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))}
        for a, op, b in (problems[i] for i in order)
    ]
    return PromptDataset(examples[num_val:]), PromptDataset(examples[:num_val])
