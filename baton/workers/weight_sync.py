"""Weight sync from a training cluster to an inference cluster (ROLL's model-update pair), checked after every sync.

Every source rank puts its own part of the weights, a bucket at a time, in Ray's object store (a sharded model's
ranks each their rows, `baton.data.shards`; no rank gathers the whole model); every destination worker fetches
bucket k of every rank, puts the weights together and loads them while the sources make bucket k + 1, so the
clusters may differ in world size and strategy and the driver only ever holds references. On one node the object store is shared memory: a destination
reads the pieces in place and copies them once, into its parameters. The destination then proves what it serves:
the fingerprints of its weights, computed where they live, must equal the source's of what it sent
(`check_fingerprints`); the forward-pass probe stays as an option. When the two roles share a process
(`create_colocated_clusters`) the destination points its parameters at the source's tensors instead: nothing is
copied.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from baton.data import DataProto, TensorBucket
from baton.data.shards import WeightShards, assemble, differing, joined_fingerprints
from baton.distributed import Cluster


class WeightSyncError(RuntimeError):
    """After a sync the destination's log-probs disagree with the source's."""


class ModelUpdatePair:
    """`src` → `dst`; both are clusters of `ModelWorker`s (the destination a `RolloutWorker` when sharing).

    probe: a small batch (input_ids, attention_mask, responses, response_mask) on which both sides'
        log-probs must agree within `atol` after each sync; None skips the check. float32 models
        on matching strategies agree to ~1e-6; raise `atol` for bf16 or a different inference engine.
    share_role: the source's role name when the two are colocated in one process: share, don't copy.
        A sharing pair is probed on its first sync only: from then on both sides hold the same tensors.
    adapter_only: send only a LoRA source's adapter (`export_adapter` -> `import_adapter`), which the destination
        serves on its own copy of the base; the probe then checks that the destination serves it.
    delta: send only the weights whose fingerprint differs from the one the destination proved it serves after the
        last sync (lossless: a weight is sent whole or not at all; after a full fine-tuning update nearly every weight
        changed, after a LoRA actor's merged update only the adapted projections); every weight is checked after.
    """

    def __init__(self, src: Cluster, dst: Cluster, probe: DataProto | None = None, atol: float = 1e-4,
                 bucket_bytes: int = 256 << 20, share_role: str | None = None, adapter_only: bool = False,
                 delta: bool = False):
        assert not (adapter_only and share_role is not None), "a shared model has no adapter of its own to send"
        self.src, self.dst, self.probe, self.atol = src, dst, probe, atol
        self.bucket_bytes, self.share_role, self.adapter_only = bucket_bytes, share_role, adapter_only
        self.delta = delta
        self.num_syncs = 0
        self._dtype: str | None = None  # the destination's weight dtype, asked on the first sync
        self._served: dict[str, int] = {}  # the fingerprints the destination proved it serves after the last sync

    def source_log_probs(self):
        """The source's log-probs on the probe's tokens (what `check` compares the destination's with)."""
        return self.src.compute_log_probs(self.probe).batch["log_probs"]

    def sync(self) -> dict[str, float]:
        start = time.perf_counter()
        metrics = {}
        if self.share_role is not None:
            self.dst.share_weights_with(self.share_role)
        elif self.adapter_only:
            self.dst.import_adapter(self.src.export_adapter())
        else:
            if self.num_syncs == 0:
                self._dtype = self.dst.weight_dtype()
            expected, skip = None, []
            if self.delta:  # the weights whose fingerprint is the one the destination already serves stay
                per_rank = self.src.piece_fingerprints(self._dtype)
                expected = joined_fingerprints([WeightShards([], part) for part in per_rank])
                skip = sorted(name for name, value in expected.items() if self._served.get(name) == value)
            sent = joined_fingerprints(self._stream(skip))
            expected = sent if expected is None else expected
            check_fingerprints(self.src.name, self.dst, expected)  # every weight, the ones left out included
            self._served = expected
            if self.delta:
                metrics["weight_sync/sent_fraction"] = 1 - len(skip) / max(len(expected), 1)
        metrics["timing_s/weight_sync"] = time.perf_counter() - start
        if self.probe is not None and (self.share_role is None or self.num_syncs == 0):
            metrics["weight_sync/max_logprob_diff"] = self.check()
        self.num_syncs += 1
        return metrics

    def _stream(self, skip: list[str]) -> list[WeightShards]:
        """The source's buckets into the destination one at a time: bucket k loads while the source makes k + 1.
        What every rank sent (its fingerprints, and the buckets' references)."""
        self.src.begin_export(self.bucket_bytes, self._dtype, skip)
        sent, loading = [], None
        while (part := self.src.next_exported())[0].buckets:
            if loading is not None:
                loading.get()
            loading = self.dst.call_async("import_weights", part)
            sent.extend(part)
        if loading is not None:
            loading.get()
        return sent

    def check(self, ours=None) -> float:
        """Largest |log p_src - log p_dst| on the probe's response tokens; raises `WeightSyncError` above `atol`.
        ours: the source's log-probs on the probe, computed before (`source_log_probs`), e.g. while the destination
        was still busy; else computed here."""
        ours = self.source_log_probs() if ours is None else ours
        theirs = self.dst.compute_log_probs(self.probe).batch["log_probs"]
        mask = self.probe.batch["response_mask"].bool()
        diff = float((ours - theirs).abs().masked_fill(~mask, 0.0).max()) if mask.any() else 0.0
        if not diff <= self.atol:  # also catches NaN
            raise WeightSyncError(
                f"after syncing {self.src.name!r} → {self.dst.name!r} their log-probs differ by up to {diff:.3g} "
                f"(tolerance {self.atol:g}) on the probe batch: the destination did not receive the trained weights"
            )
        return diff


def check_fingerprints(source: str, dst: Cluster, expected: dict[str, int]) -> int:
    """Every destination worker's fingerprints of the weights against the source's (`expected`, e.g.
    `joined_fingerprints` of what a sync sent); raises `WeightSyncError` naming the weights that differ. Returns how
    many weights were compared on each worker that computes fingerprints (0 where none does: vLLM, sharded models,
    which the probe checks instead)."""
    return compare_fingerprints(source, dst.name, expected, dst.weight_fingerprints(sorted(expected)))


def compare_fingerprints(source: str, destination: str, expected: dict[str, int],
                         served: list[dict[str, int] | None]) -> int:
    """`check_fingerprints` on fingerprints already asked of the destination's workers (`served`, one per worker)."""
    compared = 0
    for worker, theirs in enumerate(served):
        if theirs is None:
            continue
        wrong = differing(expected, theirs)
        if wrong:
            raise WeightSyncError(
                f"after syncing {source!r} → {destination!r}, worker {worker} serves other values than {source!r} "
                f"holds for {len(wrong)} of {len(expected)} weights ({', '.join(wrong[:5])}"
                f"{', ...' if len(wrong) > 5 else ''}) by their fingerprints: the sync did not deliver them, or they "
                "changed after it")
        compared = len(expected)
    return compared


def probe_batch(tokenizer, texts: list[str], response_len: int) -> DataProto:
    """A probe from plain texts: each text's last `response_len` tokens are the response (texts left-padded)."""
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
    if input_ids.shape[1] <= response_len:
        raise ValueError(f"probe texts need more than response_len={response_len} tokens")
    responses = input_ids[:, -response_len:]
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask, "responses": responses,
        "response_mask": attention_mask[:, -response_len:].clone(), "prompts": input_ids[:, :-response_len],
    }, meta_info={"temperature": 1.0})


def put_bucket(bucket: TensorBucket, backend: str):
    """`bucket` as a worker returns it: an object-store reference on Ray (the driver never holds weights), else
    itself."""
    if backend != "ray":
        return bucket
    import ray

    return ray.put(bucket)


def fetch_bucket(bucket) -> TensorBucket:
    """What `put_bucket` made, as a `TensorBucket` (fetched from the object store: zero-copy on the same node)."""
    if isinstance(bucket, TensorBucket):
        return bucket
    import ray

    return ray.get(bucket)


def assembled_buckets(shards: list[WeightShards]) -> Iterator[dict[str, torch.Tensor]]:
    """Every source rank's `WeightShards` → whole weights, one bucket (of every rank) at a time."""
    counts = {len(part.buckets) for part in shards}
    if len(counts) > 1:
        raise ValueError(f"the source ranks sent {sorted(counts)} buckets: every rank of one sync sends the same "
                         "number")
    for k in range(counts.pop() if counts else 0):
        yield assemble([fetch_bucket(part.buckets[k]) for part in shards])


__all__ = ["ModelUpdatePair", "WeightSyncError", "assembled_buckets", "check_fingerprints", "compare_fingerprints",
           "fetch_bucket",
           "probe_batch", "put_bucket"]
