"""Calling the reward functions on a batch's rows: which function scores a row, a row one raises on or runs past its
time limit on, what they return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

from baton.rewards.pool import Outcome, ScoringPool, ScoringProcessError, Task
from baton.rewards.routing import DATA_SOURCE, RewardRoutes
from baton.rewards.values import PRED, SHORT, split_value

REWARD_ON_ERROR = ("raise", "zero")  # what score_rows does when the function raises on a row
REWARD_EXTRA_PREFIX = "reward_extra/"  # a dict reward's further fields, as the reward worker's columns "<prefix><key>"


class RewardError(RuntimeError):
    """A reward function raised on a row or ran past its time limit there, or returned something that is not a finite
    number (a bool counts as 0/1) nor a dict of them with a "score" key (and maybe a string "pred"), or a dict
    lacking a field that other rows returned; or a row's data_source has no reward.
    Names the function, the row (its prompt, response and ground truth) and the value or the error (its __cause__)."""


@dataclass
class Scores:
    """`score_rows`' result, one entry per row in each list.

    extras: each further numeric field of a dict reward; 0.0 on rows scored 0 for an error, and on rows whose
    function (under a data_source mapping) does not return that field. preds: the "pred" field (the extracted
    answer) where a row's function returns one, else None; None when no row has one."""

    scores: list[float]
    extras: dict[str, list[float]]
    preds: list[str | None] | None
    num_errors: int  # rows scored 0 by on_error "zero", timeouts included
    num_timeouts: int


def score_rows(rewards: RewardRoutes | str | Mapping[str, str], responses: Sequence[str],
               ground_truths: Sequence[Any], columns: dict[str, Sequence[Any]], on_error: str = "raise",
               pool: ScoringPool | None = None) -> Scores:
    """Score each row with its reward (`RewardRoutes`: the one reward, or its data_source's), called in baton's
    convention, `fn(responses[row], ground_truths[row], **{k: v[row] for k, v in columns.items()})`, or, for a
    function with parameters named `data_source` and `solution_str`, in verl's (`fn(data_source=, solution_str=,
    ground_truth=, extra_info=)`, see `routing.Reward`). In this process, one row after another, or with `pool` in its processes,
    concurrently, each row cut off after the pool's timeout_s_per_row (see `scoring_pool` for when baton uses one by
    default). `rewards` given as a name or mapping is called without settings: pass `RewardRoutes(spec, kwargs)`
    for the config's reward_kwargs.

    A function returns a number (the score), or, as verl's compute_score may, a dict with the score under "score",
    further numeric fields (reward components, diagnostics) and maybe "pred", the extracted answer as a string.
    Each function must return the same fields on every row. A row a function raises on or runs out of time on: with
    on_error "raise", a RewardError naming the function, the row and the error; with "zero", a score (and extras) of
    0.0, counted in num_errors (and num_timeouts); a pool with on_timeout "zero" scores its timed-out rows so under
    either. A value that is not a finite number, or a dict without "score" or
    without a field the function returned on other rows, is a bug in the function: a RewardError either way.
    """
    if on_error not in REWARD_ON_ERROR:
        raise ValueError(f"on_error {on_error!r} is not one of {REWARD_ON_ERROR}")
    routes = rewards if isinstance(rewards, RewardRoutes) else RewardRoutes(rewards)
    routes.check_columns(columns)
    tasks: list[Task] = []
    for row, (response, truth) in enumerate(zip(responses, ground_truths)):
        fields = {k: v[row] for k, v in columns.items()}
        try:
            key = routes.route(fields)
        except ValueError as e:
            raise RewardError(f"reward_fn {routes.describe()}: {e}\n{_describe_row(row, response, truth, fields)}") from None
        tasks.append((key, response, truth, fields))
    outcomes = pool.score(tasks) if pool is not None else _score_here(routes, tasks)
    scores: list[float] = []
    row_fields: list[dict[str, Any] | None] = []  # each row's further fields; None for a row scored 0 on error
    first_rows: dict[str, int] = {}  # route -> the row whose fields that function's other rows must match
    num_errors = num_timeouts = 0
    on_timeout = (pool.on_timeout if pool is not None else None) or on_error
    for row, ((key, response, truth, fields), outcome) in enumerate(zip(tasks, outcomes)):
        name = routes.rewards[key].name
        if outcome.timed_out or outcome.error is not None:
            if (on_timeout if outcome.timed_out else on_error) == "raise":
                raise _row_error(name, row, response, truth, fields, outcome, pool)
            num_errors += 1
            num_timeouts += outcome.timed_out
            scores.append(0.0)
            row_fields.append(None)
            continue
        try:
            if outcome.invalid is not None:
                raise ValueError(outcome.invalid)
            score, extra = split_value(outcome.value)
            first = first_rows.setdefault(key, row)
            _check_same_fields(extra, row, row_fields[first] if first != row else extra, first)
        except ValueError as e:
            raise RewardError(f"reward function {name!r} {e}\n{_describe_row(row, response, truth, fields)}") from None
        scores.append(score)
        row_fields.append(extra)
    names = list(dict.fromkeys(k for extra in row_fields if extra for k in extra))
    extras = {k: [float(extra.get(k, 0.0)) if extra else 0.0 for extra in row_fields] for k in names if k != PRED}
    preds = [extra.get(PRED) if extra else None for extra in row_fields] if PRED in names else None
    return Scores(scores, extras, preds, num_errors, num_timeouts)


def _score_here(routes: RewardRoutes, tasks: Iterable[Task]) -> Iterator[Outcome]:
    for key, response, truth, fields in tasks:
        try:
            yield Outcome(value=routes.rewards[key](response, truth, fields))
        except Exception as e:  # the user's function: any error, reported with its row or counted
            yield Outcome(error=e)


def _row_error(name: str, row: int, response: str, truth: Any, fields: dict, outcome: Outcome,
               pool: ScoringPool | None) -> RewardError:
    where = _describe_row(row, response, truth, fields)
    if outcome.timed_out:
        return RewardError(
            f"reward function {name!r} timed out after {pool.timeout_s_per_row} s (reward.timeout_s_per_row) and its "
            f"scoring process was killed\n{where}\nMake the function faster, raise reward.timeout_s_per_row, or score "
            "such rows 0 (counted as reward/num_errors and reward/num_timeouts) with reward_on_error: zero")
    e = outcome.error
    kind = e.type_name if isinstance(e, ScoringProcessError) else type(e).__name__
    error = RewardError(f"reward function {name!r} raised {kind}: {e}\n{where}\n"
                        "Fix the function, or score the rows it raises on 0 (counted as reward/num_errors) with "
                        "reward_on_error: zero")
    error.__cause__ = e
    return error


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
        lines.append(f"    prompt:       {SHORT.repr(fields['prompt'])}")
    if DATA_SOURCE in fields:
        lines.append(f"    data_source:  {SHORT.repr(fields[DATA_SOURCE])}")
    lines += [f"    response:     {SHORT.repr(response)}", f"    ground truth: {SHORT.repr(truth)}"]
    return "\n".join(lines)
