"""Weight-sync benchmark: one sync of a Qwen2.5-0.5B-shaped model (random weights, float32) from 1, 2 and 4 fsdp2
training ranks into 1 and 2 inference engines, on one node of Ray.

Each source rank sends its own rows of every weight, streamed a bucket at a time by `ModelUpdatePair.sync` (which the
timing runs): on one node through its two shared-memory slots (`baton.data.shared_buckets`), each engine putting
bucket k of every rank together and loading it while the sources write bucket k + 1, then proving by fingerprints
what it serves (`check_fingerprints`). Figures, measured in one run:

    sync_gb_per_s               bytes the engines received (model bytes x engines) per second of the sync
    sync_vs_memcpy              that over this machine's memory-copy bandwidth (a float32 tensor copy of 512 MiB, one
                                thread, measured in the same run): the target (>= 0.3) is for the slowest layout
    unchecked_sync_vs_memcpy    the same for a sync without the fingerprint check (`fingerprints=False`): the
                                transport alone, two copies of the bytes where the check adds two passes of hashing
    object_store_sync_gb_per_s  1 source -> 1 engine through Ray's object store instead, and
    collective_sync_gb_per_s    through a gloo group (`transport: collective`), the two paths between nodes
    max_source_rss_vs_model_bytes   the largest source process's peak private memory (resident, less shared pages)
                                during a sync, plus its shared-memory slots, less its memory before it built a model,
                                over the model's bytes; `max_source_vs_shard_plus_bucket` (target <= 1.25): what a
                                source holds during the sync (its shard, what the sync adds to its private memory, its
                                slots) over its shard plus one bucket
    stage_s_per_bucket          one bucket through each stage in the driver: fingerprint, shared-memory write (into a
                                slot written once before, as in every sync after the first) and read, the object
                                store's write for comparison, copy into parameters, fingerprint (where the time goes)
    fingerprint_catches_skipped_bucket  a sync whose destination missed one bucket of every rank raises, naming it
    delta_bytes_ratio           a delta sync after a real update: bytes sent over the model's. A full fine-tuning
                                update changes every weight (ratio 1); `delta_bytes_ratio_lora` is a LoRA actor's
                                (only the adapted projections change)

Engines are `hf` rollout workers (and `vllm` ones where vLLM is installed: `scripts/setup.sh --vllm`). Workers run
with glibc's mmap threshold fixed at 1 MiB, so a freed tensor's pages leave the resident set (see bench/scale.py).

    .venv/bin/python bench/sync.py [--quick] [--json /tmp/sync.json] [--check]
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
# Ray's workers import this file's worker classes and `common` by name.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.abspath(__file__)),
                                                       os.environ.get("PYTHONPATH")] if p)

import psutil
import torch

from common import finish, local_ray, parser as common_parser

from baton import Dispatch, ResourceManager, WorkerConfig, WorkerSpec, create_clusters_parallel, register
from baton.data.shards import WeightShards, joined_fingerprints
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.base import LoraConfig
from baton.workers import ActorWorker, RolloutWorker
from baton.workers.weight_sync import ModelUpdatePair, WeightSyncError, check_fingerprints, fetch_bucket

MODEL, QUICK_MODEL = "qwen2.5-0.5b-shape", "tiny-qwen2"
SOURCES, QUICK_SOURCES = (1, 2, 4), (1, 2)
ENGINES = (1, 2)
BUCKET_BYTES, QUICK_BUCKET_BYTES = 256 << 20, 64 << 10
ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}
TARGETS = {"sync_vs_memcpy": 0.3, "max_source_vs_shard_plus_bucket": 1.25}


def private_bytes() -> int:
    """This process's resident memory less its shared pages (the object store's shared memory among them)."""
    memory = psutil.Process().memory_info()
    return memory.rss - memory.shared


class SyncSource(ActorWorker):
    """An actor rank that reports its memory around a sync: before its model, before the sync, its private peak
    during it (sampled every millisecond), and its shared-memory slots."""

    def __init__(self, config: StrategyConfig):
        self.private_before_model = private_bytes()
        super().__init__(config)

    @register(Dispatch.ONE_TO_ALL)
    def start_sampling(self) -> None:
        self._peak, self._done = [private_bytes()], threading.Event()
        self._before = self._peak[0]

        def sample():
            while not self._done.wait(0.001):
                self._peak[0] = max(self._peak[0], private_bytes())

        self._sampler = threading.Thread(target=sample, daemon=True)
        self._sampler.start()

    @register(Dispatch.ONE_TO_ALL)
    def stop_sampling(self) -> dict:
        self._done.set()
        self._sampler.join()
        shard = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                    for p in self.strategy.hf_model.parameters())
        slots = 0 if self._shared_slots is None else self._shared_slots.num_bytes
        return {"private_before_model": self.private_before_model, "private_before_sync": self._before,
                "peak_private": max(self._peak[0], private_bytes()), "shard_bytes": shard, "slot_bytes": slots}


def memcpy_gb_per_s(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """One-thread float32 tensor copy, the best of `repeats`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.randn(num_bytes // 4)
        target = torch.empty_like(source)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(source)
            best = min(best, time.perf_counter() - start)
        return num_bytes / best / 1e9
    finally:
        torch.set_num_threads(threads)


def stage_seconds(num_bytes: int) -> dict[str, float]:
    """One bucket of `num_bytes` float32 through each stage of a sync, in this process: the source's fingerprint,
    the write into a shared-memory slot (written once before: the slots of a sync after the first) and the read, the
    object store's write (the path between nodes), the copy into parameters, the destination's fingerprint."""
    import ray

    from baton.data import TensorBucket
    from baton.data.shared_buckets import SharedBucketRing, read_shared
    from baton.data.shards import bucket_fingerprints

    bucket = TensorBucket({"w": torch.randn(num_bytes // 4)})
    param = torch.zeros(num_bytes // 4)
    ring = SharedBucketRing(slots=1)
    ring.write(bucket)
    bucket_fingerprints(TensorBucket({"w": torch.zeros(1)}))  # the hash table, made once per process
    times, start = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal start
        times[name] = time.perf_counter() - start
        start = time.perf_counter()

    try:
        bucket_fingerprints(bucket)
        lap("source_fingerprint")
        sent, _ = ring.write(bucket)
        lap("shared_memory_write")
        received = read_shared(sent)
        lap("shared_memory_read")
        ray.put(bucket)
        lap("object_store_write")
        param.copy_(received.tensors["w"])
        lap("copy_into_parameters")
        bucket_fingerprints(TensorBucket({"w": param}))
        lap("destination_fingerprint")
    finally:
        ring.close()
    return times


def model_bytes(config: StrategyConfig) -> int:
    from baton.models import MODEL_CONFIGS
    from baton.models.build import check_model_size

    return check_model_size(MODEL_CONFIGS[config.model]) * 4  # float32


def timed_sync(source, engine, bucket_bytes: int, transport: str = "auto", fingerprints: bool = True) -> float:
    """Seconds of one sync as the pipelines run it (`ModelUpdatePair.sync` without the probe: every rank's buckets
    streamed into the engine, each bucket's weights fingerprinted by the engine as it loads them and checked against
    the sources'); `fingerprints=False`: the transport alone."""
    start = time.perf_counter()
    ModelUpdatePair(source, engine, probe=None, bucket_bytes=bucket_bytes, transport=transport,
                    fingerprints=fingerprints).sync()
    return time.perf_counter() - start


def source_memory(source, engine, bucket_bytes: int) -> list[dict]:
    """Every source rank's memory around one sync."""
    source.start_sampling()
    ModelUpdatePair(source, engine, probe=None, bucket_bytes=bucket_bytes).sync()
    return source.stop_sampling()


def fingerprint_catches_a_skipped_bucket(source, engine, bucket_bytes: int) -> bool:
    """A real update of the source, then a sync whose destination misses one bucket of every rank (one that holds
    whole weights only: a weight sent in blocks of rows is refused incomplete before any fingerprint): the check must
    name that bucket's weights."""
    source.train_step(update_batch(), policy_gradient_loss)
    shards = source.export_weights(bucket_bytes, engine.weight_dtype())
    buckets = [fetch_bucket(bucket) for bucket in shards[0].buckets]
    whole = [k for k, bucket in enumerate(buckets) if k and all(
        tuple(tensor.shape) == tuple(bucket.shapes.get(name, tensor.shape)) for name, tensor in bucket.tensors.items())]
    if not whole:
        return False
    skipped = whole[0]
    engine.import_weights([WeightShards(part.buckets[:skipped] + part.buckets[skipped + 1:]) for part in shards])
    try:
        check_fingerprints(source.name, engine, joined_fingerprints(shards))
    except WeightSyncError as error:
        print(f"skipped bucket {skipped} caught: {str(error)[:160]}...")
        return True
    return False


def run(quick: bool) -> dict:
    model = QUICK_MODEL if quick else MODEL
    bucket_bytes = QUICK_BUCKET_BYTES if quick else BUCKET_BYTES
    config = StrategyConfig(name="fsdp2", model=model, optimizer=OptimizerConfig(lr=1e-4))
    engine_config = StrategyConfig(name="hf", model=model, seed=1)
    total = model_bytes(config)
    figures = {"model": model, "model_bytes": total, "bucket_bytes": bucket_bytes, "quick": quick,
               "os_cpu_count": os.cpu_count(), "memcpy_gb_per_s": memcpy_gb_per_s(), "layouts": [],
               "stage_s_per_bucket": stage_seconds(bucket_bytes)}
    backends = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    sources = QUICK_SOURCES if quick else SOURCES
    # One engine cluster at a time, each source cluster built in turn beside it: the 0.5B shape's engines hold
    # about 3 GB each, and a source rank builds the whole model (2 GB) before sharding it.
    manager = ResourceManager(num_nodes=1, num_devices_per_node=max(sources) + max(ENGINES), backend="ray")
    try:
        for backend in backends:
            for count in ENGINES:
                [engine] = create_clusters_parallel([(
                    WorkerSpec(RolloutWorker, (StrategyConfig(**{**vars(engine_config), "name": backend}),)),
                    WorkerConfig(f"{backend}_{count}", device_mapping=list(range(count)), env_vars=ENV))], manager)
                try:
                    for num_sources in sources:
                        figures["layouts"].append(measure_layout(manager, config, num_sources, engine, count, backend,
                                                                 bucket_bytes, total, figures["memcpy_gb_per_s"],
                                                                 figures))
                    if (backend, count) == ("hf", 1):
                        measure_updates(manager, config, engine, bucket_bytes, figures)
                finally:
                    engine.shutdown()
    finally:
        manager.shutdown()
    slowest = min(figures["layouts"], key=lambda entry: entry["sync_vs_memcpy"])
    figures["sync_gb_per_s"] = slowest["sync_gb_per_s"]
    figures["sync_vs_memcpy"] = slowest["sync_vs_memcpy"]
    figures["unchecked_sync_vs_memcpy"] = min(e["unchecked_sync_vs_memcpy"] for e in figures["layouts"])
    figures["max_source_rss_vs_model_bytes"] = max(e["source_rss_vs_model_bytes"] for e in figures["layouts"])
    figures["max_source_vs_shard_plus_bucket"] = max(e["source_vs_shard_plus_bucket"] for e in figures["layouts"])
    figures["targets"] = dict(TARGETS, fingerprint_catches_skipped_bucket=True)
    figures["passed"] = {"sync_vs_memcpy": figures["sync_vs_memcpy"] >= TARGETS["sync_vs_memcpy"],
                         "max_source_vs_shard_plus_bucket":
                             figures["max_source_vs_shard_plus_bucket"] <= TARGETS["max_source_vs_shard_plus_bucket"],
                         "fingerprint_catches_skipped_bucket": figures["fingerprint_catches_skipped_bucket"]}
    return figures


def measure_delta(actor, engine, bucket_bytes: int) -> float:
    """After a full sync, one real update (a policy-gradient step on a few rows), then a delta sync: the fraction of
    the weights' bytes it sent."""
    pair = ModelUpdatePair(actor, engine, probe=None, bucket_bytes=bucket_bytes, delta=True)
    pair.sync()
    actor.train_step(update_batch(), policy_gradient_loss)
    sizes = weight_bytes(actor)
    before = dict(pair._served)
    pair.sync()
    changed = [name for name, value in pair._served.items() if before.get(name) != value]
    return sum(sizes[name] for name in changed) / sum(sizes.values())


def weight_bytes(actor) -> dict[str, int]:
    """Each weight's bytes as a sync sends it (by the rank that sends it; tied names once)."""
    sizes: dict[str, int] = {}
    for part in actor.export_weights(1 << 40):  # one bucket per rank: only shapes are read
        for bucket in part.buckets:
            bucket = fetch_bucket(bucket)
            for name, shape in bucket.shapes.items():
                sizes[name] = int(torch.Size(shape).numel()) * bucket.tensors[name].element_size()
    return sizes


def build(manager, worker, config: StrategyConfig, name: str, num_workers: int):
    """A cluster of `num_workers` on the slots after the engines' (ENGINES at most)."""
    [cluster] = create_clusters_parallel([(WorkerSpec(worker, (config,)), WorkerConfig(
        name, device_mapping=list(range(max(ENGINES), max(ENGINES) + num_workers)), env_vars=ENV))], manager)
    return cluster


def measure_layout(manager, config: StrategyConfig, num_sources: int, engine, num_engines: int, backend: str,
                   bucket_bytes: int, total: int, memcpy: float, figures: dict) -> dict:
    """One warm-up sync and one timed sync from `num_sources` fsdp2 ranks into `engine` (and, for one source into one
    hf engine, one through the object store), then one more with the sources' memory sampled."""
    source = build(manager, SyncSource, config, f"source_{num_sources}", num_sources)
    try:
        timed_sync(source, engine, bucket_bytes)  # warm-up: first imports, the engine's dtype, the slots
        seconds = timed_sync(source, engine, bucket_bytes)
        unchecked = timed_sync(source, engine, bucket_bytes, fingerprints=False)
        if (num_sources, num_engines, backend) == (1, 1, "hf"):
            for transport in ("object_store", "collective"):
                timed_sync(source, engine, bucket_bytes, transport)  # the first collective sync joins its groups
                figures[f"{transport}_sync_gb_per_s"] = total / timed_sync(source, engine, bucket_bytes, transport) / 1e9
        memory = source_memory(source, engine, bucket_bytes)
    finally:
        source.shutdown()
    # What a source holds during the sync: its shard, what the sync adds to its private memory (the resident set less
    # shared pages) and its shared-memory slots.
    added = [m["peak_private"] - m["private_before_sync"] + m["slot_bytes"] for m in memory]
    worst = max(range(len(memory)), key=lambda rank: memory[rank]["shard_bytes"] + added[rank])
    held = memory[worst]["shard_bytes"] + added[worst]
    entry = {"sources": num_sources, "engines": num_engines, "backend": backend, "sync_s": seconds,
             "sync_gb_per_s": total * num_engines / seconds / 1e9, "source_held_bytes": held,
             "shard_bytes": memory[worst]["shard_bytes"], "slot_bytes": memory[worst]["slot_bytes"],
             "source_vs_shard_plus_bucket": held / (memory[worst]["shard_bytes"] + bucket_bytes),
             "source_rss_vs_model_bytes": max(m["peak_private"] + m["slot_bytes"] - m["private_before_model"]
                                              for m in memory) / total}
    entry["sync_vs_memcpy"] = entry["sync_gb_per_s"] / memcpy
    entry["unchecked_sync_s"] = unchecked
    entry["unchecked_sync_vs_memcpy"] = total * num_engines / unchecked / 1e9 / memcpy
    print(f"{num_sources} source(s) -> {num_engines} {backend} engine(s): {seconds:.2f} s, "
          f"{entry['sync_gb_per_s']:.2f} GB/s ({entry['sync_vs_memcpy']:.2f} x memcpy; without the fingerprint check "
          f"{unchecked:.2f} s, {entry['unchecked_sync_vs_memcpy']:.2f} x), largest source "
          f"{held / 2**20:.0f} MiB = {entry['source_vs_shard_plus_bucket']:.2f} x (shard + bucket)")
    return entry


def measure_updates(manager, config: StrategyConfig, engine, bucket_bytes: int, figures: dict) -> None:
    """On one source rank: a real update and a sync missing a bucket (the fingerprint check must name it); delta
    syncs after a full fine-tuning update and after a LoRA actor's."""
    source = build(manager, SyncSource, config, "update_source", 1)
    try:
        figures["fingerprint_catches_skipped_bucket"] = fingerprint_catches_a_skipped_bucket(source, engine,
                                                                                              bucket_bytes)
        figures["delta_bytes_ratio"] = measure_delta(source, engine, bucket_bytes)
    finally:
        source.shutdown()
    lora = build(manager, ActorWorker, StrategyConfig(**{**vars(config), "name": "hf", "lora": LoraConfig()}),
                 "lora_actor", 1)
    try:
        figures["delta_bytes_ratio_lora"] = measure_delta(lora, engine, bucket_bytes)
    finally:
        lora.shutdown()


def update_batch():
    """Four rows with advantages: a real policy-gradient update (every weight that takes part moves)."""
    from baton.models import load_tokenizer
    from baton.workers.weight_sync import probe_batch

    batch = probe_batch(load_tokenizer(), ["12+7=19", "3*4=12", "100-1=99", "8/2=4"], 3)
    batch.batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return batch


def policy_gradient_loss(outputs: dict[str, torch.Tensor], micro_batch):
    mask = micro_batch.batch["response_mask"]
    return (-outputs["log_probs"] * micro_batch.batch["advantages"][:, None] * mask).sum(), {}


def main(argv: list[str] | None = None) -> int:
    args = common_parser(__doc__.splitlines()[0]).parse_args(argv)
    with local_ray(num_cpus=16):
        figures = run(args.quick)
    stages = figures["stage_s_per_bucket"]
    print("one bucket, seconds per stage: " + ", ".join(f"{name} {seconds:.3f}" for name, seconds in stages.items()))
    print(f"memcpy {figures['memcpy_gb_per_s']:.1f} GB/s; slowest sync {figures['sync_gb_per_s']:.2f} GB/s = "
          f"{figures['sync_vs_memcpy']:.2f} x memcpy (without the fingerprint check "
          f"{figures['unchecked_sync_vs_memcpy']:.2f} x; 1 -> 1 through the object store "
          f"{figures['object_store_sync_gb_per_s']:.2f} GB/s, collective {figures['collective_sync_gb_per_s']:.2f} GB/s); "
          f"largest source {figures['max_source_vs_shard_plus_bucket']:.2f} x "
          f"(shard + bucket), {figures['max_source_rss_vs_model_bytes']:.2f} x the model; skipped bucket caught: "
          f"{figures['fingerprint_catches_skipped_bucket']}; delta sync after an update: "
          f"{figures['delta_bytes_ratio']:.2f} of the bytes (LoRA actor: {figures['delta_bytes_ratio_lora']:.2f})")
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
