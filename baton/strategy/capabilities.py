"""What each model backend can do, declared once: preflight, pipelines and workers ask this table, never a name.

A backend named by import path ("package.module:Class") declares its own with a class attribute `capabilities`
(a `Capabilities`); one that declares none is taken to train and generate in one process, as the `hf` strategy does
but without sharing tensors or serving requests.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """trains: steps an optimizer, exports weights and saves checkpoints (actor, critic, reference, reward model).
    generates: samples responses to a batch of prompts (`generate(DataProto)`).
    serves_requests: runs as a request-level engine of the rollout system (`EngineWorker`).
    shares_weights: two roles of this backend fused into one process can share tensors instead of copying them.
    top_k_log_probs: computes the top-k log-probs of every response token (a distillation teacher).
    trains_over_workers: one model trained over several workers (sharded); without it each worker would keep a
        model of its own and they would drift apart.
    devices_per_worker: drives several devices from one worker process (tensor-parallel inference).
    filtered_log_probs: reports the log-probs of the top-k / top-p filtered distribution, which the actor does not
        recompute (so sampling filters are refused).
    """

    trains: bool = True
    generates: bool = True
    serves_requests: bool = False
    shares_weights: bool = False
    top_k_log_probs: bool = False
    trains_over_workers: bool = False
    devices_per_worker: bool = False
    filtered_log_probs: bool = False


BACKENDS: dict[str, Capabilities] = {
    "hf": Capabilities(serves_requests=True, shares_weights=True, top_k_log_probs=True),
    "fsdp2": Capabilities(top_k_log_probs=True, trains_over_workers=True),
    "mock": Capabilities(),
    "vllm": Capabilities(trains=False, serves_requests=True, devices_per_worker=True, filtered_log_probs=True),
}


def capabilities(name: str) -> Capabilities:
    """The capabilities of the backend `name`: a registered name, or an import path whose class declares them."""
    if name in BACKENDS:
        return BACKENDS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"unknown strategy {name!r}; valid: {sorted(BACKENDS)} or an import path 'package.module:Class'")
    return getattr(getattr(importlib.import_module(module), attr), "capabilities", Capabilities())


def backends_that(what: str) -> list[str]:
    """The registered backends with capability `what` (for messages)."""
    return sorted(name for name, caps in BACKENDS.items() if getattr(caps, what))
