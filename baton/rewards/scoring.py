"""Calling a reward function on a batch's rows: the arguments it must accept, a row it raises on, what it returns."""

from __future__ import annotations

import inspect
import math
import numbers
import reprlib
from typing import Any, Iterable, Sequence

from baton.rewards.registry import RewardFn

REWARD_ON_ERROR = ("raise", "zero")  # what score_rows does when the function raises on a row
_SHORT = reprlib.Repr()  # row values in messages, long ones cut in the middle
_SHORT.maxstring = _SHORT.maxother = 160


class RewardError(RuntimeError):
    """A reward function raised on a row, or returned something that is not a finite number (a bool counts as 0/1).
    Names the function, the row (its prompt, response and ground truth) and the value or the error (its __cause__)."""


def check_reward_columns(fn: RewardFn, name: str, columns: Iterable[str]) -> None:
    """Raise ValueError unless `fn(response, ground_truth, **{column: ...})` binds every column in `columns`: none
    may be named like the parameter taking the response or the ground truth, and a function without `**fields`
    must name each column as a parameter."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): the call itself will tell
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    columns = set(columns)
    for param, role in zip(positional, ("response", "ground truth")):
        if param.kind == param.POSITIONAL_OR_KEYWORD and param.name in columns:
            raise ValueError(f"the batch's column {param.name!r} has the name of reward function {name!r}'s parameter "
                             f"that takes the {role}; rename that data field")
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    named = {p.name for p in params[len(positional):] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(columns - named)
    if unknown:
        raise ValueError(f"reward function {name!r} takes no parameter {', '.join(map(repr, unknown))}, but every "
                         "non-tensor column of the batch (the data's extra fields, 'prompt', 'uid', 'finish_reason') "
                         "is passed to it by name; add **fields to its signature")


def score_rows(fn: RewardFn, name: str, responses: Sequence[str], ground_truths: Sequence[Any],
               columns: dict[str, Sequence[Any]], on_error: str = "raise") -> tuple[list[float], int]:
    """(scores, num_errors): `fn(responses[row], ground_truths[row], **{k: v[row] for k, v in columns.items()})`.

    A row `fn` raises on: with on_error "raise", a RewardError naming the function, the row and the error; with
    "zero", a score of 0.0, counted in num_errors. A return value that is not a finite number is a bug in `fn`:
    a RewardError either way.
    """
    if on_error not in REWARD_ON_ERROR:
        raise ValueError(f"on_error {on_error!r} is not one of {REWARD_ON_ERROR}")
    check_reward_columns(fn, name, columns)
    scores, num_errors = [], 0
    for row, (response, truth) in enumerate(zip(responses, ground_truths)):
        fields = {k: v[row] for k, v in columns.items()}
        try:
            value = fn(response, truth, **fields)
        except Exception as e:  # the user's function: any error, reported with its row or counted
            if on_error == "raise":
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}\n"
                                  f"{_describe_row(row, response, truth, fields)}\n"
                                  "Fix the function, or score the rows it raises on 0 (counted as "
                                  "reward/num_errors) with reward_on_error: zero") from e
            num_errors += 1
            value = 0.0
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward function {name!r} returned {_SHORT.repr(value)} (a {type(value).__name__}); a "
                              f"reward must be a finite number (a float)\n{_describe_row(row, response, truth, fields)}")
        scores.append(float(value))
    return scores, num_errors


def _describe_row(row: int, response: str, truth: Any, fields: dict[str, Any]) -> str:
    lines = [f"  on row {row} of the batch:"]
    if "prompt" in fields:
        lines.append(f"    prompt:       {_SHORT.repr(fields['prompt'])}")
    lines += [f"    response:     {_SHORT.repr(response)}", f"    ground truth: {_SHORT.repr(truth)}"]
    return "\n".join(lines)
