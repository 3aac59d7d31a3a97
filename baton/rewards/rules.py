"""Rule-based rewards: exact match (also split into format and correctness), math answers (\\boxed{...} or the last
number, normalised), answer format."""

from __future__ import annotations

import re
from fractions import Fraction

from baton.rewards.registry import register_reward

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
# Numbers past these bounds are compared as text: a model's "1e99999999" would otherwise hold the interpreter for
# minutes building 10**99999999, and a result past Python's 4300-digit int-to-str limit raises.
MAX_NUMBER_DIGITS = 1000
MAX_NUMBER_EXPONENT = 1000
_EXPONENT = re.compile(r"[eE]([+-]?\d+)")


def extract_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str | None:
    """The boxed answer if there is one, else the last number in the text, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical form: numbers as reduced fractions/integers ("1,000" = "1000.0" = "2000/2"), else
    lower-case text without spaces, `$` or a trailing period. A number with more than MAX_NUMBER_DIGITS digits or
    an exponent beyond MAX_NUMBER_EXPONENT stays text (it matches only the same text)."""
    text = answer.strip().strip("$").rstrip(".").replace(" ", "")
    text = re.sub(r"^\\text\{(.*)\}$", r"\1", text)
    number = text.replace(",", "")
    try:
        exponent = _EXPONENT.search(number)
        if sum(c.isdigit() for c in number) > MAX_NUMBER_DIGITS or (
                exponent is not None and abs(int(exponent.group(1))) > MAX_NUMBER_EXPONENT):
            raise ValueError("too large to compare as a number")
        value = Fraction(number)
        return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    except (ValueError, ZeroDivisionError):
        return text.lower()


@register_reward("math")
def math_reward(response: str, ground_truth: str, **fields) -> float:
    """1.0 when the response's final answer equals the ground truth after normalisation; else 0.0."""
    answer = extract_answer(response)
    return float(answer is not None and normalize_answer(answer) == normalize_answer(str(ground_truth)))


@register_reward("format")
def format_reward(response: str, ground_truth: str, pattern: str = r"\\boxed\{.+\}", **fields) -> float:
    """1.0 when the response contains the expected answer format (default: a \\boxed{} answer)."""
    return float(re.search(pattern, response, flags=re.DOTALL) is not None)


@register_reward("exact_match")
def exact_match(response: str, ground_truth: str, **fields) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth; else 0.0."""
    return float(response.strip() == str(ground_truth).strip())


_INTEGER = re.compile(r"-?\d+")


@register_reward("exact_match_parts")
def exact_match_parts(response: str, ground_truth: str, **fields) -> dict[str, float]:
    """`exact_match` as its score, with two reward components (for GDPO's `gdpo_reward_keys`): "format", 1.0 when
    the stripped response is an integer, and "correct", 1.0 when it equals the ground truth."""
    answer = response.strip()
    correct = float(answer == str(ground_truth).strip())
    return {"score": correct, "format": float(_INTEGER.fullmatch(answer) is not None), "correct": correct}
