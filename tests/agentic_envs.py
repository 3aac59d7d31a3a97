"""Environments that misbehave, for tests/test_agentic.py: a module of their own with light imports, as an
environment process imports the module that defines its environment."""

from __future__ import annotations

import os
import random
import time

from baton.agentic.env import GuessNumberEnv


class BrokenEnv(GuessNumberEnv):
    """Guess-the-number whose odd seeds raise in reset, whose seeds divisible by 4 hang in step, and whose seed 6
    kills its process in step."""

    def reset(self, seed: int) -> str:
        if seed % 2:
            raise ValueError(f"seed {seed} is broken")
        self.seed = seed
        return super().reset(seed)

    def step(self, action: str):
        if self.seed % 4 == 0:
            time.sleep(3600)
        if self.seed == 6:
            os._exit(1)
        return super().step(action)


class FlakyEnv(GuessNumberEnv):
    """Guess-the-number that raises in step for seeds 1 mod 4 and hangs for seeds 3 mod 4 (its resets work, so
    the driver can build the prompts)."""

    def reset(self, seed: int) -> str:
        self.seed = seed
        return super().reset(seed)

    def step(self, action: str):
        if self.seed % 4 == 1:
            raise RuntimeError("the game crashed")
        if self.seed % 4 == 3:
            time.sleep(3600)
        return super().step(action)


class LuckyGuessEnv(GuessNumberEnv):
    """Guess-the-number where a guess whose characters' codes sum to a multiple of 4 wins: an untrained model wins
    some episodes in one turn or more and loses others, so success, turns and score vary."""

    def step(self, action: str):
        if sum(map(ord, action)) % 4 == 0:
            return "correct\n", 1.0, True, {"valid": True}
        return super().step(action)


class CountingEnv:
    """Counts the turns it has answered ("seen 1", "seen 2", ...; done at `turns`, reward 1): its state is more than
    its seed, so a resumed episode shows whether it was restored. `saves`: whether it has state_dict at all."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, seed: int) -> str:
        self.seen = 0
        return "count\n"

    def step(self, action: str):
        self.seen += 1
        return f"seen {self.seen}\n", float(self.seen == self.turns), self.seen == self.turns, {}

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])


class ForgetfulCountingEnv:
    """`CountingEnv` without `state_dict`: an episode cut short is played again from the start."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    reset, step = CountingEnv.reset, CountingEnv.step


class JitteryLuckyGuessEnv(LuckyGuessEnv):
    """`LuckyGuessEnv` whose answers take a random 0–20 ms (not seeded): its episodes' next turns reach the engines in
    an order and at times no seed fixes."""

    def step(self, action: str):
        time.sleep(random.SystemRandom().uniform(0.0, 0.02))
        return super().step(action)


class SlowCountingEnv(CountingEnv):
    """`CountingEnv` whose answers take 1 s: an episode spends its time waiting on it."""

    def step(self, action: str):
        time.sleep(1.0)
        return super().step(action)
