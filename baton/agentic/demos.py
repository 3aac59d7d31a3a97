"""Demonstration games for the agentic example's warm-up: guess-the-number played by a weak teacher that guesses
uniformly among the numbers the hints leave (never the middle on purpose), written as SFT rows: the first
observation as the prompt, the whole game after it (its guesses and the hints) as the response.

    .venv/bin/python -m baton.agentic.demos   # rewrites baton/agentic/data/guess_number_demos.jsonl (and _chat_)
"""

from __future__ import annotations

import json
import os
import random

from baton.agentic.env import GuessNumberEnv
from baton.agentic.rollout import VAL_SEED_OFFSET

DEMOS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "guess_number_demos.jsonl")
# The same games as chat conversations, for the agent example (`baton.agentic.agents.guess_number` through the
# endpoint): the first user message rendered with the tokenizer's chat template as the prompt, the rest after it.
CHAT_DEMOS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "guess_number_chat_demos.jsonl")
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


def as_chat(row: dict, tokenizer) -> dict:
    """A game of `guess_number_demonstrations` as the agent plays it: each guess an assistant message, each hint a
    user message, rendered with `tokenizer`'s chat template (the prompt: the first message and the generation
    prompt; the response: the rest of the conversation, through the last guess)."""
    turns = row["response"].splitlines()  # guess, hint, guess, hint, ..., the last hint ("correct" or not)
    messages = [{"role": "user", "content": row["prompt"].strip()}]
    for i, line in enumerate(turns[:-1]):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": line})
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert whole.startswith(prompt)
    return {"prompt": prompt, "answer": row["answer"], "response": whole[len(prompt):], "won": row["won"]}


def main() -> None:
    from baton.models import load_tokenizer

    rows = guess_number_demonstrations()
    tokenizer = load_tokenizer()
    for path, out in ((DEMOS_FILE, rows), (CHAT_DEMOS_FILE, [as_chat(row, tokenizer) for row in rows])):
        with open(path, "w") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")
        print(f"{path}: {len(out)} games, {sum(r['won'] for r in out) / len(out):.1%} won")


if __name__ == "__main__":
    main()
