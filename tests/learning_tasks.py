"""Tasks small enough to learn in seconds on one core, for tests/test_learning.py: a contextual bandit over the
character tokenizer whose untrained reward is far from 0, and a two-turn environment on the same idea.

The bandit: prompts "l00:".."l23:", "u00:".."u23:" to train on and "l24:".."l31:", "u24:".."u31:" held out; a
response earns 1 when its first character is a lowercase
letter after an "l" prompt, an uppercase one after a "u" prompt. The untrained tiny model spreads its first token
over ~100 characters, so about a quarter of its answers score; a trained one scores nearly always. Light imports:
an environment process imports this module by path."""

from __future__ import annotations

import json
import os
import string
from typing import Any

LOWER, UPPER = string.ascii_lowercase, string.ascii_uppercase
TARGETS = {"l": LOWER, "u": UPPER}
TRAIN_PROMPTS = [f"{kind}{i:02d}:" for kind in TARGETS for i in range(24)]
VAL_PROMPTS = [f"{kind}{i:02d}:" for kind in TARGETS for i in range(24, 32)]
# What SFT imitates: one character of the right set per prompt.
DEMOS = {prompt: TARGETS[prompt[0]][(3 * int(prompt[1:-1]) + 2) % 26] for prompt in TRAIN_PROMPTS + VAL_PROMPTS}


def first_in_set(response: str, ground_truth: str, **fields) -> float:
    """1 when the response's first character is one of `ground_truth`'s characters, else 0."""
    return float(bool(response) and response[0] in ground_truth)


def write_bandit(directory: str, kinds: str = "lu") -> tuple[str, str]:
    """The bandit's training and held-out prompts of `kinds` ("l", "u" or both) as jsonl files (answer: the
    characters that score; demo: SFT's response); their paths."""
    paths = []
    for name, prompts in (("train", TRAIN_PROMPTS), ("val", VAL_PROMPTS)):
        paths.append(os.path.join(directory, f"bandit_{name}.jsonl"))
        with open(paths[-1], "w") as f:
            for prompt in (p for p in prompts if p[0] in kinds):
                f.write(json.dumps({"prompt": prompt, "answer": TARGETS[prompt[0]], "demo": DEMOS[prompt]}) + "\n")
    return paths[0], paths[1]


def write_pairs(directory: str, kinds: str = "lu") -> str:
    """DPO pairs on the training prompts of `kinds`: each character that does not score (the other letters, digits,
    punctuation and space) rejected once for each prompt, against one that does (in turn)."""
    path = os.path.join(directory, "pairs.jsonl")
    with open(path, "w") as f:
        for prompt in (p for p in TRAIN_PROMPTS if p[0] in kinds):
            chosen = TARGETS[prompt[0]]
            rejected = [c for c in string.printable[:95] if c not in chosen]
            for k, wrong in enumerate(rejected):
                f.write(json.dumps({"prompt": prompt, "chosen": chosen[k % len(chosen)], "rejected": wrong}) + "\n")
    return path


class TwoDoorsEnv:
    """Two turns of one character each: after "go" a lowercase letter opens the first door ("ok", reward
    `first_reward`), after "ok" an uppercase letter the second ("win", the rest of 1); a wrong character ends the
    episode ("no"). The untrained model earns about first_reward * 0.26 + (1 - first_reward) * 0.26 ** 2; one that
    learned the first turn only, first_reward; one that learned both, 1."""

    def __init__(self, first_reward: float = 0.25):
        self.first_reward = first_reward
        self.doors_open = None

    def reset(self, seed: int) -> str:
        self.doors_open = 0
        return "go\n"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.doors_open is None:
            raise RuntimeError("step() before reset()")
        wanted = LOWER if self.doors_open == 0 else UPPER
        if not action or action[0] not in wanted:
            return "no\n", 0.0, True, {}
        self.doors_open += 1
        if self.doors_open == 1:
            return "ok\n", self.first_reward, False, {}
        return "win\n", 1.0 - self.first_reward, True, {}
