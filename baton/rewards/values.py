"""What a reward function may return, checked: a finite number, or a dict of them with the reward under "score" (and a
string "pred"). Used where a row is scored: in this process (`scoring`) and in a scoring process (`pool`)."""

from __future__ import annotations

import math
import numbers
import reprlib
from typing import Any

PRED = "pred"  # verl's field for the extracted answer: a string, the one further field that need not be a number
SHORT = reprlib.Repr()  # row values in messages, long ones cut in the middle
SHORT.maxstring = SHORT.maxother = 160


def check_value(value: Any) -> float | dict[str, Any]:
    """What a reward function returned, as plain data: a float, or a dict of the score and further fields (floats,
    "pred" a string or None); ValueError says why it is not a reward. What a scoring process sends back."""
    score, extra = split_value(value)
    return {"score": score, **extra} if isinstance(value, dict) else score


def split_value(value: Any) -> tuple[float, dict[str, Any]]:
    """(score, further fields) of one returned value, each checked to be a finite number ("pred" a string or None);
    ValueError says why not."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without a 'score' key (its keys: {sorted(value)}); a dict reward holds "
                             "the reward under 'score'")
        return (_finite(value["score"], "returned 'score'"),
                {str(k): _pred(v) if k == PRED else _finite(v, f"returned field {k!r}")
                 for k, v in value.items() if k != "score"})
    return _finite(value, "returned"), {}


def _pred(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Real):
        return str(value)
    raise ValueError(f"returned field 'pred' {SHORT.repr(value)} (a {type(value).__name__}); 'pred' is the extracted "
                     "answer that validation's maj@k votes on: a string")


def _finite(value: Any, what: str) -> float:
    try:
        finite = isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{what} {SHORT.repr(value)} (a {type(value).__name__}); a reward must be a finite number "
                         "(a float), or a dict of them with the reward under 'score' (and a string 'pred')")
    return float(value)
