"""The reward for each row: `reward_fn` is one reward (a registry name or an import path) or a mapping from a row's
`data_source` to one, and each function is called in baton's convention or in verl's."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from baton.rewards.registry import RewardFn, get_reward_fn, is_slow

DEFAULT_ROUTE = "default"  # the mapping's entry for rows whose data_source has no entry of its own
DATA_SOURCE = "data_source"  # the column that routes a row (verl's reward_fn_key)
UNKNOWN_DATA_SOURCE = "unknown"  # what a verl-style function gets as data_source for a row without the column
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")  # verl's compute_score keywords


def uses_verl_signature(fn: RewardFn) -> bool:
    """Whether `fn` is written for verl: it has parameters named `data_source` and `solution_str`, as verl's
    `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)` does. (A function with
    `solution_str` first and no `data_source`, `(solution_str, ground_truth, **kwargs)`, works in baton's convention
    as it is: the response comes first, data_source and extra_info among the fields.)"""
    try:
        return {"data_source", "solution_str"} <= inspect.signature(fn).parameters.keys()
    except (TypeError, ValueError):  # no signature to read (some builtins): baton's convention
        return False


@dataclass(frozen=True)
class Reward:
    """One reward function, its settings from the config (`kwargs`, the config's `reward_kwargs`), and how it is
    called on a row.

    baton's convention: `fn(response, ground_truth, **fields, **kwargs)`, every non-tensor column of the row by
    keyword. A parameter with a default (`format`'s `pattern`) is a setting: `kwargs` may set it, a row never does
    (a column of its name is refused, `check_columns`); a parameter without one takes the column of its name.
    verl's (`uses_verl_signature`: parameters named data_source and solution_str): `fn(data_source=...,
    solution_str=response, ground_truth=..., extra_info=..., **kwargs)`, as verl's reward managers call
    `compute_score` with its `reward_kwargs`: data_source is the row's `data_source` ("unknown" without that
    column, verl validation's name), extra_info a copy of its `extra_info` ({} without it, as verl's managers
    default it)."""

    name: str
    fn: RewardFn
    verl_style: bool
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    settings: frozenset[str] = frozenset()  # the keyword parameters no row may set (see above)
    slow: bool = False  # registered with slow=True: scored in processes with a time limit by default

    @classmethod
    def load(cls, name: str, kwargs: Mapping[str, Any] | None = None) -> "Reward":
        """The reward `name` with the settings `kwargs`; ValueError naming a setting the function does not take."""
        fn = get_reward_fn(name)
        verl_style, kwargs = uses_verl_signature(fn), dict(kwargs or {})
        _check_kwargs(fn, name, kwargs, verl_style)
        # verl's convention passes a row's fields inside extra_info, never as keywords: none can set a parameter
        settings = frozenset() if verl_style else frozenset(kwargs) | _defaulted_params(fn)
        return cls(name, fn, verl_style, kwargs, settings, is_slow(fn))

    def __call__(self, response: str, ground_truth: Any, fields: Mapping[str, Any]) -> Any:
        if self.verl_style:
            extra_info = fields.get("extra_info")
            extra_info = {} if extra_info is None else dict(extra_info) if isinstance(extra_info, Mapping) else extra_info
            return self.fn(data_source=fields.get(DATA_SOURCE, UNKNOWN_DATA_SOURCE), solution_str=response,
                           ground_truth=ground_truth, extra_info=extra_info,  # a copy: verl's functions may add keys
                           **self.kwargs)
        taken = self.settings & fields.keys()
        if taken:
            raise ValueError(self._setting_error(min(taken)))
        return self.fn(response, ground_truth, **fields, **self.kwargs)

    def check_columns(self, columns) -> None:
        """Raise ValueError unless this function binds the batch's non-tensor `columns` (see `check_reward_columns`)
        and none of them is one of its settings; a verl-style function takes verl's four keywords only and needs no
        more."""
        if self.verl_style:
            _check_verl_params(self.fn, self.name)
            return
        taken = self.settings & set(columns)
        if taken:
            raise ValueError(self._setting_error(min(taken)))
        check_reward_columns(self.fn, self.name, set(columns) | set(self.kwargs))

    def _setting_error(self, column: str) -> str:
        return setting_collision(self.name, column)


def setting_collision(reward: str, column: str) -> str:
    """The message for a data field named like one of reward `reward`'s settings."""
    return (f"the data field {column!r} has the name of reward function {reward!r}'s keyword parameter {column!r}, "
            "which rows may not set; rename the field, or set the value for every row in reward_kwargs")


def _defaulted_params(fn: RewardFn) -> frozenset[str]:
    """The keyword parameters of a baton-convention `fn` that have a default (its settings), past the two that take
    the response and the ground truth."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): nothing to protect
        return frozenset()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in named if p.kind == p.POSITIONAL_OR_KEYWORD][:2]
    return frozenset(p.name for p in named if p not in positional and p.default is not p.empty)


def _check_kwargs(fn: RewardFn, name: str, kwargs: Mapping[str, Any], verl_style: bool) -> None:
    if not kwargs:
        return
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: the call itself will tell
        return
    reserved = set(VERL_PARAMS) if verl_style else {p.name for p in list(params.values())[:2]}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    named = {p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key in kwargs:
        if key in reserved:
            raise ValueError(f"reward_kwargs {key!r}: reward function {name!r} gets {key!r} from each row, not from "
                             "the config; remove it from reward_kwargs")
        if key not in named and not takes_any:
            raise ValueError(f"reward_kwargs {key!r}: reward function {name!r} takes no parameter {key!r} (it takes "
                             f"{sorted(named - reserved)}); remove it, or add the parameter")


class RewardRoutes:
    """`reward_fn` resolved: one `Reward` for every row, or, from a mapping {data_source: reward}, the entry of the
    row's `data_source`, else the "default" entry; a row matching neither is a ValueError naming its source and the
    known ones. Import paths resolve as `get_reward_fn` resolves them (ValueError when one cannot).

    kwargs (the config's `reward_kwargs`): the settings each function is called with: for one reward, {name: value};
    for a mapping, {entry: {name: value}} with the mapping's own entries (data sources, "default") as keys, so that
    one function may serve two sources with different settings."""

    def __init__(self, spec: str | Mapping[str, str], kwargs: Mapping[str, Any] | None = None):
        self.spec, self.kwargs = spec, dict(kwargs or {})
        if isinstance(spec, str):
            self.rewards = {DEFAULT_ROUTE: Reward.load(spec, self.kwargs)}
            return
        if not spec:
            raise ValueError("the mapping from data_source to reward is empty; give one entry per data source (and "
                             f"{DEFAULT_ROUTE!r} for the others), or a single reward name")
        unknown = sorted(map(str, self.kwargs.keys() - spec.keys()))
        if unknown:
            raise ValueError(f"reward_kwargs {unknown[0]!r} is not an entry of reward_fn {sorted(map(str, spec))}: "
                             "with a mapping from data_source to reward, reward_kwargs maps those entries to their "
                             "settings ({entry: {name: value}})")
        rewards = {}
        for source, name in spec.items():
            settings = self.kwargs.get(source) or {}
            if not isinstance(settings, Mapping):
                raise ValueError(f"reward_kwargs {source!r} is {settings!r}; each entry is a mapping {{name: value}}")
            try:
                rewards[source] = Reward.load(name, settings)
            except ValueError as e:
                raise ValueError(f"entry {source!r}: {e}") from e
        self.rewards = rewards

    @property
    def slow(self) -> bool:
        """Whether any of the functions was registered slow (`register_reward(..., slow=True)`)."""
        return any(reward.slow for reward in self.rewards.values())

    @property
    def routed(self) -> bool:
        return not isinstance(self.spec, str)

    def route(self, fields: Mapping[str, Any]) -> str:
        """The key in `rewards` of the row whose non-tensor columns are `fields`."""
        if not self.routed:
            return DEFAULT_ROUTE
        if DATA_SOURCE not in fields:
            if DEFAULT_ROUTE in self.rewards:
                return DEFAULT_ROUTE
            raise ValueError(f"the row has no {DATA_SOURCE!r} column to pick its reward by, and reward_fn has no "
                             f"{DEFAULT_ROUTE!r} entry; add one, or a {DATA_SOURCE!r} field to the data")
        source = fields[DATA_SOURCE]
        if source in self.rewards:
            return source
        if DEFAULT_ROUTE in self.rewards:
            return DEFAULT_ROUTE
        known = sorted(map(str, self.rewards))
        raise ValueError(f"no reward for data_source {source!r}: reward_fn maps {known}; add an entry for it, or a "
                         f"{DEFAULT_ROUTE!r} entry for every other source")

    def check_columns(self, columns) -> None:
        for reward in self.rewards.values():
            reward.check_columns(columns)

    def describe(self) -> str:
        return repr(self.spec) if isinstance(self.spec, str) else repr(dict(self.spec))


def check_reward_columns(fn: RewardFn, name: str, columns) -> None:
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


def _check_verl_params(fn: RewardFn, name: str) -> None:
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    missing = [p for p in VERL_PARAMS if p not in params and not takes_any]
    required = [p.name for p in params.values() if p.name not in VERL_PARAMS and p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing or required:
        problem = (f"takes no parameter {', '.join(map(repr, missing))}" if missing
                   else f"requires {', '.join(map(repr, required))}, which verl does not pass")
        raise ValueError(f"reward function {name!r} has verl's parameters 'data_source' and 'solution_str', so it is "
                         f"called as verl calls compute_score, with the keywords {list(VERL_PARAMS)}; but it {problem}")


# baton's own columns, beside the data's other fields, that each row's reward gets by keyword (the trainer's batches;
# the rollout system's samples carry the prompt only).
BATCH_COLUMNS = ("prompt", "uid", "finish_reason")


def check_reward_signatures(routes: RewardRoutes, data_fields, *, prompt_key: str = "prompt",
                            answer_key: str | None = "answer", batch_columns=BATCH_COLUMNS) -> None:
    """Before anything starts: every function of `routes` can be called on a row as it will be, with the names that
    reach it (`batch_columns` and the data's other fields `data_fields`) and its reward_kwargs, read from its signature
    (it is not called). ValueError naming the problem, what the function gets under which names (the data's
    `prompt_key` and `answer_key` fields among them) and the fix."""
    columns = [*batch_columns, *sorted(set(data_fields) - set(batch_columns))]
    for reward in routes.rewards.values():
        try:
            reward.check_columns(columns)
            _check_binds(reward, columns, prompt_key, answer_key)
        except ValueError as e:  # the description ends with how to write it: the column check's own fix goes
            problem = str(e).removesuffix("; add **fields to its signature")
            raise ValueError(f"{problem}. {describe_call(reward, columns, prompt_key, answer_key)}") from None


def _check_binds(reward: Reward, columns: list[str], prompt_key: str, answer_key: str | None) -> None:
    try:
        signature = inspect.signature(reward.fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call itself will tell
        return
    if reward.verl_style:
        row = {name: None for name in VERL_PARAMS}
        args, kwargs = (), {**row, **reward.kwargs}
    else:
        args, kwargs = ("response", "ground_truth"), {**{c: None for c in columns}, **reward.kwargs}
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        problem = str(e).rstrip(".")
        missing = re.search(r"missing a required (?:keyword-only )?argument: '(\w+)'", problem)
        if missing and missing.group(1) == prompt_key and prompt_key != "prompt":
            problem += f" (the data's {prompt_key!r} field reaches the reward as 'prompt')"
        elif missing and answer_key and missing.group(1) == answer_key:
            problem += f" (the data's {answer_key!r} field reaches the reward as its second argument, the ground truth)"
        raise ValueError(f"reward function {reward.name!r} cannot be called on a row: {problem}") from None


def describe_call(reward: Reward, columns: list[str], prompt_key: str = "prompt", answer_key: str | None = "answer") -> str:
    """How `reward` is called on a row, name by name, and how to write it."""
    answer = f"the data's {answer_key!r} field (data.answer_key)" if answer_key else "the row's answer"
    if reward.verl_style:
        return (f"It has verl's parameters, so it is called as verl calls compute_score: data_source= the row's "
                f"'data_source' field ({UNKNOWN_DATA_SOURCE!r} without one), solution_str= the decoded response, "
                f"ground_truth= {answer}, extra_info= the row's 'extra_info' field ({{}} without one); write it as "
                "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)")
    own = [c for c in columns if c not in BATCH_COLUMNS]
    prompt = "the prompt text" + (f", the data's {prompt_key!r} field, data.prompt_key" if prompt_key != "prompt" else "")
    batch = [f"prompt ({prompt})" if c == "prompt" else c for c in columns if c in BATCH_COLUMNS]
    others = f", and the data's other fields {', '.join(map(repr, own))}" if own else ""
    setting = f"; its reward_kwargs {sorted(reward.kwargs)} by keyword too" if reward.kwargs else ""
    function = reward.name.rpartition(":")[2] or "score"
    return (f"It is called on each row as {function}(response, ground_truth, **fields): the decoded response, {answer}, "
            f"then by keyword {', '.join(batch)}{others}{setting}; write it as "
            f"def {function}(response, ground_truth, **fields) and read what it needs from fields")
