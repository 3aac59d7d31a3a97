"""`RolloutContext`: the `args` that rollout, generate, reward and filter functions receive (slime passes its argparse
namespace): the settings, the tokenizer, and the async operations a function composes, over an `EnginePool`."""

from __future__ import annotations

import asyncio
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from baton.engines.protocol import GenerationRequest, GenerationResult
from baton.rollout.config import PLUGINS, RolloutSystemConfig
from baton.rollout.functions import generate_sample
from baton.rollout.pool import EnginePool
from baton.rollout.reward import GroupRewarder
from baton.rollout.router import Router
from baton.rollout.sample import Sample
from baton.rollout.staleness import StalenessLedger
from baton.strategy import SamplingParams
from baton.tracking import trace


def load_plugin(name: str | None, what: str) -> Callable | None:
    """The function `rollout_system.<what>` names (a registered name or an import path); None when unset."""
    return None if name is None else PLUGINS[what].get(name, key=f"rollout_system.{what}")


@dataclass
class RolloutServices:
    """What every context of one run shares: the engine pool, the reward, the tokenizer, the dataset field SFT trains
    on (`response_key`, for `sft_rollout`), `extras`: what a pipeline hands its custom functions (the agentic one:
    its environments), and the run's staleness ledger (made from the config)."""

    pool: EnginePool
    rewarder: GroupRewarder
    tokenizer: Any
    response_key: str = "response"
    extras: dict[str, Any] = field(default_factory=dict)
    ledger: StalenessLedger = field(init=False)

    def __post_init__(self):
        self.ledger = StalenessLedger(self.config.max_staleness, self.config.stale_policy)

    @property
    def config(self) -> RolloutSystemConfig:
        return self.pool.config


class RolloutContext:
    """See the module docstring.

    config: the `RolloutSystemConfig`. sampling_params: one sample's sampling (n=1; its seed comes from the sample).
    num_groups_per_step: the prompt groups a training step takes. ledger: the run's `StalenessLedger`. metrics:
    this rollout's counters (reset per rollout), logged with the step. weight_version: the engines' current weights.
    evaluation: scoring held-out sets (the reward function's own score, no training penalty).
    """

    def __init__(self, services: RolloutServices, sampling_params: SamplingParams, num_groups_per_step: int,
                 evaluation: bool = False):
        self._services, self._pool = services, services.pool
        self.evaluation = evaluation
        self.config: RolloutSystemConfig = services.config
        self.tokenizer = services.tokenizer
        self.router: Router = services.pool.router
        self.sampling_params = sampling_params
        self.num_groups_per_step = num_groups_per_step
        self.metrics: dict[str, float] = {}
        self._ids = itertools.count()
        self._request_ids: dict[tuple[int, int], str] = {}  # (group, sample) -> its request id in flight
        self._request_keys: dict[str, tuple[int, int]] = {}  # and back
        self._together: list = []  # deterministic mode: (request, affinity key, its ticket) waiting to be submitted
        self._num_generating = 0  # deterministic mode: this context's generate calls in flight
        self._aborted: set[tuple[int, int]] = set()  # (group, sample) aborted in their generate call now running
        self._submit_due = False
        self.response_key = services.response_key
        self.ledger = services.ledger
        self.extras = services.extras
        self._generate = load_plugin(self.config.generate_function, "generate_function") or generate_sample
        self._filter = load_plugin(self.config.dynamic_filter, "dynamic_filter")

    @property
    def weight_version(self) -> int:
        return self._pool.version

    def request_id(self, sample: Sample) -> str:
        """A fresh request id for `sample`; `generate_request` with it can be aborted by `abort([sample])`."""
        prefix = "eval-" if self.evaluation else ""  # the trace tells held-out requests from training ones by it
        request_id = f"{prefix}g{sample.group_index}-s{sample.sample_index}-{next(self._ids)}"
        key = (sample.group_index, sample.sample_index)
        self._request_ids[key], self._request_keys[request_id] = request_id, key
        return request_id

    async def generate_request(self, request: GenerationRequest, affinity_key: str | None = None) -> GenerationResult:
        """One request through the router; requests with one `affinity_key` (a multi-turn conversation's id) go to
        one engine, whose prefix cache then holds the conversation. In deterministic mode requests go to the router
        in lockstep batches (`_submit_together`). A request of a sample aborted already (a multi-turn episode
        between two turns when the abort came) returns at once, aborted, with nothing generated."""
        if self._request_keys.get(request.request_id) in self._aborted:
            self._forget(request.request_id)
            return GenerationResult(request.request_id, request.prefix_response_ids, request.prefix_log_probs,
                                    request.prefix_weight_versions, self._pool.version, "abort")
        try:
            if self.config.deterministic:
                future = await self._submit_together(request, affinity_key)
            else:
                future = self.router.generate(request, affinity_key)
            return await asyncio.wrap_future(future)
        finally:  # no longer abortable (a long-lived context, the async producer's, keeps no id per sample)
            self._forget(request.request_id)

    async def _submit_together(self, request: GenerationRequest, affinity_key: str | None):
        """The router's future for `request`, once it has gone to the router in one submit with the next request of
        every other generate call of this context in flight (lockstep: a rollout's first requests, all started at
        once; then each later turn of its multi-turn episodes, once every episode has had its environment's answer
        or ended), sorted by sample. Each engine then takes them all at one step, so its batches, and the numerics
        of every row in them, are the same run after run (an engine's logits of a row depend on the rows beside
        it), whenever the environments answer."""
        ticket = asyncio.get_running_loop().create_future()
        self._together.append((request, affinity_key, ticket))
        self._submit_when_all_wait()
        return await ticket

    def _submit_when_all_wait(self) -> None:
        """Submit the waiting requests, at the next turn of the loop (so that the requests made in this one join),
        once every generate call in flight has one waiting; requests made outside a generate call go at once."""
        if self._together and len(self._together) >= self._num_generating and not self._submit_due:
            self._submit_due = True
            asyncio.get_running_loop().call_soon(self._submit_gathered)  # after the tasks already queued

    def _submit_gathered(self) -> None:
        self._submit_due = False
        last = (float("inf"), float("inf"))
        gathered = sorted(self._together, key=lambda made: self._request_keys.get(made[0].request_id, last))
        self._together = []
        try:
            futures = self.router.submit([request for request, _, _ in gathered], [key for _, key, _ in gathered])
        except Exception as error:  # every request of the turn fails alike
            for _, _, ticket in gathered:
                ticket.set_exception(error)
            return
        for (_, _, ticket), future in zip(gathered, futures):
            ticket.set_result(future)

    def _forget(self, request_id: str) -> None:
        key = self._request_keys.pop(request_id, None)
        if key is not None and self._request_ids.get(key) == request_id:
            del self._request_ids[key]

    async def generate(self, sample: Sample, params: SamplingParams) -> Sample:
        self._aborted.discard((sample.group_index, sample.sample_index))  # drawn again: a new attempt
        if not self.config.deterministic:
            return await self._generate(self, sample, params)
        self._num_generating += 1
        try:
            return await self._generate(self, sample, params)
        finally:
            self._num_generating -= 1
            self._submit_when_all_wait()  # the others may all be waiting on this one

    async def reward(self, group: list[Sample]) -> None:
        current = trace.tracer()
        if current is None or self.evaluation or not current.traced(group[0].group_index if group else None):
            await self._services.rewarder(self, group)
            return
        with current.timed("reward", "reward", group=group[0].group_index,
                           samples=[trace.sample_id(s.group_index, s.sample_index) for s in group]):
            await self._services.rewarder(self, group)

    def keep(self, group: list[Sample]) -> tuple[bool, str]:
        """The dynamic filter's verdict on a rewarded group: (keep, reason to drop)."""
        if self._filter is None:
            return True, ""
        verdict = self._filter(self, group)
        return verdict if isinstance(verdict, tuple) else (bool(verdict), "filtered")

    async def abort(self, samples: Sequence[Sample]) -> None:
        """Abort the samples' requests in flight (bounded by `abort_timeout_s`), and the requests their generate
        calls make next; the calls return the partial responses. Runs off the event loop, which keeps serving the
        other tasks meanwhile."""
        keys = [(s.group_index, s.sample_index) for s in samples]
        self._aborted.update(keys)
        ids = [self._request_ids[key] for key in keys if key in self._request_ids]  # the router skips ids not in flight
        if ids:
            await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                self.router.abort, ids, timeout_s=self.config.abort_timeout_s))

    def run(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the pool's event loop from a plain (synchronous) rollout function, for at most
        `timeout_s` (None: `rollout_timeout_s`)."""
        return self._pool.run_bounded(coro, "a rollout function's call",
                                      self.config.rollout_timeout_s if timeout_s is None else timeout_s)

    def describe_stall(self, what: str) -> str:
        return self._pool.describe_stall(what)

    def count_dropped(self, reason: str, count: int = 1) -> None:
        """`rollout/num_dropped/<reason>` += count, logged with the step."""
        key = f"rollout/num_dropped/{reason}"
        self.metrics[key] = self.metrics.get(key, 0.0) + float(count)
