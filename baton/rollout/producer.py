"""`RolloutProducer`: slime's rollout controller. It makes the groups a training step takes from the data source and
its buffer, by the rollout function, on the engine pool's event loop, and hands them over as training data.

Three ways to run beside training (`RolloutSystemConfig.mode`): `generate(rollout_id)` (sync), the same in
`run_in_background` (one_step_off: the next step's rollout runs while this one trains), and `start_continuous` /
`take` (async: groups are generated continuously, each admitted only while the groups ahead of it keep it within
`max_staleness`, and none while the trainer waits on groups already started; the trainer may take the next step's
while this one trains). The run's `StalenessLedger` decides what may start, settles the groups a step takes by the
stale policy, and checks every training batch (`to_training_data`) against the bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import time
from typing import Callable

import numpy as np

from baton.data import DataProto
from baton.rollout.context import RolloutContext, RolloutServices, load_plugin
from baton.rollout.data_source import RolloutDataSource
from baton.rollout.dump import load_rollout, save_rollout
from baton.rollout.functions import GroupFailed, RolloutStalledError, abort_groups, continued, generate_group
from baton.rollout.reward import RewardTimeout
from baton.rollout.sample import TRAINABLE, Sample, samples_to_data
from baton.strategy import SamplingParams
from baton.tracking import trace


ADMIT_CHUNK = 8  # groups the async producer starts between two turns of the event loop


class RolloutProducer:
    """See the module docstring. `services`: the engine pool, reward and tokenizer the contexts share;
    `sampling_params`: one sample's (n=1); `num_groups_per_step`: the prompt groups a step takes."""

    def __init__(self, services: RolloutServices, data_source: RolloutDataSource, sampling_params: SamplingParams,
                 num_groups_per_step: int):
        self.services, self.pool, self.config, self.ledger = services, services.pool, services.config, services.ledger
        self.data_source, self.tokenizer = data_source, services.tokenizer
        self.sampling_params = sampling_params
        self.num_groups_per_step = num_groups_per_step
        self.rollout_fn = load_plugin(self.config.rollout_function, "rollout_function")
        self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
        # async mode: groups ready for training, and the producer's state (on the loop)
        self._ready: list[list[Sample]] = []
        self._producer: concurrent.futures.Future | None = None
        self._stop_producing: asyncio.Event | None = None
        # Set when a step takes groups, stale ones go back or new weights come: admit again.
        self._wake: asyncio.Event | None = None
        self._grew: asyncio.Event | None = None  # set when a group is ready (or the producer stops): take again
        self._taking = False  # a step waits in `take`
        self._admitted: dict[int, int] = {}  # group_index -> admission number, of each group started or ready
        self._num_admitted = 0
        self._continuous_ctx: RolloutContext | None = None
        self.consumed_steps = 0
        self.pool.on_new_version.append(self._new_weights)

    def context(self) -> RolloutContext:
        return RolloutContext(self.services, self.sampling_params, self.num_groups_per_step)

    @property
    def producing(self) -> bool:
        """Whether the async producer runs (`start_continuous` until `stop_continuous`)."""
        return self._producer is not None

    def _new_weights(self) -> None:
        """The bound moved on: the next step's take may have been done already."""
        if self._producer is not None:
            self.pool.loop.call_soon(self._wake.set)

    # --- sync and one-step-off -----------------------------------------------------------------------

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """The groups of rollout `rollout_id` (the rollout function's, or the saved ones in train-only mode), saved
        when `save_rollouts` is set, and the rollout's metrics."""
        if self.config.load_rollouts is not None:
            return load_rollout(self.config.load_rollouts, rollout_id), {}
        ctx = self.context()
        fn = self.rollout_fn
        if inspect.iscoroutinefunction(fn):
            groups = self.pool.run_bounded(fn(ctx, rollout_id, self.data_source, False), f"rollout {rollout_id}")
        else:
            groups = fn(ctx, rollout_id, self.data_source, False)
        if self.config.save_rollouts is not None:
            save_rollout(self.config.save_rollouts, rollout_id, groups)
        return groups, {**ctx.metrics, **self.pool.router_metrics()}

    def run_in_background(self, fn: Callable, *args) -> concurrent.futures.Future:
        """`fn(*args)` in the producer's background thread, one call after another: the overlapped modes prepare the
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

        self.pool.loop.run(start())
        self._producer = self.pool.loop.submit(self._produce(self._continuous_ctx))

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
        return ready >= needed or (self.pool.version >= self.consumed_steps and ready + num_running >= needed)

    def _planned_version(self, ahead: int) -> int:
        """The version a new group, `ahead` groups behind the next batch's start, is planned to train: that of the
        step that takes batch `ahead // B` from now, consumed_steps + ahead // B."""
        return self.consumed_steps + ahead // self.num_groups_per_step

    def _admit(self, group: list[Sample], planned_version: int) -> None:
        self.ledger.prepare(group, planned_version)
        self._admitted[group[0].group_index] = self._num_admitted
        self._num_admitted += 1

    async def _produce(self, ctx: RolloutContext) -> None:
        running: dict[asyncio.Task, list[Sample]] = {}
        while not self._stop_producing.is_set():
            admitted = 0
            while (self.ledger.admits(planned := self._planned_version(len(self._ready) + len(running)),
                                      self.pool.version) and not self._step_has_priority(len(running))):
                for group in self.data_source.get_samples(1):
                    self._admit(group, planned)
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
                except (RewardTimeout, GroupFailed) as error:
                    self._admitted.pop(group[0].group_index)
                    ctx.count_dropped("reward_timeout" if isinstance(error, RewardTimeout) else "failed_groups")
                    continue
                if not all(sample.status in TRAINABLE for sample in group):  # cut at max_new_tokens_per_rollout:
                    self._admitted.pop(group[0].group_index)  # continued when drawn again, on newer weights
                    self.data_source.add_samples(continued([group]))
                    ctx.metrics["rollout/num_cut_groups"] = ctx.metrics.get("rollout/num_cut_groups", 0.0) + 1.0
                    continue
                keep, reason = ctx.keep(group)
                if keep:
                    self._ready.append(group)
                    self._grew.set()
                else:
                    self._admitted.pop(group[0].group_index)
                    ctx.count_dropped(reason)
        await abort_groups(ctx, running, self.data_source)
        self._grew.set()

    def take(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """(async mode) The next step's groups, waiting at most `watchdog_s` for enough of them."""
        groups, metrics = self.pool.run_bounded(self._take(), "the async step's wait for its groups")
        if self.config.save_rollouts is not None:  # as rollout N, N the step that takes them
            save_rollout(self.config.save_rollouts, self.consumed_steps, groups)
        return groups, {**metrics, **self.pool.router_metrics()}

    async def _take(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """The ready groups settled by the ledger for the version they would train (`consumed_steps`), then the
        oldest first (the fewest go stale), or with the "pace" policy the first admitted, waited for."""
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
            self._ready, stale = self.ledger.settle(self._ready, trained_version)
            if stale:
                for group in stale:
                    self._admitted.pop(group[0].group_index)
                self.data_source.add_samples(stale)
                self._continuous_ctx.count_dropped("stale", len(stale))
                self._wake.set()
            self._ready = self.ledger.order(self._ready, self._admitted)
            if self.ledger.has_turn(self._ready, self._admitted, needed):
                break
            if self._producer.done():
                self._producer.result()  # its error
                raise RuntimeError("the rollout producer stopped")
            if time.monotonic() >= deadline:
                raise RolloutStalledError(self.pool.describe_stall(
                    f"async rollout: {len(self._ready)} of {needed} groups ready after {self.config.watchdog_s:g} s "
                    "(rollout_system.watchdog_s)"))
            self._grew.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._grew.wait(), max(0.0, min(1.0, deadline - time.monotonic())))
        groups, self._ready = self._ready[:needed], self._ready[needed:]
        for group in groups:
            self._admitted.pop(group[0].group_index)
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

        self.pool.loop.run(stop())
        self._producer.result(self.config.abort_timeout_s + 30)
        self._producer = None
        ready, self._ready = self._ready, []
        self.data_source.buffer[:0] = ready
        self._admitted.clear()

    # --- training data ------------------------------------------------------------------------------

    def to_training_data(self, groups: list[list[Sample]], trained_version: int,
                         temperature: float) -> tuple[DataProto, dict[str, float]]:
        """The groups as one training batch, and its staleness metrics. The ledger's gate refuses a trained token
        over the bound and a group trained before (only a custom rollout function can hand one over)."""
        self.ledger.check(groups, trained_version)
        # In the data's order, not the order the engines finished in: mini-batches split the batch alike run to run.
        groups = sorted(groups, key=lambda group: group[0].group_index)
        samples = [sample for group in groups for sample in sorted(group, key=lambda s: s.sample_index)]
        staleness = np.array([self.ledger.staleness([s], trained_version) for s in samples])
        batch = samples_to_data(samples, self.tokenizer.pad_token_id, temperature)
        # Each token's staleness is the trained version less its own; the losses and metrics split by it up to the
        # bound (none in sync mode, where every token is fresh).
        batch.meta_info["trained_version"] = trained_version
        batch.meta_info["max_staleness"] = self.config.max_staleness if self.config.mode != "sync" else 0
        if (current := trace.tracer()) is not None:
            current.batch_made(samples, trained_version, staleness)
        return batch, {"rollout/staleness/mean": float(staleness.mean()), "rollout/staleness/max": float(staleness.max()),
                       "rollout/num_groups": float(len(groups)),
                       "rollout/num_partial_samples": float(sum(s.metadata.get("num_resumes", 0) > 0 for s in samples)),
                       **self.ledger.metrics()}

    # --- state and shutdown -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"data_source": self.data_source.state_dict(), "version": self.pool.version,
                "consumed_steps": self.consumed_steps, "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.data_source.load_state_dict(state["data_source"])
        self.pool.version, self.consumed_steps = state["version"], state["consumed_steps"]
        if "ledger" in state:  # a checkpoint written before the ledger has none
            self.ledger.load_state_dict(state["ledger"])

    def close(self) -> None:
        self.stop_continuous()
        self._background.shutdown(wait=False, cancel_futures=True)


__all__ = ["ADMIT_CHUNK", "RolloutProducer"]
