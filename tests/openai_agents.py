"""Agent programs for tests/test_agent_endpoint.py, written against the `openai` client only (no baton import), as a
user's would be. An environment process imports this module to run them."""

from __future__ import annotations

import json
import os
import random

from openai import OpenAI


def guess_number(base_url: str, task: dict, seed: int, high: int = 8, max_turns: int = 4,
                 log_dir: str | None = None) -> dict:
    """Guess a hidden number in [1, high] (drawn from the task's env_seed) from "higher"/"lower" hints, one chat
    request per guess. With `log_dir`, each episode writes what the endpoint returned (each reply's token ids and
    text) and the conversation it sent, for the test to compare with what trained."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    target = random.Random(task["env_seed"]).randint(1, high)
    messages = [{"role": "user", "content": task["prompt"].strip()}]
    replies = []
    reward = 0.0
    for _ in range(max_turns):
        completion = client.chat.completions.create(model="baton-policy", messages=messages, max_tokens=6)
        choice = completion.choices[0]
        text = choice.message.content or ""
        replies.append({"token_ids": (choice.model_extra or {}).get("token_ids"), "text": text,
                        "finish_reason": choice.finish_reason})
        messages.append({"role": "assistant", "content": text})
        guess = text.strip()
        if guess.isdigit() and int(guess) == target:
            reward = 1.0
            break
        hint = "invalid" if not guess.isdigit() or not 1 <= int(guess) <= high else \
            "higher" if int(guess) < target else "lower"
        messages.append({"role": "user", "content": hint})
    if log_dir is not None:
        with open(os.path.join(log_dir, f"episode-{task['env_seed']}-{seed}.json"), "w") as f:
            json.dump({"replies": replies, "messages": messages}, f)
    return {"reward": reward, "success": reward}


def misbehaves(base_url: str, task: dict, seed: int) -> float:
    """On odd env seeds, raises after one request. On even ones, makes two requests, the second with the first reply
    left out and the other messages changed: the endpoint cannot continue the sequence and starts it again."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    first = [{"role": "system", "content": "one"}, {"role": "user", "content": task["prompt"].strip()}]
    client.chat.completions.create(model="baton-policy", messages=first, max_tokens=3)
    if task["env_seed"] % 2:
        raise RuntimeError("the agent's own bug")
    second = [{"role": "system", "content": "two"}, {"role": "user", "content": "again"}]
    client.chat.completions.create(model="baton-policy", messages=second, max_tokens=3)
    return 0.5
