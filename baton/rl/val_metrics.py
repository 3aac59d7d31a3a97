"""Validation statistics of several samples per prompt, named as verl logs them: for each data source and each score,
mean@n, std@n, best@k, worst@k and maj@k over one prompt's samples, averaged over the source's prompts.

Where baton differs from verl's `process_validation_metrics`: best@k and worst@k are exact expectations over the
size-k subsets of a prompt's n samples (drawn without replacement), not a bootstrap of 1000 draws with replacement;
for a 0/1 score best@k is then the unbiased pass@k estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), and
best@n is the best of the n samples (verl's bootstrap puts it lower: its draws repeat samples). So there is no
best@k/std or worst@k/std (verl's spread of its bootstrap; over exact subsets it is 0 at k = n, a val-core column).
maj@k, whose exact value is combinatorial, is verl's bootstrap with verl's draws (seed 42, 1000 draws of k with
replacement; the answer drawn first wins a tie), maj@k/std included.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import lru_cache
from typing import Sequence

import numpy as np

from baton.rewards.routing import UNKNOWN_DATA_SOURCE

NUM_BOOTSTRAP_DRAWS, BOOTSTRAP_SEED = 1000, 42  # verl's bootstrap_metric defaults
CORE_PREFIXES = ("mean@", "maj@", "best@")  # verl's val-core metrics, at the largest sample count


def sample_sizes(n: int) -> list[int]:
    """verl's subset sizes k for a prompt with n samples: 2, 4, 8, … below n, then n; none for n <= 1."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n] if n > 1 else []


@lru_cache(maxsize=256)
def _max_weights(n: int, k: int) -> np.ndarray:
    """[n] P(the i-th smallest of n values is the largest of a uniformly drawn size-k subset) = C(i, k-1) / C(n, k)."""
    total = math.comb(n, k)
    return np.array([math.comb(i, k - 1) / total for i in range(n)])  # int / int: exact before rounding, no overflow


def expected_best(values: np.ndarray, k: int) -> float:
    """The mean of the largest of k of `values` over all C(n, k) subsets without replacement, exactly.
    For 0/1 values with c ones it is the unbiased pass@k, 1 - C(n-c, k) / C(n, k)."""
    if not 1 <= k <= len(values):
        raise ValueError(f"a subset of k={k} of {len(values)} values")
    return float(_max_weights(len(values), k) @ np.sort(np.asarray(values, dtype=np.float64)))


def expected_worst(values: np.ndarray, k: int) -> float:
    """The mean of the smallest of k of `values` over all size-k subsets, exactly."""
    return -expected_best(-np.asarray(values, dtype=np.float64), k)


def majority_draws(votes: Sequence, k: int, num_draws: int = NUM_BOOTSTRAP_DRAWS,
                   seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """[num_draws] the sample whose value each bootstrap draw's majority vote returns, as verl's calc_maj_val: k
    samples drawn with replacement (verl's draws, `np.random.seed(seed)` then `choice`), the answer drawn most often
    wins, a tie goes to the answer drawn first, and the vote returns the first drawn sample with that answer."""
    codes: dict = {}
    coded = np.array([codes.setdefault(v, len(codes)) for v in votes])  # [n] answer ids
    draws = np.random.RandomState(seed).choice(len(coded), size=(num_draws, k), replace=True)  # [draws, k]
    drawn = coded[draws]  # [draws, k]
    counts = (drawn[:, :, None] == np.arange(len(codes))).sum(1)  # [draws, answers]
    drawn_counts = np.take_along_axis(counts, drawn, 1)  # [draws, k] how often each drawn answer was drawn
    winner = (drawn_counts == counts.max(1, keepdims=True)).argmax(1)  # [draws] the first position of a top answer
    return draws[np.arange(num_draws), winner]


def prompt_metrics(values: dict[str, np.ndarray], votes: Sequence | None = None,
                   seed: int = BOOTSTRAP_SEED) -> dict[str, dict[str, float]]:
    """variable -> metric -> value over one prompt's n samples: mean@n, and with n > 1 std@n (numpy's, ddof 0),
    best@k/mean and worst@k/mean for k in `sample_sizes(n)`, and maj@k/mean, maj@k/std when `votes` (each
    sample's answer) are given."""
    arrays = {name: np.asarray(v, dtype=np.float64) for name, v in values.items()}  # each [n]
    n = len(next(iter(arrays.values())))
    metrics = {name: {f"mean@{n}": float(v.mean()), **({f"std@{n}": float(v.std())} if n > 1 else {})}
               for name, v in arrays.items()}
    for k in sample_sizes(n):
        chosen = majority_draws(votes, k, seed=seed) if votes is not None else None  # [draws], for every variable
        for name, v in arrays.items():
            m = metrics[name]
            m[f"best@{k}/mean"], m[f"worst@{k}/mean"] = expected_best(v, k), expected_worst(v, k)
            if chosen is not None:
                m[f"maj@{k}/mean"], m[f"maj@{k}/std"] = float(v[chosen].mean()), float(v[chosen].std())
    return metrics


def prompt_groups(uids: Sequence, data_sources: Sequence | None = None) -> dict[str, list[np.ndarray]]:
    """data source -> the row indices of each of its prompts (rows sharing a uid), in the order rows first appear;
    rows without a data source are verl's "unknown"."""
    sources = [UNKNOWN_DATA_SOURCE] * len(uids) if data_sources is None else data_sources
    rows: dict[tuple, list[int]] = defaultdict(list)
    for row, (source, uid) in enumerate(zip(sources, uids, strict=True)):
        rows[(str(source), uid)].append(row)
    groups: dict[str, list[np.ndarray]] = defaultdict(list)
    for (source, _), indices in rows.items():
        groups[source].append(np.array(indices))
    return dict(groups)


def pass_at_k(correct: np.ndarray, uids: Sequence, k: int) -> float:
    """The unbiased pass@k (Chen et al. 2021) averaged over the prompts (rows sharing a uid): the chance that k of
    a prompt's samples, drawn without replacement, hold a correct one."""
    correct = np.asarray(correct, dtype=np.float64)
    groups = [rows for prompts in prompt_groups(uids).values() for rows in prompts]
    return float(np.mean([expected_best(correct[rows], k) for rows in groups]))


def validation_metrics(values: dict[str, np.ndarray], uids: Sequence, data_sources: Sequence | None = None,
                       votes: Sequence | None = None, seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """`val-core/{source}/{variable}/{metric}` and `val-aux/...`: `prompt_metrics` of each prompt (rows sharing a
    uid and a data source), each metric averaged over the source's prompts that have it. `values` maps each
    variable (verl's "reward" for the score, "acc", a dict reward's other fields) to its value per row, `votes`
    is each row's answer for maj@k. verl's split: val-core holds the mean@, maj@ and best@ metrics at the largest
    sample count of the core variable ("acc" if there is one, else "reward"); val-aux holds the rest."""
    logged = {}
    for source, prompts in prompt_groups(uids, data_sources).items():
        per_prompt: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # variable -> metric
        for rows in prompts:
            prompt_votes = None if votes is None else [votes[i] for i in rows]
            for name, metrics in prompt_metrics({n: np.asarray(v)[rows] for n, v in values.items()}, prompt_votes,
                                                seed).items():
                for metric, value in metrics.items():
                    per_prompt[name][metric].append(value)
        core_variable = "acc" if "acc" in per_prompt else "reward"
        for name, metrics in per_prompt.items():
            largest = max(_sample_count(metric) for metric in metrics)
            for metric, prompt_values in metrics.items():
                core = name == core_variable and metric.startswith(CORE_PREFIXES) and _sample_count(metric) == largest
                logged[f"{'val-core' if core else 'val-aux'}/{source}/{name}/{metric}"] = float(np.mean(prompt_values))
    return logged


def _sample_count(metric: str) -> int:
    """The n or k of a metric name: 4 for "mean@4" and "best@4/std"."""
    return int(metric.split("@")[1].split("/")[0])
