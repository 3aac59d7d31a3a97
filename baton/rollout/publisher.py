"""`WeightPublisher`: the actor's weights into every engine of the pool, in place, probe-checked; the engines' sleep
while training roles use the devices they share."""

from __future__ import annotations

import concurrent.futures
import functools
import sys

from baton.data import DataProto
from baton.distributed import Cluster
from baton.rollout.engine_worker import WEIGHT_SYNC_TIMEOUT_S
from baton.rollout.functions import RolloutStalledError
from baton.rollout.pool import EnginePool
from baton.data.shards import joined_fingerprints
from baton.workers.weight_sync import ModelUpdatePair, compare_fingerprints


class WeightPublisher:
    """Publishes weight versions to `pool`'s engines and restores them into an engine that restarts.

    probe / probe_atol: a small batch on which an engine's log-probs must agree with the actor's within `probe_atol`,
    checked on the first sync and every `probe_every_syncs`-th; None checks nothing. share_role: the actor's role name
    when each engine shares its process with an actor rank (`colocate_actor_rollout`): the engines point their
    parameters at the actor's tensors instead of loading a copy (probed on the first sync only: from then on both
    hold the same tensors). engines_on_gpu: whether `offload` frees anything (said once when it does not).
    """

    def __init__(self, pool: EnginePool, probe: DataProto | None = None, probe_atol: float = 1e-4, *,
                 share_role: str | None = None, engines_on_gpu: bool = False):
        self.pool, self.config, self.engines = pool, pool.config, pool.engines
        self.probe, self.probe_atol, self.share_role = probe, probe_atol, share_role
        self.engines_on_gpu, self._said_cpu_offload = engines_on_gpu, False
        self._num_syncs = 0  # weight syncs so far in this process: the probe checks every `probe_every_syncs`-th
        self._shards: list | None = None  # the last weights sent (every actor rank's), for an engine that restarts
        self._dtype: str | None = None  # the engines' weight dtype (what a sync sends), asked on the first sync
        self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-check")
        self._weight_check: concurrent.futures.Future | None = None  # the last sync's probe, scored meanwhile
        pool.on_restart = self._resync

    def publish(self, actor: Cluster, version: int, bucket_bytes: int = 256 << 20) -> dict[str, float]:
        """The actor's weights into every engine as `version`, in place: an engine loads them between two decode
        steps (its requests in flight hold meanwhile, then go on with the new weights) and is probe-checked against
        the actor (its steps held for the probe's forward).

        In sync mode the probe is scored before this returns. In the overlapped modes it is scored in the background
        while the next step trains (it is off the step's path): the next sync, or `settle`, waits for it first,
        reports its `weight_sync/max_logprob_diff` and raises its WeightSyncError, before newer weights go in."""
        metrics = self.settle()
        first = self._num_syncs == 0
        due = self._num_syncs % self.config.probe_every_syncs == 0 and (self.share_role is None or first)
        probe = self.probe if due else None
        self._num_syncs += 1
        pairs = [ModelUpdatePair(actor, engine, probe, atol=self.probe_atol) for engine in self.engines]
        # Queued on the actor ahead of the export: its log-probs are the exported weights'.
        ours = actor.call_async("compute_log_probs", probe) if probe is not None and pairs else None
        if self.share_role is not None:
            for engine in self.engines:
                engine.share_weights_with(self.share_role, version)
        else:
            if first and self.engines:
                self._dtype = self.engines[0].weight_dtype()
            shards = actor.export_weights(bucket_bytes, self._dtype)
            # Every engine loads at once (each between two of its decode steps) and proves what it serves.
            loads = [engine.call_async("import_weights", shards, version, fingerprints=True) for engine in self.engines]
            expected = joined_fingerprints(shards)
            for engine, served in zip(self.engines, loads):
                compare_fingerprints(actor.name, engine.name, expected, served.get())
            self._shards = shards
        self.pool.set_version(version)
        if ours is not None:
            check = functools.partial(_check_weights, pairs, ours)
            if self.config.mode == "sync":
                metrics.update(check())
            else:
                self._weight_check = self._checker.submit(check)
        return metrics

    def settle(self) -> dict[str, float]:
        """The last sync's probe, if it is still being scored in the background (overlapped modes): waited for
        (bounded), its metrics returned and its WeightSyncError raised."""
        pending, self._weight_check = self._weight_check, None
        if pending is None:
            return {}
        try:
            return pending.result(WEIGHT_SYNC_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RolloutStalledError(self.pool.describe_stall(
                f"the weight sync's probe was not scored within {WEIGHT_SYNC_TIMEOUT_S:g} s")) from None

    def _resync(self, index: int) -> None:
        """A restarted engine gets the weights the others have."""
        if self._shards is not None:
            self.engines[index].import_weights(self._shards, self.pool.version)

    def offload(self) -> None:
        """Engines sleep before training on devices they share (on CPU this frees nothing; said once)."""
        if not self._said_cpu_offload and not self.engines_on_gpu:
            print("baton: rollout engines on CPU: offload/onload hold their steps but free no memory", file=sys.stderr)
        self._said_cpu_offload = True
        for engine in self.engines:
            engine.offload()

    def onload(self) -> None:
        for engine in self.engines:
            engine.reload()

    def close(self) -> None:
        self._checker.shutdown(wait=False, cancel_futures=True)


def _check_weights(pairs: list[ModelUpdatePair], ours) -> dict[str, float]:
    """Every engine's probe log-probs against the actor's (`ours`: their pending call), the largest difference."""
    log_probs = ours.get().batch["log_probs"]
    return {"weight_sync/max_logprob_diff": max(pair.check(log_probs) for pair in pairs)}


__all__ = ["WeightPublisher"]
