"""The string-reversal reward: 1.0 for the exact reversed word, else partial credit for each right character.

Partial credit (at most 0.5) gives GRPO a signal before any sample is exactly right; validation counts a
response as correct only when its reward is >= 1, so accuracy stays exact match.
"""


def score(response: str, ground_truth: str, **fields) -> float:
    answer = response.strip()
    if answer == ground_truth:
        return 1.0
    right = sum(a == b for a, b in zip(answer, ground_truth))
    return 0.5 * right / max(len(answer), len(ground_truth), 1)
