"""`EnginePool`: the rollout system's engines behind their router, and the event loop (in a thread of its own) that
the rollout functions run on. The producer, the weight publisher and the evaluator share one pool: it knows which
weight version the engines hold and says where a stalled call is stuck."""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Sequence

from baton.distributed import Cluster
from baton.engines.loop import LoopThread
from baton.rollout.config import RolloutSystemConfig
from baton.rollout.functions import RolloutStalledError
from baton.rollout.router import Router


class EnginePool:
    """`engines`: clusters of one `EngineWorker` each (none: train-only mode, which generates nothing), served by a
    `Router` with the config's polling, health and retry settings. `version`: the weights the engines hold, set by
    `set_version`, which tells the listeners (`on_new_version`). `on_restart(index)`: what a restarted engine needs
    (the weight publisher gives it the current weights)."""

    def __init__(self, config: RolloutSystemConfig, engines: Sequence[Cluster]):
        self.config, self.engines = config, list(engines)
        self.version = 0
        self.on_new_version: list[Callable[[], None]] = []
        self.on_restart: Callable[[int], None] | None = None
        self.router = Router(self.engines, poll_s=config.poll_s, health_interval_s=config.health_interval_s,
                             max_retries=config.max_retries, on_restart=self._restarted) if self.engines else None
        self.loop = LoopThread("rollout")

    def set_version(self, version: int) -> None:
        self.version = version
        for listener in self.on_new_version:
            listener()

    def _restarted(self, index: int) -> None:
        if self.on_restart is not None:
            self.on_restart(index)

    def run_bounded(self, coro, what: str, timeout_s: float | None = None):
        """`coro` on the pool's loop, for at most `timeout_s` (None: `rollout_timeout_s`): past it, a
        RolloutStalledError that names `what`, the stage and the silent engines."""
        timeout_s = self.config.rollout_timeout_s if timeout_s is None else timeout_s
        future = self.loop.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (a RolloutStalledError among them)
                raise
            future.cancel()
            raise RolloutStalledError(self.describe_stall(
                f"{what} did not finish within {timeout_s:g} s (rollout_system.rollout_timeout_s)")) from None

    def router_metrics(self) -> dict[str, float]:
        return self.router.metrics() if self.router is not None else {}

    def describe_stall(self, what: str) -> str:
        """`what`, with where the rollout is stuck: generation or the functions around it, and each engine's
        outstanding and served requests."""
        if self.router is None:
            return what
        metrics = self.router.metrics()
        engines = [f"engine {i}: {metrics[f'router/engine_{i}/outstanding']:g} outstanding, "
                   f"{metrics[f'router/engine_{i}/served']:g} served" for i in range(len(self.engines))]
        silent = [i for i in range(len(self.engines)) if metrics[f"router/engine_{i}/outstanding"] > 0]
        stage = ("generation (engine requests outstanding)" if self.router.num_in_flight else
                 "the generate or reward functions (no engine request in flight)")
        return (f"{what}; stalled in {stage}; silent engines (requests outstanding): {silent or 'none'}; "
                + "; ".join(engines))

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        self.loop.close()
