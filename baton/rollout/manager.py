"""`RolloutManager`: slime's rollout manager and controller in one object on the driver. It owns the router over the
engine pool, the data source with its buffer, the reward, and an event loop (in a thread of its own) on which the
rollout functions run; the trainer asks it for a step's groups, gives it new weights, and checkpoints its state.

Three ways to run beside training (`RolloutSystemConfig.mode`): `generate(rollout_id)` (sync), the same in
`run_in_background` (one_step_off: the next step's rollout runs while this one trains), and `start_continuous` /
`take` (async: groups are generated continuously, each admitted only while the groups ahead of it keep it within
`max_staleness`, and none while the trainer waits on groups already started; the trainer may take the next step's
while this one trains). Every group handed to training is checked against `max_staleness` (trained version minus its
oldest token's version): a group past it is dropped and its prompt goes back to the buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import itertools
import numbers
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from baton.data import DataProto
from baton.distributed import Cluster
from baton.engines.loop import LoopThread
from baton.engines.protocol import GenerationRequest, GenerationResult
from baton.rewards import DATA_SOURCE, PRED
from baton.rl.metrics import validation_set_metrics
from baton.rollout.config import PLUGINS, RolloutSystemConfig
from baton.rollout.data_source import RolloutDataSource
from baton.rollout.dump import load_rollout, save_rollout
from baton.rollout.engine_worker import WEIGHT_SYNC_TIMEOUT_S
from baton.rollout.functions import (GroupFailed, RolloutStalledError, abort_groups, generate_group, generate_sample,
                                     reset_sample, too_stale)
from baton.rollout.reward import GroupRewarder, RewardTimeout
from baton.rollout.router import Router
from baton.rollout.sample import Sample, Status, samples_to_data
from baton.strategy import SamplingParams
from baton.workers.weight_sync import ModelUpdatePair


ADMIT_CHUNK = 8  # groups the async producer starts between two turns of the event loop


def _load(name: str | None, what: str) -> Callable | None:
    return None if name is None else PLUGINS[what].get(name, key=f"rollout_system.{what}")


class RolloutContext:
    """The `args` that rollout, generate, reward and filter functions receive (slime passes its argparse namespace):
    the settings, the tokenizer, and the async operations a function composes.

    config: the `RolloutSystemConfig`. sampling_params: one sample's sampling (n=1; its seed comes from the sample).
    num_groups_per_step: the prompt groups a training step takes. metrics: this rollout's counters (reset per
    rollout), logged with the step. weight_version: the engines' current weights.
    """

    def __init__(self, manager: "RolloutManager", sampling_params: SamplingParams, num_groups_per_step: int,
                 evaluation: bool = False):
        self._manager = manager
        self.evaluation = evaluation  # scoring held-out sets: the reward function's own score, no training penalty
        self.config: RolloutSystemConfig = manager.config
        self.tokenizer = manager.tokenizer
        self.router: Router = manager.router
        self.sampling_params = sampling_params
        self.num_groups_per_step = num_groups_per_step
        self.metrics: dict[str, float] = {}
        self._ids = itertools.count()
        self._request_ids: dict[tuple[int, int], str] = {}  # (group, sample) -> its request id in flight
        self._request_keys: dict[str, tuple[int, int]] = {}  # and back
        self.response_key = manager.response_key  # the dataset field SFT trains on (`sft_rollout`)
        self.extras = manager.extras  # what the pipeline hands its custom functions (the agentic one: its envs)
        self._generate = _load(self.config.generate_function, "generate_function") or generate_sample
        self._filter = _load(self.config.dynamic_filter, "dynamic_filter")

    @property
    def weight_version(self) -> int:
        return self._manager.version

    def request_id(self, sample: Sample) -> str:
        """A fresh request id for `sample`; `generate_request` with it can be aborted by `abort([sample])`."""
        request_id = f"g{sample.group_index}-s{sample.sample_index}-{next(self._ids)}"
        key = (sample.group_index, sample.sample_index)
        self._request_ids[key], self._request_keys[request_id] = request_id, key
        return request_id

    async def generate_request(self, request: GenerationRequest, affinity_key: str | None = None) -> GenerationResult:
        """One request through the router; requests with one `affinity_key` (a multi-turn conversation's id) go to
        one engine, whose prefix cache then holds the conversation."""
        try:
            return await asyncio.wrap_future(self.router.generate(request, affinity_key))
        finally:  # no longer abortable (a long-lived context, the async producer's, keeps no id per sample)
            self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        key = self._request_keys.pop(request_id, None)
        if key is not None and self._request_ids.get(key) == request_id:
            del self._request_ids[key]

    async def generate(self, sample: Sample, params: SamplingParams) -> Sample:
        return await self._generate(self, sample, params)

    async def reward(self, group: list[Sample]) -> None:
        await self._manager.rewarder(self, group)

    def keep(self, group: list[Sample]) -> tuple[bool, str]:
        """The dynamic filter's verdict on a rewarded group: (keep, reason to drop)."""
        if self._filter is None:
            return True, ""
        verdict = self._filter(self, group)
        return verdict if isinstance(verdict, tuple) else (bool(verdict), "filtered")

    async def abort(self, samples: Sequence[Sample]) -> None:
        """Abort the samples' requests in flight (bounded by `abort_timeout_s`); their generate calls return the
        partial responses. Runs off the event loop, which keeps serving the other tasks meanwhile."""
        ids = [self._request_ids[key] for key in ((s.group_index, s.sample_index) for s in samples)
               if key in self._request_ids]  # the router skips ids no longer in flight
        if ids:
            await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                self.router.abort, ids, timeout_s=self.config.abort_timeout_s))

    def run(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the manager's event loop from a plain (synchronous) rollout function, for at most
        `timeout_s` (None: `rollout_timeout_s`)."""
        return self._manager.run_bounded(coro, "a rollout function's call",
                                         self.config.rollout_timeout_s if timeout_s is None else timeout_s)

    def describe_stall(self, what: str) -> str:
        return self._manager.describe_stall(what)


class RolloutManager:
    """See the module docstring. `engines`: clusters of one `EngineWorker` each, built by the pipeline.

    reward_fn / reward_on_error / reward_num_processes / reward_timeout_s_per_row / overlong: the pipeline's reward
    (see `GroupRewarder`), unless `config.reward_function` names a custom one. eval_sets: name -> PromptDataset scored by
    `eval` (greedy, `eval_sampling_params`).
    """

    def __init__(self, config: RolloutSystemConfig, engines: Sequence[Cluster], data_source: RolloutDataSource,
                 tokenizer, sampling_params: SamplingParams, num_groups_per_step: int, *,
                 reward_fn: Any = "exact_match", reward_on_error: str = "raise", reward_num_processes: int = 0,
                 reward_timeout_s_per_row: float | None = None, probe: DataProto | None = None, probe_atol: float = 1e-4,
                 eval_sets: dict | None = None, eval_sampling_params: SamplingParams | None = None,
                 max_prompt_len: int | None = None, engines_on_gpu: bool = False, response_key: str = "response",
                 overlong: tuple[int, int, float] | None = None):
        self.config, self.engines, self.data_source, self.tokenizer = config, list(engines), data_source, tokenizer
        self.sampling_params = sampling_params
        self.num_groups_per_step = num_groups_per_step
        self.version = 0
        self.probe, self.probe_atol = probe, probe_atol
        self._num_syncs = 0  # weight syncs so far in this process: the probe checks every `probe_every_syncs`-th
        self.eval_sets = eval_sets or {}
        self.eval_sampling_params = eval_sampling_params or SamplingParams(temperature=0.0, n=1)
        self.max_prompt_len, self.response_key = max_prompt_len, response_key
        self.extras: dict[str, Any] = {}  # every context's `extras`: what a pipeline hands its custom functions
        self.rollout_fn = _load(config.rollout_function, "rollout_function")
        self.eval_fn = _load(config.eval_function, "eval_function")
        self.rewarder = GroupRewarder(reward_fn, on_error=reward_on_error, num_processes=reward_num_processes,
                                      timeout_s_per_row=reward_timeout_s_per_row,
                                      custom=_load(config.reward_function, "reward_function"),
                                      timeout_s=config.reward_timeout_s, overlong=overlong)
        self._buckets: list | None = None  # the last weights sent, for an engine that restarts
        # No engines: train-only mode (`load_rollouts`), which generates nothing.
        self.router = Router(self.engines, poll_s=config.poll_s, health_interval_s=config.health_interval_s,
                             max_retries=config.max_retries, on_restart=self._resync) if self.engines else None
        self.loop = LoopThread("rollout-manager")
        self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-check")
        self._weight_check: concurrent.futures.Future | None = None  # the last sync's probe, scored meanwhile
        self.engines_on_gpu, self._said_cpu_offload = engines_on_gpu, False
        # async mode: groups ready for training, and the producer's state (on the loop)
        self._ready: list[list[Sample]] = []
        self._producer: concurrent.futures.Future | None = None
        self._stop_producing: asyncio.Event | None = None
        # Set when a step takes groups, stale ones go back or new weights come: admit again.
        self._wake: asyncio.Event | None = None
        self._grew: asyncio.Event | None = None  # set when a group is ready (or the producer stops): take again
        self._taking = False  # a step waits in `take`
        self._continuous_ctx: RolloutContext | None = None
        self.consumed_steps = 0
        self._errors_reported = (0, 0)  # the rewarder's (num_errors, num_timeouts) at the last report or eval

    def context(self) -> RolloutContext:
        return RolloutContext(self, self.sampling_params, self.num_groups_per_step)

    @property
    def producing(self) -> bool:
        """Whether the async producer runs (`start_continuous` until `stop_continuous`)."""
        return self._producer is not None

    def run_bounded(self, coro, what: str, timeout_s: float | None = None):
        """`coro` on the manager's loop, for at most `timeout_s` (None: `rollout_timeout_s`): past it, a
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

    # --- sync and one-step-off -----------------------------------------------------------------------

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """The groups of rollout `rollout_id` (the rollout function's, or the saved ones in train-only mode), saved
        when `save_rollouts` is set, and the rollout's metrics."""
        if self.config.load_rollouts is not None:
            return load_rollout(self.config.load_rollouts, rollout_id), {}
        ctx = self.context()
        fn = self.rollout_fn
        if inspect.iscoroutinefunction(fn):
            groups = self.run_bounded(fn(ctx, rollout_id, self.data_source, False), f"rollout {rollout_id}")
        else:
            groups = fn(ctx, rollout_id, self.data_source, False)
        if self.config.save_rollouts is not None:
            save_rollout(self.config.save_rollouts, rollout_id, groups)
        return groups, {**ctx.metrics, **self.router_metrics()}

    def run_in_background(self, fn: Callable, *args) -> concurrent.futures.Future:
        """`fn(*args)` in the manager's background thread, one call after another: the overlapped modes prepare the
        next step's batch there (its `generate` or `take`, made training data) while the trainer runs this one."""
        return self._background.submit(fn, *args)

    # --- async: continuous generation ------------------------------------------------------------------

    def start_continuous(self) -> None:
        """Start generating groups in the background (async mode), admitted by the staleness bound."""
        if self._producer is not None:
            return
        self._continuous_ctx = self.context()

        async def start():
            self._stop_producing, self._wake, self._grew = asyncio.Event(), asyncio.Event(), asyncio.Event()

        self.loop.run(start())
        self._producer = self.loop.submit(self._produce(self._continuous_ctx))

    def _step_has_priority(self, num_running: int) -> bool:
        """Whether a step waiting in `take` is owed the engines: no more groups start until it has its own.
        - Its groups are ready: it takes them before more groups start (it would otherwise wait behind their
          requests' start-up on the loop).
        - Its groups are all started, and the trainer waits for them (the weights it would train are in the engines
          already, so the step before has synced): groups started now would only slow them (their prefills join the
          running batch, their start-up takes the loop and the engine's core).
        While the trainer trains, a take already waiting (the next step's, in the background) does not stop the
        producer. The take's end wakes the producer again."""
        if not self._taking:
            return False
        ready, needed = len(self._ready), self.num_groups_per_step
        return ready >= needed or (self.version >= self.consumed_steps and ready + num_running >= needed)

    def _admits(self, ahead: int) -> bool:
        """Whether a new group, `ahead` groups behind the next batch's start, will be trained within the bound: it
        is trained by the step that takes batch `ahead // B` from now, at version consumed_steps + ahead // B."""
        return self.consumed_steps + ahead // self.num_groups_per_step - self.version <= self.config.max_staleness

    async def _produce(self, ctx: RolloutContext) -> None:
        running: dict[asyncio.Task, list[Sample]] = {}
        while not self._stop_producing.is_set():
            admitted = 0
            while self._admits(len(self._ready) + len(running)) and not self._step_has_priority(len(running)):
                for group in self.data_source.get_samples(1):
                    running[asyncio.ensure_future(generate_group(ctx, group, ctx.sampling_params))] = group
                admitted += 1
                if admitted % ADMIT_CHUNK == 0:
                    await asyncio.sleep(0)  # a take issued meanwhile runs now, not behind a whole batch's start-up
            self._wake.clear()
            waits = [*running, asyncio.ensure_future(self._wake.wait())]
            done, _ = await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            waits[-1].cancel()
            for task in [t for t in done if t in running]:
                group = running.pop(task)
                try:
                    task.result()
                except RewardTimeout:
                    _count(ctx, "reward_timeout")
                    continue
                except GroupFailed:
                    _count(ctx, "failed_groups")
                    continue
                keep, reason = ctx.keep(group)
                if keep:
                    self._ready.append(group)
                    self._grew.set()
                else:
                    _count(ctx, reason)
        await abort_groups(ctx, running, self.data_source)
        self._grew.set()

    def take(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """(async mode) The next step's groups, waiting at most `watchdog_s` for enough of them."""
        groups, metrics = self.run_bounded(self._take(), "the async step's wait for its groups")
        return groups, {**metrics, **self.router_metrics()}

    async def _take(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """The oldest ready groups first (the fewest go stale); a group staler than the bound for the version it
        would train at (`consumed_steps`) goes back to the buffer as a fresh prompt."""
        needed, trained_version = self.num_groups_per_step, self.consumed_steps
        deadline = time.monotonic() + self.config.watchdog_s
        self._taking = True
        try:
            return await self._take_when_ready(needed, trained_version, deadline)
        finally:
            self._taking = False

    async def _take_when_ready(self, needed: int, trained_version: int,
                               deadline: float) -> tuple[list[list[Sample]], dict[str, float]]:
        while True:
            self._ready.sort(key=lambda group: min(s.oldest_version() or 0 for s in group))  # stable: FIFO on ties
            stale = [g for g in self._ready if too_stale(g, trained_version, self.config.max_staleness)]
            if stale:
                self._ready = [g for g in self._ready if g not in stale]
                for sample in (s for g in stale for s in g):
                    reset_sample(sample, keep_tokens=False)
                self.data_source.add_samples(stale)
                _count(self._continuous_ctx, "stale", len(stale))
                self._wake.set()
            if len(self._ready) >= needed:
                break
            if self._producer.done():
                self._producer.result()  # its error
                raise RuntimeError("the rollout producer stopped")
            if time.monotonic() >= deadline:
                raise RolloutStalledError(self.describe_stall(
                    f"async rollout: {len(self._ready)} of {needed} groups ready after {self.config.watchdog_s:g} s "
                    "(rollout_system.watchdog_s)"))
            self._grew.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._grew.wait(), max(0.0, min(1.0, deadline - time.monotonic())))
        groups, self._ready = self._ready[:needed], self._ready[needed:]
        self.consumed_steps += 1
        self._wake.set()
        ctx = self._continuous_ctx
        metrics, ctx.metrics = ctx.metrics, {}  # on the loop, where the producer counts: none is lost
        return groups, metrics

    def stop_continuous(self) -> None:
        """Stop the producer: what runs is aborted into the buffer, and what is ready goes back there too (in
        order, ahead of the rest), so that a checkpoint holds every sample."""
        if self._producer is None:
            return

        async def stop():
            self._stop_producing.set()
            self._wake.set()

        self.loop.run(stop())
        self._producer.result(self.config.abort_timeout_s + 30)
        self._producer = None
        ready, self._ready = self._ready, []
        self.data_source.buffer[:0] = ready

    # --- training data ------------------------------------------------------------------------------

    def to_training_data(self, groups: list[list[Sample]], trained_version: int,
                         temperature: float) -> tuple[DataProto, dict[str, float]]:
        """The groups as one training batch, and its staleness metrics. A group staler than `max_staleness` (only a
        custom rollout function can hand one over: the shipped ones drop them) is refused."""
        for group in groups:
            if too_stale(group, trained_version, self.config.max_staleness):
                raise ValueError(f"{group[0].where()}'s group holds tokens {max(s.staleness(trained_version) for s in group)} "
                                 f"versions older than the weights it would train (max_staleness="
                                 f"{self.config.max_staleness}); a rollout function must leave such groups out")
        samples = [sample for group in groups for sample in group]
        staleness = np.array([s.staleness(trained_version) for s in samples])
        batch = samples_to_data(samples, self.tokenizer.pad_token_id, temperature)
        return batch, {"rollout/staleness/mean": float(staleness.mean()), "rollout/staleness/max": float(staleness.max()),
                       "rollout/num_groups": float(len(groups)),
                       "rollout/num_partial_samples": float(sum(s.metadata.get("num_resumes", 0) > 0 for s in samples))}

    # --- weights and memory -------------------------------------------------------------------------

    def update_weights(self, actor: Cluster, version: int, bucket_bytes: int = 256 << 20) -> dict[str, float]:
        """The actor's weights into every engine as `version`, in place: an engine loads them between two decode
        steps (its requests in flight hold meanwhile, then go on with the new weights) and is probe-checked against
        the actor (its steps held for the probe's forward) on the first sync and every `probe_every_syncs`-th.

        In sync mode the probe is scored before this returns. In the overlapped modes it is scored in the background
        while the next step trains (it is off the step's path): the next sync, or `settle_weight_check`, waits for
        it first, reports its `weight_sync/max_logprob_diff` and raises its WeightSyncError, before newer weights
        go in."""
        metrics = self.settle_weight_check()
        probe = self.probe if self._num_syncs % self.config.probe_every_syncs == 0 else None
        self._num_syncs += 1
        pairs = [ModelUpdatePair(actor, engine, probe, atol=self.probe_atol) for engine in self.engines]
        # Queued on the actor ahead of the export: its log-probs are the exported weights'.
        ours = actor.call_async("compute_log_probs", probe) if probe is not None and pairs else None
        buckets = actor.export_weights(bucket_bytes)
        for engine in self.engines:
            engine.import_weights(buckets, version)
        self._buckets, self.version = buckets, version
        if self._producer is not None:  # the bound moved on: the next step's take may have been done already
            self.loop.call_soon(self._wake.set)
        if ours is not None:
            check = functools.partial(_check_weights, pairs, ours)
            if self.config.mode == "sync":
                metrics.update(check())
            else:
                self._weight_check = self._checker.submit(check)
        return metrics

    def settle_weight_check(self) -> dict[str, float]:
        """The last sync's probe, if it is still being scored in the background (overlapped modes): waited for
        (bounded), its metrics returned and its WeightSyncError raised."""
        pending, self._weight_check = self._weight_check, None
        if pending is None:
            return {}
        try:
            return pending.result(WEIGHT_SYNC_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RolloutStalledError(self.describe_stall(
                f"the weight sync's probe was not scored within {WEIGHT_SYNC_TIMEOUT_S:g} s")) from None

    def _resync(self, index: int) -> None:
        """A restarted engine gets the weights the others have."""
        if self._buckets is not None:
            self.engines[index].import_weights(self._buckets, self.version)

    def offload(self) -> None:
        """Engines sleep before training on devices they share (on CPU this frees nothing; said once)."""
        self._say_cpu_offload()
        for engine in self.engines:
            engine.offload()

    def onload(self) -> None:
        for engine in self.engines:
            engine.reload()

    def _say_cpu_offload(self) -> None:
        if not self._said_cpu_offload and not self.engines_on_gpu:
            print("baton: rollout engines on CPU: offload/onload hold their steps but free no memory", file=sys.stderr)
        self._said_cpu_offload = True

    # --- eval ---------------------------------------------------------------------------------------

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Each eval set, every prompt, `eval_sampling_params.n` samples (greedy by default), generated by the eval
        function (`config.eval_function`: `fn(args, rollout_id, data_sources, evaluation=True) -> {name: groups}`) and
        scored: the "val" set as `val/...`, the loop's metric set (`validation_set_metrics`), each other set as
        `eval/{name}/...`."""
        if not self.eval_sets or self.router is None:
            return {}
        sources = {name: RolloutDataSource(dataset, self.tokenizer, self.eval_sampling_params.n, seed=rollout_id,
                                           max_prompt_len=self.max_prompt_len)
                   for name, dataset in self.eval_sets.items()}
        ctx = RolloutContext(self, dataclasses.replace(self.eval_sampling_params, n=1), self.num_groups_per_step,
                             evaluation=True)
        fn = self.eval_fn
        with self._uncounted_reward_errors() as counted:  # eval's rows are not the training steps'
            if inspect.iscoroutinefunction(fn):
                results = self.run_bounded(fn(ctx, rollout_id, sources, True), f"eval {rollout_id}")
            else:
                results = fn(ctx, rollout_id, sources, True)
        errors, timeouts = counted
        out = {}
        for name, groups in results.items():
            samples = [s for g in groups for s in g]
            prefix = "val/" if name == "val" else f"eval/{name}/"
            out.update(eval_metrics(samples, self.eval_sampling_params.n, prefix, errors if name == "val" else 0,
                                    timeouts if name == "val" else 0))
        return out

    def greedy_baselines(self, groups: list[list[Sample]], max_new_tokens: int) -> dict[int, float]:
        """ReMax's baselines: one greedy response to each group's prompt, generated by the engines and scored by the
        reward: group index → its reward. Its rows' reward errors are not the training step's (not in
        `reward_error_metrics`), as the loop counts them."""
        if self.router is None:
            raise ValueError("a greedy baseline (algorithm.adv_estimator remax) needs engines; a train-only run "
                             "(rollout_system.load_rollouts) has none: save rollouts with reward_baselines instead")
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, n=1)  # as the loop's
        baselines = [Sample(group_index=g[0].group_index, sample_index=0, prompt=g[0].prompt,
                            prompt_ids=list(g[0].prompt_ids), label=g[0].label, seed=0,
                            metadata=dict(g[0].metadata)) for g in groups]

        async def run() -> None:
            ctx = RolloutContext(self, params, len(groups))
            await asyncio.gather(*(generate_sample(ctx, sample, params) for sample in baselines))
            await self.rewarder(ctx, baselines)

        with self._uncounted_reward_errors():
            self.run_bounded(run(), "the greedy baseline rollout")
        return {sample.group_index: sample.score() for sample in baselines}

    @contextlib.contextmanager
    def _uncounted_reward_errors(self):
        """The reward errors of rows scored meanwhile (eval, baselines) are left out of `reward_error_metrics`; the
        list it yields holds their (num_errors, num_timeouts) once the block ends."""
        errors, timeouts = self.rewarder.num_errors, self.rewarder.num_timeouts
        counted: list[int] = []
        yield counted
        counted += [self.rewarder.num_errors - errors, self.rewarder.num_timeouts - timeouts]
        reported = self._errors_reported
        self._errors_reported = (reported[0] + counted[0], reported[1] + counted[1])

    def reward_error_metrics(self) -> dict[str, float]:
        """`reward/num_errors` and `reward/num_timeouts` of the training groups scored since the last call (as the
        loop counts a step's): rows the reward function raised on or ran past its time limit on, scored 0."""
        errors, timeouts = self.rewarder.num_errors, self.rewarder.num_timeouts
        reported, self._errors_reported = self._errors_reported, (errors, timeouts)
        return {"reward/num_errors": float(errors - reported[0]), "reward/num_timeouts": float(timeouts - reported[1])}

    # --- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"data_source": self.data_source.state_dict(), "version": self.version,
                "consumed_steps": self.consumed_steps}

    def load_state_dict(self, state: dict) -> None:
        self.data_source.load_state_dict(state["data_source"])
        self.version, self.consumed_steps = state["version"], state["consumed_steps"]

    def router_metrics(self) -> dict[str, float]:
        return self.router.metrics() if self.router is not None else {}

    def describe_stall(self, what: str) -> str:
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
        self.stop_continuous()
        if self.router is not None:
            self.router.close()
        self.rewarder.close()
        self._background.shutdown(wait=False, cancel_futures=True)
        self._checker.shutdown(wait=False, cancel_futures=True)
        self.loop.close()


def _check_weights(pairs: list[ModelUpdatePair], ours) -> dict[str, float]:
    """Every engine's probe log-probs against the actor's (`ours`: their pending call), the largest difference."""
    log_probs = ours.get().batch["log_probs"]
    return {"weight_sync/max_logprob_diff": max(pair.check(log_probs) for pair in pairs)}


def _count(ctx: RolloutContext, reason: str, count: int = 1) -> None:
    key = f"rollout/num_dropped/{reason}"
    ctx.metrics[key] = ctx.metrics.get(key, 0.0) + float(count)


__all__ = ["RolloutContext", "RolloutManager"]


def eval_metrics(samples: list[Sample], num_samples_per_prompt: int, prefix: str, num_errors: int,
                 num_timeouts: int) -> dict[str, float]:
    """Scored eval samples as the loop's validation metric set (`validation_set_metrics`).
    A dict reward's numeric fields are its `reward/<key>/mean` (and val-core variables); its "pred" is the maj@k
    vote, else each response stripped of surrounding whitespace."""
    rewards = [s.reward if isinstance(s.reward, dict) else {} for s in samples]
    numeric = [k for k in rewards[0] if k not in ("score", PRED) and all(
        isinstance(r.get(k), numbers.Real) for r in rewards)] if rewards else []
    fields = {key: np.array([float(r[key]) for r in rewards], dtype=np.float32) for key in numeric}
    votes = [r[PRED] if PRED in r else s.response.strip() for r, s in zip(rewards, samples)]
    sources = [s.metadata.get(DATA_SOURCE) for s in samples]
    return validation_set_metrics(
        np.array([s.score() for s in samples], dtype=np.float32), np.array([s.group_index for s in samples]),
        np.array([s.response_length for s in samples]), np.array([s.status == Status.TRUNCATED for s in samples]),
        fields,
        None if all(source is None for source in sources) else np.array(sources, dtype=object), votes,
        num_samples_per_prompt, num_errors, num_timeouts, prefix=prefix)
