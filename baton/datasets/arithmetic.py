"""The synthetic verifiable task: integer arithmetic prompts like "23+45=" with exact answers.

The held-out split is fixed by the task's seed: every problem in the space is enumerated, shuffled
once, and the first `num_val` are held out; training draws only from the rest.

Each example also carries `teacher_answers`, the demonstrations SFT trains on. A perfect teacher
(teacher_error 0) gives the answer once; otherwise ten answers, of which, for an addition whose units
digits carry, the share `teacher_error` drops the carry ("17+25=" → "32" instead of "42"). The share
is exact for every such problem, so a model fine-tuned on them learns the same mixture everywhere: it
puts its highest probability on the teacher's usual answer (wrong when teacher_error > 0.5) but still
samples the right one often enough for a reward that checks the exact answer to train the slip away.
"""

from __future__ import annotations

import itertools

import numpy as np

from baton.datasets.prompts import PromptDataset

NUM_TEACHER_ANSWERS = 10
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def drop_carry(a: int, b: int) -> int:
    """a + b with the carry out of the units digit dropped: the classic slip of column addition."""
    return a + b - 10 if a % 10 + b % 10 >= 10 else a + b


def arithmetic_splits(max_operand: int = 99, ops: str = "+", num_val: int = 200, seed: int = 0,
                      teacher_error: float = 0.0) -> tuple[PromptDataset, PromptDataset]:
    """(train, val) datasets of "a<op>b=" → `answer` str(result), for 0 <= a, b <= max_operand.

    `teacher_answers`: NUM_TEACHER_ANSWERS demonstrations (one, the answer, when teacher_error is 0); on an
    addition with a carry, round(teacher_error × NUM_TEACHER_ANSWERS) of them drop the carry, the rest are right.
    """
    unknown = set(ops) - set(_APPLY)
    if unknown or not ops:
        raise ValueError(f"ops {ops!r}: use a non-empty string of {''.join(_APPLY)}")
    if not 0.0 <= teacher_error <= 1.0:
        raise ValueError(f"teacher_error={teacher_error} is not a probability in [0, 1]")
    problems = list(itertools.product(range(max_operand + 1), ops, range(max_operand + 1)))
    if num_val >= len(problems):
        raise ValueError(f"num_val={num_val} leaves no training problems out of {len(problems)}; lower it")
    order = np.random.default_rng(seed).permutation(len(problems))
    num_answers = NUM_TEACHER_ANSWERS if teacher_error else 1  # a perfect teacher: the answer, once
    num_slips = round(teacher_error * num_answers)
    examples = []
    for a, op, b in (problems[i] for i in order):
        answer = str(_APPLY[op](a, b))
        slip = str(drop_carry(a, b)) if op == "+" else answer
        teacher = [slip] * num_slips + [answer] * (num_answers - num_slips)
        examples.append({"prompt": f"{a}{op}{b}=", "answer": answer, "teacher_answers": teacher})
    return (PromptDataset(examples[num_val:], source="the arithmetic task's train split"),
            PromptDataset(examples[:num_val], source="the arithmetic task's held-out split"))
