"""Guess-the-number played by an agent program through the OpenAI-compatible endpoint: the game is the one
`GuessNumberEnv` plays (the same hidden number for the same seed), written here against the `openai` client alone.

Each guess is one chat request; the program reads the reply's first line as the guess and answers with a user
message "higher", "lower" or "invalid" until the guess is right (reward 1) or the guesses run out (reward 0).
"""

from __future__ import annotations

import random

from openai import OpenAI


def play(base_url: str, task: dict, seed: int, high: int = 7, max_turns: int = 3, api_key: str = "unused") -> dict:
    target = random.Random(task["env_seed"]).randint(1, high)  # as GuessNumberEnv.reset draws it
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    messages = [{"role": "user", "content": task["prompt"].strip()}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        guess = text.strip()
        if not guess.isdigit() or not 1 <= int(guess) <= high:
            messages.append({"role": "user", "content": "invalid"})
        elif int(guess) == target:
            return {"reward": 1.0, "success": 1.0}
        else:
            messages.append({"role": "user", "content": "higher" if int(guess) < target else "lower"})
    return {"reward": 0.0, "success": 0.0}
