"""Demonstration games for the agentic example's warm-up: guess-the-number played by a weak teacher that guesses
uniformly among the numbers the hints leave (never the middle on purpose), written as SFT rows: the first
observation as the prompt, the whole game after it (its guesses and the hints) as the response.

    .venv/bin/python -m baton.agentic.demos   # rewrites baton/agentic/data/guess_number_demos.jsonl
"""

from __future__ import annotations

import json
import os
import random

from baton.agentic.env import GuessNumberEnv
from baton.agentic.rollout import VAL_SEED_OFFSET

DEMOS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "guess_number_demos.jsonl")
HIGH, MAX_TURNS, NUM_GAMES = 7, 3, 2000


def guess_number_demonstrations(num_games: int = NUM_GAMES, high: int = HIGH, max_turns: int = MAX_TURNS,
                                seed: int = 0) -> list[dict]:
    """`num_games` games on training episodes (environment seeds below VAL_SEED_OFFSET), each up to `max_turns`
    guesses: rows {prompt, answer (the hidden number), response, won}."""
    rng, env, rows = random.Random(seed), GuessNumberEnv(high), []
    for episode in range(num_games):
        prompt = env.reset(episode)
        assert episode < VAL_SEED_OFFSET
        low, top, text, won = 1, high, "", False
        for _ in range(max_turns):
            guess = rng.randint(low, top)
            observation, reward, done, _ = env.step(str(guess))
            text += f"{guess}\n{observation}"
            if done:
                won = True
                break
            low, top = (guess + 1, top) if observation == "higher\n" else (low, guess - 1)
        rows.append({"prompt": prompt, "answer": str(env.target), "response": text, "won": won})
    return rows


def main() -> None:
    rows = guess_number_demonstrations()
    with open(DEMOS_FILE, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{DEMOS_FILE}: {len(rows)} games, {sum(r['won'] for r in rows) / len(rows):.1%} won")


if __name__ == "__main__":
    main()
