"""Shared fixtures: one simulated two-node Ray cluster per test session, and resource managers on either backend."""

from __future__ import annotations

import os
import time
from typing import Callable

import pytest

# Two simulated nodes (logical CPUs; the machine has 2 real cores). The head fits a module-wide
# 4-slot reservation beside a test's own 4 slots, with 2 CPUs left for CPU-only workers; the
# second node exists for multi-node placement tests.
HEAD_CPUS = 10
SECOND_NODE_CPUS = 4


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0, interval_s: float = 0.02) -> None:
    """Poll `condition` until it holds; fail naming `what` if it still does not after `timeout_s`.

    The bound limits how long a test waits for something that should happen, never how fast it happened: keep it
    generous (a loaded 2-core machine), and assert on what happened, not on when. Speed targets live in bench/.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread; two threads spinning on a loaded 2-core machine ran ~100x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Worker classes defined in test modules are pickled by reference; let worker processes import them.
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [tests_dir, os.environ.get("PYTHONPATH")] if p)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": HEAD_CPUS, "include_dashboard": False})
    cluster.add_node(num_cpus=SECOND_NODE_CPUS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(params=["local", "ray"])
def backend(request):
    """Runs a test once in-process and once on Ray."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


@pytest.fixture
def make_manager(request):
    """`make_manager(backend, num_nodes=1, num_devices_per_node=4)`; everything it reserved is freed after the test."""
    from baton import ResourceManager

    managers = []

    def make(backend: str, num_nodes: int = 1, num_devices_per_node: int = 4) -> ResourceManager:
        if backend == "ray":
            request.getfixturevalue("ray_cluster")
        manager = ResourceManager(num_nodes, num_devices_per_node, backend=backend)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()


def padded_batch(prompt_lens: list[int], response_lens: list[int], prompt_width: int, response_width: int,
                 vocab: int = 30, seed: int = 0):
    """A DataProto: rows of random tokens, prompts left-padded to `prompt_width`, responses right-padded to `response_width`,
    with the columns a strategy reads and a [rows, len, 2] response column and a prompt-width column beside them."""
    import numpy as np
    import torch

    from baton.data import DataProto

    PAD = 0
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens)
    prompts = torch.full((rows, prompt_width), PAD)
    responses = torch.full((rows, response_width), PAD)
    mask = torch.zeros(rows, prompt_width + response_width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, prompt_width - p :] = torch.randint(4, vocab, (p,), generator=g)
        responses[i, :r] = torch.randint(4, vocab, (r,), generator=g)
        mask[i, prompt_width - p : prompt_width + r] = 1
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = mask[:, prompt_width:].clone()
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": mask,
        "position_ids": position_ids, "response_mask": response_mask,
        "top_ids": torch.randint(4, vocab, (rows, response_width, 2), generator=g),
        "advantages": torch.randn(rows, response_width, generator=g),
    }, non_tensors={"uid": np.arange(rows)}, meta_info={"temperature": 1.0})
