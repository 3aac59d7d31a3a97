"""Environments for multi-turn RL: the `Env` protocol and the shipped text environments.

An environment is a plain object: `reset(seed) -> observation` starts an episode (the same seed, the same episode),
`step(action) -> (observation, reward, done, info)` answers one model turn. Observations are text the model reads
next; a turn's reward is a number (the trajectory's reward sums them). An environment that can save an episode in
the middle also has `state_dict() -> dict` (JSON-safe: numbers, strings, lists, dicts) and `load_state_dict(state)`
(called after `reset` with the episode's seed): an episode cut short by an abort, with partial rollouts on, is then
kept with its turns and continues from there when drawn again, a checkpoint in between included; without them it
is played again from the start. Environments run in processes of their own
(`baton.agentic.pool.EnvPool`), so one that hangs or crashes costs its trajectory, not the step.

`ENVIRONMENTS` names the shipped ones; a config's `agentic.env` is one of those names or the import path of the user's
own factory ("package.module:Class", a class or function that takes `env_kwargs` and returns an `Env`). Shipped (both
fit the character tokenizer: printable ASCII, one line per turn):

- "guess_number", `GuessNumberEnv`: a hidden number in [1, high]; each turn the model writes a guess, the environment
  answers "higher", "lower" (or "invalid" for a line that is not a number in range) until it says "correct" (reward 1).
- "calculator", `CalculatorEnv`: an arithmetic question; the model may write `calc <expression>` (the environment
  answers `= <value>`) before it writes `answer <number>` (reward 1 if right, 0 if wrong; the episode ends there).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any, Callable, Protocol, runtime_checkable

from baton.config.registry import Registry


@runtime_checkable
class Env(Protocol):
    def reset(self, seed: int) -> str:
        """Start an episode; the first observation (what the model reads before its first turn)."""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One model turn (its text, stop token excluded): (observation, reward, done, info)."""


ENVIRONMENTS: Registry[Callable[..., Env]] = Registry("environment")


@ENVIRONMENTS.register("guess_number")
class GuessNumberEnv:
    """Guess a hidden number in [1, high] from "higher"/"lower" hints. A guess is a line holding one integer;
    anything else is "invalid" (reward 0, the episode goes on)."""

    def __init__(self, high: int = 8):
        if high < 2:
            raise ValueError(f"GuessNumberEnv: high={high} must be >= 2")
        self.high = high
        self.target: int | None = None

    def reset(self, seed: int) -> str:
        self.target = random.Random(seed).randint(1, self.high)
        return f"guess 1-{self.high}\n"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.target is None:
            raise RuntimeError("step() before reset()")
        text = action.strip()
        if not re.fullmatch(r"\d+", text) or not 1 <= int(text) <= self.high:
            return "invalid\n", 0.0, False, {"valid": False}
        guess = int(text)
        if guess == self.target:
            return "correct\n", 1.0, True, {"valid": True}
        return ("higher\n" if guess < self.target else "lower\n"), 0.0, False, {"valid": True}

    def state_dict(self) -> dict[str, Any]:
        return {"target": self.target}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target = int(state["target"])


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate_arithmetic(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses (ValueError for anything else: no names,
    calls or other syntax is evaluated)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression of + - *: {expression!r}")

    if len(expression) > 64:
        raise ValueError("expression longer than 64 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an expression: {expression!r}") from error
    return value(tree.body)


@ENVIRONMENTS.register("calculator")
class CalculatorEnv:
    """"What is a*b+c?" with a calculator tool: `calc <expression>` is answered with `= <value>` (or `= error`),
    `answer <number>` ends the episode (reward 1 if right). Any other line: "use calc or answer"."""

    def __init__(self, max_operand: int = 20):
        self.max_operand = max_operand
        self.question: str | None = None
        self.value: int | None = None

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        a, b, c = (rng.randint(2, self.max_operand) for _ in range(3))
        self.question = f"{a}*{b}+{c}"
        self.value = a * b + c
        return f"what is {self.question}?\n"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.value is None:
            raise RuntimeError("step() before reset()")
        text = action.strip()
        if text.startswith("calc "):
            try:
                return f"= {evaluate_arithmetic(text[5:])}\n", 0.0, False, {"tool": True}
            except ValueError:
                return "= error\n", 0.0, False, {"tool": True}
        if text.startswith("answer "):
            right = text[7:].strip() == str(self.value)
            return ("right\n" if right else "wrong\n"), float(right), True, {"tool": False}
        return "use calc or answer\n", 0.0, False, {"tool": False}

    def state_dict(self) -> dict[str, Any]:
        return {"question": self.question, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.question, self.value = str(state["question"]), int(state["value"])


__all__ = ["ENVIRONMENTS", "CalculatorEnv", "Env", "GuessNumberEnv", "evaluate_arithmetic"]
