"""Weight sync from a training cluster to an inference cluster (ROLL's model-update pair), checked after every sync.

Every source rank sends its own part of the weights, a bucket at a time (a sharded model's ranks each their rows,
`baton.data.shards`; no rank gathers the whole model); every destination worker puts bucket k of every rank together
and loads it while the sources make bucket k + 1, so the clusters may differ in world size and strategy and the
driver only ever holds references. Where both clusters run on one node, the buckets go through the sources' two
shared-memory slots (`baton.data.shared_buckets`): a source copies its rows in once, cast to the destination's dtype,
and a destination copies them once more, into its parameters. Between nodes they go through Ray's object store, or
gloo groups of the sync's own (`baton.workers.sync_group`). The destination then proves what it serves: the
fingerprints of its weights, computed where they live as each bucket loads, must equal the source's of what it sent
(`compare_fingerprints`); the forward-pass probe stays as an option. When the two roles
share a process (`create_colocated_clusters`) the destination points its parameters at the source's tensors
instead: nothing is copied.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator

import torch

from baton.data import DataProto, TensorBucket
from baton.data.shared_buckets import SharedBucket, available as shared_memory_available, check_generation, read_shared
from baton.data.shards import PartialWeights, WeightShards, assemble, differing, joined_fingerprints
from baton.distributed import Cluster
from baton.workers.sync_group import CollectiveBucket, receive


TRANSPORTS = ("auto", "shared_memory", "collective", "object_store")


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
    transport: how the buckets travel. "shared_memory": through the sources' slots on this host
        (`baton.data.shared_buckets`); "collective": broadcast in gloo groups of each source rank and the destinations
        (`baton.workers.sync_group`, joined on the first sync), for clusters on different nodes; "object_store":
        Ray's (in-process on the local backend); "auto": shared memory where every worker of both clusters runs on
        one node (`on_one_host`), else the object store.
    delta: send only the weights whose fingerprint differs from the one the destination proved it serves after the
        last sync (lossless: a weight is sent whole or not at all; after a full fine-tuning update nearly every weight
        changed, after a LoRA actor's merged update only the adapted projections); every weight is checked after.
    fingerprints: False skips the fingerprint check (the destination's pass over what it loaded; on CPU as long as
        the copy itself): the probe, where given, is then the only check. A delta sync needs them.
    """

    def __init__(self, src: Cluster, dst: Cluster, probe: DataProto | None = None, atol: float = 1e-4,
                 bucket_bytes: int = 256 << 20, share_role: str | None = None, adapter_only: bool = False,
                 delta: bool = False, transport: str = "auto", fingerprints: bool = True):
        assert not (adapter_only and share_role is not None), "a shared model has no adapter of its own to send"
        if delta and not fingerprints:
            raise ValueError("a delta weight sync sends the weights whose fingerprint changed: it needs fingerprints "
                             "(set weight_sync_fingerprints: true, or weight_sync_delta: false)")
        self.src, self.dst, self.probe, self.atol = src, dst, probe, atol
        self.bucket_bytes, self.share_role, self.adapter_only = bucket_bytes, share_role, adapter_only
        self.delta, self.fingerprints = delta, fingerprints
        if transport not in TRANSPORTS:
            raise ValueError(f"weight-sync transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
        if transport == "collective" and src.manager.backend != "ray":
            raise ValueError("weight-sync transport 'collective' joins the workers' processes in a group: it needs the "
                             "ray backend (in one process the buckets are handed over as they are: use 'auto')")
        self._transport = transport
        self._group: str | None = None  # the collective transport's sync group, joined on the first sync
        self.num_syncs = 0
        self._dtype: str | None = None  # the destination's weight dtype, asked on the first sync
        self._served: dict[str, int] = {}  # the fingerprints the destination proved it serves after the last sync

    @property
    def transport(self) -> str:
        """How this pair's buckets travel; "auto" is settled on first use: shared memory where every worker of both
        clusters runs on one node (`on_one_host`), else the object store."""
        if self._transport == "auto":
            shared = self.share_role is None and on_one_host(self.src, self.dst)
            self._transport = "shared_memory" if shared else "object_store"
        return self._transport

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
            sent, served = self._stream(skip)
            if self.fingerprints:
                expected = joined_fingerprints(sent) if expected is None else expected
                if skip:  # the weights left out are checked too: unchanged where the destination serves them
                    for mine, theirs in zip(served, self.dst.weight_fingerprints(skip)):
                        if mine is not None and theirs is not None:
                            mine.update(theirs)
                compare_fingerprints(self.src.name, self.dst.name, expected, served)
                self._served = expected
            if self.delta:
                metrics["weight_sync/sent_fraction"] = 1 - len(skip) / max(len(expected), 1)
        metrics["timing_s/weight_sync"] = time.perf_counter() - start
        if self.probe is not None and (self.share_role is None or self.num_syncs == 0):
            metrics["weight_sync/max_logprob_diff"] = self.check()
        self.num_syncs += 1
        return metrics

    def _stream(self, skip: list[str]) -> tuple[list[WeightShards], list[dict[str, int] | None]]:
        """The source's buckets into the destination one at a time: bucket k loads while the sources make k + 1, and
        each destination worker answers with the fingerprints of the weights bucket k completed, computed from its
        parameters once loaded. What every rank sent (its fingerprints, and the buckets' references), and the
        fingerprints each destination worker computed (None: it computes none)."""
        if self.transport == "collective" and self._group is None:
            self._group = self._join_group()
        # Through shared memory, buckets of half `bucket_bytes` a rank: its two slots hold no more than one bucket.
        shared = self.transport == "shared_memory"
        per_rank = self.bucket_bytes // 2 if shared else self.bucket_bytes
        self.src.begin_export(per_rank, self._dtype, skip, self.transport, self._group, uuid.uuid4().hex)
        sent, sending, pending = [], [], None
        served: list[dict[str, int] | None] = [{} for _ in range(self.dst.world_size)]

        def loaded(load) -> None:
            for worker, theirs in enumerate(load.get()):
                served[worker] = None if theirs is None or served[worker] is None else {**served[worker], **theirs}

        while (part := self.src.next_exported())[0].buckets:
            if pending is not None:  # bucket k must have loaded before the sources are asked for k + 2
                loaded(pending)
            if self.transport == "collective":  # the sources broadcast while the destinations receive
                sending.append(self.src.call_async("send_exported"))
            pending = self.dst.call_async("import_weights", part, fingerprints=self.fingerprints)
            sent.extend(part)
        if pending is not None:
            loaded(pending)
        for send in sending:
            send.get()
        return sent, served

    def _join_group(self) -> str:
        """The collective transport's sync group: served by the source's rank 0, joined by every source rank and
        destination worker at once."""
        group = f"{self.src.name}->{self.dst.name}/{uuid.uuid4().hex[:8]}"
        on_one_node = len({placement.node_index for placement in self.src.placements + self.dst.placements}) == 1
        sizes = self.src.world_size, self.dst.world_size
        [address] = self.src.worker_view(0).open_sync_store(group, on_one_node, sum(sizes))
        joining = [self.src.call_async("join_sync_group", group, address, on_one_node, True, *sizes),
                   self.dst.call_async("join_sync_group", group, address, on_one_node, False, *sizes)]
        for join in joining:
            join.get()
        return group

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


def on_one_host(src: Cluster, dst: Cluster) -> bool:
    """Whether every worker of both clusters is a Ray actor on one node of one resource manager, with shared memory
    there: a sync between them goes through it (`baton.data.shared_buckets`) rather than the object store."""
    nodes = {placement.node_index for placement in src.placements + dst.placements}
    return (src.manager is dst.manager and src.manager.backend == "ray" and len(nodes) == 1
            and shared_memory_available())


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
    """What `put_bucket` made (or a `SharedBucketRing`, or `sync_group.pack`), as a `TensorBucket`: fetched from the
    object store (zero-copy on the same node), read in place in the source's shared-memory slot, or received from the
    source in the sync group."""
    if isinstance(bucket, TensorBucket):
        return bucket
    if isinstance(bucket, SharedBucket):
        return read_shared(bucket)
    if isinstance(bucket, CollectiveBucket):
        return receive(bucket)
    import ray

    return ray.get(bucket)


_STREAMS: dict[str, PartialWeights] = {}  # this destination's weights in blocks, by the streamed sync they come in


def assembled_buckets(shards: list[WeightShards], model: torch.nn.Module | None = None,
                      loaded: list[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Every source rank's `WeightShards` → whole weights, one bucket (of every rank) at a time; a weight sent in
    blocks of rows over several buckets comes with the bucket of its last block. `model`: the destination's, whose own
    tensors take a weight of several pieces as they arrive (copied once, `assemble`'s `into`), read as each bucket is
    put together, so while whoever consumes this loads it. `loaded`: the names of the weights sent whole so far (not
    their tied names) are appended to it as each bucket is asked for, once the one before has loaded. ValueError after
    the last bucket where a weight is still incomplete."""
    counts = {len(part.buckets) for part in shards}
    if len(counts) > 1:
        raise ValueError(f"the source ranks sent {sorted(counts)} buckets: every rank of one sync sends the same "
                         "number")
    stream = shards[0].stream if shards else None
    if stream is None:
        partial = PartialWeights()
    else:  # a streamed sync's weights in blocks span its loads: kept here between them (the last few streams')
        partial = _STREAMS.pop(stream, None) or PartialWeights()
        _STREAMS[stream] = partial
        while len(_STREAMS) > 4:
            del _STREAMS[next(iter(_STREAMS))]
    for k in range(counts.pop() if counts else 0):
        into = model.state_dict().get if isinstance(model, torch.nn.Module) else None
        fetched = [fetch_bucket(part.buckets[k]) for part in shards]
        whole = assemble(fetched, into, partial)
        yield whole
        if loaded is not None:
            loaded.extend(name for name in whole if any(name in bucket.tensors for bucket in fetched))
        for part in shards:  # loaded: a shared-memory slot must still hold what was read
            if isinstance(part.buckets[k], SharedBucket):
                check_generation(part.buckets[k])
    if partial.tensors and stream is None:  # (a stream's are checked by their fingerprints once it has loaded)
        raise ValueError(f"weights {sorted(partial.tensors)[:5]} arrived incomplete (some of their rows' buckets never "
                         "came); the destination serves them half old")


__all__ = ["TRANSPORTS", "ModelUpdatePair", "WeightSyncError", "assembled_buckets", "check_fingerprints",
           "compare_fingerprints", "fetch_bucket", "on_one_host", "probe_batch", "put_bucket"]
