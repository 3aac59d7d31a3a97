"""Calling a reward function on a batch's rows: the arguments it must accept, a row it raises on, what it returns."""

from __future__ import annotations

import inspect
import math
import numbers
import reprlib
from typing import Any, Iterable, Sequence

from baton.rewards.registry import RewardFn

REWARD_ON_ERROR = ("raise", "zero")  # what score_rows does when the function raises on a row
REWARD_EXTRA_PREFIX = "reward_extra/"  # a dict reward's further fields, as the reward worker's columns "<prefix><key>"
_SHORT = reprlib.Repr()  # row values in messages, long ones cut in the middle
_SHORT.maxstring = _SHORT.maxother = 160


class RewardError(RuntimeError):
    """A reward function raised on a row, or returned something that is not a finite number (a bool counts as 0/1)
    nor a dict of them with a "score" key, or a dict lacking a field that other rows returned.
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
               columns: dict[str, Sequence[Any]], on_error: str = "raise"
               ) -> tuple[list[float], dict[str, list[float]], int]:
    """(scores, extras, num_errors): the score of each row `fn(responses[row], ground_truths[row],
    **{k: v[row] for k, v in columns.items()})`, the further fields of a dict reward, and how many rows raised.

    `fn` returns a number (the score), or, as verl's compute_score may, a dict with the score under "score" and
    further numeric fields (reward components, diagnostics); `extras` maps each further field to its value per row.
    Every row must return the same fields. A row `fn` raises on: with on_error "raise", a RewardError naming the
    function, the row and the error; with "zero", a score (and extras) of 0.0, counted in num_errors. A value that
    is not a finite number, or a dict without "score" or without a field other rows returned, is a bug in `fn`:
    a RewardError either way.
    """
    if on_error not in REWARD_ON_ERROR:
        raise ValueError(f"on_error {on_error!r} is not one of {REWARD_ON_ERROR}")
    check_reward_columns(fn, name, columns)
    scores: list[float] = []
    extras: dict[str, list[float]] | None = None  # known from the first row that does not raise
    failed: list[int] = []  # rows scored 0 by on_error "zero"
    first_row = None  # the row whose fields the others must match
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
            failed.append(row)
            scores.append(0.0)
            continue
        try:
            score, row_extras = _split(value)
            if extras is None:
                extras, first_row = {k: [] for k in row_extras}, row
            _check_same_fields(row_extras, row, extras, first_row)
        except ValueError as e:
            raise RewardError(f"reward function {name!r} {e}\n{_describe_row(row, response, truth, fields)}") from None
        scores.append(score)
        for k, v in row_extras.items():
            extras[k].append(v)
    extras = extras or {}
    for row in failed:  # the fields of rows scored 0 are 0 as well
        for values in extras.values():
            values.insert(row, 0.0)
    return scores, extras, len(failed)


def _split(value: Any) -> tuple[float, dict[str, float]]:
    """(score, extra fields) of one returned value, each checked to be a finite number; ValueError says why not."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without a 'score' key (its keys: {sorted(value)}); a dict reward holds "
                             "the reward under 'score'")
        return (_finite(value["score"], "returned 'score'"),
                {str(k): _finite(v, f"returned field {k!r}") for k, v in value.items() if k != "score"})
    return _finite(value, "returned"), {}


def _finite(value: Any, what: str) -> float:
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{what} {_SHORT.repr(value)} (a {type(value).__name__}); a reward must be a finite number "
                         "(a float), or a dict of them with the reward under 'score'")
    return float(value)


def _check_same_fields(row_extras: dict, row: int, extras: dict, first_row: int) -> None:
    if row_extras.keys() == extras.keys():
        return
    missing, unexpected = sorted(extras.keys() - row_extras.keys()), sorted(row_extras.keys() - extras.keys())
    problem = (f"it lacks {', '.join(map(repr, missing))}" if missing
               else f"{', '.join(map(repr, unexpected))} is not among row {first_row}'s")
    raise ValueError(f"returned the fields {sorted(row_extras)} on row {row} but {sorted(extras)} on row {first_row}: "
                     f"{problem}; every row must return the same fields")


def _describe_row(row: int, response: str, truth: Any, fields: dict[str, Any]) -> str:
    lines = [f"  on row {row} of the batch:"]
    if "prompt" in fields:
        lines.append(f"    prompt:       {_SHORT.repr(fields['prompt'])}")
    lines += [f"    response:     {_SHORT.repr(response)}", f"    ground truth: {_SHORT.repr(truth)}"]
    return "\n".join(lines)
