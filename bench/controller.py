"""Controller overhead benchmark: baton's call paths against hand-written Ray, and driver memory.

Measures, in one run: a no-op ONE_TO_ALL call and a DP_COMPUTE echo over 4 workers (baton vs raw
Ray actors doing the same work), DataProto chunk/concat and serialization, and the driver's peak
RSS while one cluster's output is handed to another cluster by reference. Prints a table with the
targets; `--json PATH` also writes the figures, `--check` exits 1 when a target is missed.

    .venv/bin/python bench/controller.py [--quick] [--json /tmp/controller.json] [--check]
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import statistics
import sys
import threading
import time
from typing import Callable

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# A stray Ray call after ray.shutdown() (e.g. a health-check thread) must fail, not attach to another
# Ray instance on this machine.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import numpy as np
import psutil
import ray
import torch

from common import finish, interleaved_times_s, local_ray, parser as common_parser

from baton import DataProto, Dispatch, ResourceManager, Worker, WorkerConfig, create_clusters_parallel, register

NUM_WORKERS = 4
NUM_RAY_CPUS = 8
BATCH_ROWS = 1024
BATCH_COLS = 1024
RSS_COLS = 1024  # float32 columns of the produced batch: 4 KiB per row
RSS_ROWS_1X = 1024  # 1024 rows x 4 KiB = 4 MiB per worker
RSS_SCALE = 8

TARGET_CALL_RATIO = 1.3  # baton / raw Ray, per call path
TARGET_RSS_GROWTH = 1.10  # peak driver RSS at 8x / at 1x


@dataclasses.dataclass(frozen=True)
class Reps:
    noop_calls: int  # timed calls of each side
    echo_calls: int
    local_ops: int  # chunk/concat and serialization repetitions
    rss_runs: int  # by-reference runs per size

    @classmethod
    def for_mode(cls, quick: bool) -> "Reps":
        return cls(noop_calls=30, echo_calls=4, local_ops=5, rss_runs=1) if quick else cls(400, 80, 100, 4)


# --- workers -------------------------------------------------------------------------------------


class BenchWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.DP_COMPUTE)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def produce(self, requests: DataProto) -> DataProto:
        """One RSS_COLS float32 row per request row (as a rollout turns small prompts into large samples), filled
        with this worker's rank."""
        values = torch.full((len(requests), RSS_COLS), float(self.rank), dtype=torch.float32)  # [rows, cols]
        return DataProto.from_dict({"values": values})

    @register(Dispatch.DP_COMPUTE)
    def consume(self, data: DataProto) -> DataProto:
        """One row per shard: the shard's sum, so the driver never receives the data."""
        return DataProto.from_dict({"sum": data.batch["values"].sum(dtype=torch.float64).reshape(1, 1)})  # [1, 1]


class RawActor:
    """What a hand-written Ray program would use: a plain actor with the same methods."""

    def noop(self) -> None:
        return None

    def echo(self, shard: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return shard


# --- measurement helpers -----------------------------------------------------------------------------


def median_pair_ms(baton_fn: Callable[[], object], raw_fn: Callable[[], object], num_calls: int, warmup: int) -> tuple[float, float]:
    """Median ms of each side, timed interleaved (see `interleaved_times_s`)."""
    baton_s, raw_s = interleaved_times_s(baton_fn, raw_fn, num_calls, warmup)
    return statistics.median(baton_s) * 1e3, statistics.median(raw_s) * 1e3


class PeakRss:
    """Samples this process's RSS every ~1 ms in a background thread while active."""

    def __init__(self, interval_s: float = 0.001):
        self._process = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak = 0

    def rss(self) -> int:
        return self._process.memory_info().rss

    def __enter__(self) -> "PeakRss":
        self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self._interval_s)


def make_numpy_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    texts = np.empty(BATCH_ROWS, dtype=object)
    texts[:] = [f"sample {i}: " + "x" * (i % 64) for i in range(BATCH_ROWS)]
    return {
        "tokens": rng.integers(0, 32_000, size=(BATCH_ROWS, BATCH_COLS), dtype=np.int64),  # [rows, cols]
        "scores": rng.standard_normal((BATCH_ROWS, BATCH_COLS), dtype=np.float32),  # [rows, cols]
        "texts": texts,  # [rows] object
    }


def as_dataproto(arrays: dict[str, np.ndarray]) -> DataProto:
    return DataProto.from_dict(
        {"tokens": torch.from_numpy(arrays["tokens"]), "scores": torch.from_numpy(arrays["scores"])},
        {"texts": arrays["texts"]},
    )


# --- benchmarks ------------------------------------------------------------------------------------


def bench_noop(cluster, actors, reps: Reps) -> dict:
    """baton's own Python is ~20 us of a call; most of the difference is Ray's cost of the one argument a baton
    call sends (the request), which the raw no-argument call does not pay."""

    def raw():
        ray.get([a.noop.remote() for a in actors])

    baton_ms, raw_ms = median_pair_ms(cluster.noop, raw, reps.noop_calls, warmup=30)
    return {"baton_ms": baton_ms, "ray_ms": raw_ms, "ratio": baton_ms / raw_ms, "calls": reps.noop_calls}


def bench_dp_echo(cluster, actors, arrays: dict[str, np.ndarray], reps: Reps) -> dict:
    batch = as_dataproto(arrays)

    def raw():
        pieces = {name: np.array_split(column, len(actors)) for name, column in arrays.items()}
        refs = [a.echo.remote({name: p[i] for name, p in pieces.items()}) for i, a in enumerate(actors)]
        shards = ray.get(refs)
        return {name: np.concatenate([shard[name] for shard in shards]) for name in arrays}

    assert cluster.echo(batch).equals(batch), "baton echo did not return the batch"
    raw_result = raw()
    assert all(np.array_equal(raw_result[n], arrays[n]) for n in arrays), "raw echo did not return the batch"
    baton_ms, raw_ms = median_pair_ms(lambda: cluster.echo(batch), raw, reps.echo_calls, warmup=3)
    return {"baton_ms": baton_ms, "ray_ms": raw_ms, "ratio": baton_ms / raw_ms, "calls": reps.echo_calls}


def bench_dataproto_ops(arrays: dict[str, np.ndarray], reps: Reps) -> dict:
    """DataProto's local costs next to the same operation on the plain numpy dict."""
    batch = as_dataproto(arrays)

    def numpy_chunk_concat():
        pieces = {k: np.array_split(v, NUM_WORKERS) for k, v in arrays.items()}
        return {k: np.concatenate(v) for k, v in pieces.items()}

    def pickle5_round_trip(value):
        buffers = []
        payload = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(payload, buffers=buffers)

    def ray_round_trip(value):
        return ray.get(ray.put(value))

    ops = {
        "chunk_concat": (lambda: DataProto.concat(batch.chunk(NUM_WORKERS)), numpy_chunk_concat),
        "pickle5_round_trip": (lambda: pickle5_round_trip(batch), lambda: pickle5_round_trip(arrays)),
        "ray_put_get": (lambda: ray_round_trip(batch), lambda: ray_round_trip(arrays)),
    }
    out = {}
    for name, (baton_fn, numpy_fn) in ops.items():
        baton_ms, numpy_ms = median_pair_ms(baton_fn, numpy_fn, reps.local_ops, warmup=2)
        out[name] = {"baton_ms": baton_ms, "numpy_ms": numpy_ms}
    return out


def bench_driver_rss(producer, consumer, reps: Reps) -> dict:
    """Peak driver RSS while producer's output flows to consumer by reference, at 1x and 8x size.

    Per size: the highest peak over the runs, and the largest growth over the RSS just before a run.
    """
    sampler = PeakRss()
    sizes = {"1x": RSS_ROWS_1X, "8x": RSS_ROWS_1X * RSS_SCALE}
    sum_per_row = sum(float(rank) * RSS_COLS for rank in range(NUM_WORKERS))  # over one row of every shard

    def requests(num_rows: int) -> DataProto:
        """num_rows request rows per worker: 8 bytes each in the driver, against RSS_COLS * 4 bytes produced."""
        return DataProto.from_dict({"index": torch.arange(num_rows * NUM_WORKERS)})  # [rows]

    def by_reference(num_rows: int) -> None:
        summary = consumer.consume(producer.produce(requests(num_rows)))
        assert len(summary) == NUM_WORKERS
        assert float(summary.batch["sum"].sum()) == sum_per_row * num_rows

    by_reference(RSS_ROWS_1X)  # warm-up: first-call imports, serializer and object-store set-up
    gc.collect()
    baseline = sampler.rss()
    peaks: dict[str, list[int]] = {name: [] for name in sizes}
    deltas: dict[str, list[int]] = {name: [] for name in sizes}
    for _ in range(reps.rss_runs):
        for name, num_rows in sizes.items():
            gc.collect()
            before = sampler.rss()
            with sampler:
                by_reference(num_rows)
            peaks[name].append(sampler.peak)
            deltas[name].append(sampler.peak - before)

    # Contrast: fetching the 8x batch into the driver must show up, or the measurement is blind.
    gc.collect()
    before_get = sampler.rss()
    with sampler:
        data = producer.produce(requests(sizes["8x"])).get()
    fetched_bytes = sum(v.numel() * v.element_size() for v in data.batch.values())
    del data
    gc.collect()

    mib = 2**20
    return {
        "bytes_per_worker": {name: rows * RSS_COLS * 4 for name, rows in sizes.items()},
        "runs_per_size": reps.rss_runs,
        "baseline_rss_mib": baseline / mib,
        "peak_rss_1x_mib": max(peaks["1x"]) / mib,
        "peak_rss_8x_mib": max(peaks["8x"]) / mib,
        "max_growth_in_run_1x_mib": max(deltas["1x"]) / mib,
        "max_growth_in_run_8x_mib": max(deltas["8x"]) / mib,
        "growth": max(peaks["8x"]) / max(peaks["1x"]),
        "get_contrast": {
            "batch_mib": fetched_bytes / mib,
            "rss_before_mib": before_get / mib,
            "peak_rss_mib": sampler.peak / mib,
            "growth_mib": (sampler.peak - before_get) / mib,
        },
    }


# --- report ----------------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "PASS" if value <= target else "FAIL"


def print_report(figures: dict) -> None:
    noop, echo, ops, rss = figures["noop"], figures["dp_echo"], figures["dataproto_ops"], figures["driver_rss"]
    print(f"\nbaton controller benchmark: {NUM_WORKERS} workers, ray.init(num_cpus={NUM_RAY_CPUS}) logical CPUs "
          f"on {figures['os_cpu_count']} real CPUs (os.cpu_count()); medians, ms")
    load = figures["load_average_1min"]
    print(f"1-min load average at start / end: {load['start']:.1f} / {load['end']:.1f}"
          + ("  (busy machine: ratios are noisier)" if max(load.values()) > figures["os_cpu_count"] else ""))
    print(f"raw = {NUM_WORKERS} plain Ray actors driven by hand (calls), or the plain numpy dict (local ops); "
          f"{figures['noop']['calls']} no-op and {figures['dp_echo']['calls']} echo calls per side, interleaved\n")
    header = f"{'measurement':<44}{'baton':>10}{'raw':>10}{'ratio':>8}   {'target':<9}result"
    print(header)
    print("-" * len(header))
    for label, entry, target in (
        ("ONE_TO_ALL no-op call (ms)", noop, TARGET_CALL_RATIO),
        ("DP_COMPUTE echo, 12 MiB + 1024 str (ms)", echo, TARGET_CALL_RATIO),
    ):
        print(f"{label:<44}{entry['baton_ms']:>10.3f}{entry['ray_ms']:>10.3f}{entry['ratio']:>8.2f}   "
              f"<= {target:<6}{verdict(entry['ratio'], target)}")
    for label, key in (("DataProto chunk(4) + concat (ms)", "chunk_concat"),
                       ("pickle 5 out-of-band round trip (ms)", "pickle5_round_trip"),
                       ("ray.put + ray.get (ms)", "ray_put_get")):
        entry = ops[key]
        print(f"{label:<44}{entry['baton_ms']:>10.3f}{entry['numpy_ms']:>10.3f}"
              f"{entry['baton_ms'] / entry['numpy_ms']:>8.2f}   (raw = numpy dict, no target)")
    print()
    per_worker = rss["bytes_per_worker"]
    print(f"driver RSS, producer -> consumer by reference ({per_worker['1x'] / 2**20:.0f} MiB and "
          f"{per_worker['8x'] / 2**20:.0f} MiB per worker; baseline {rss['baseline_rss_mib']:.1f} MiB):")
    for size in ("1x", "8x"):
        print(f"  peak at {size} {rss[f'peak_rss_{size}_mib']:10.1f} MiB   (at most +{rss[f'max_growth_in_run_{size}_mib']:.1f} MiB "
              f"in a run, {rss['runs_per_size']} runs)")
    print(f"  growth 8x/1x {rss['growth']:8.3f}       target <= {TARGET_RSS_GROWTH}   "
          f"{verdict(rss['growth'], TARGET_RSS_GROWTH)}")
    contrast = rss["get_contrast"]
    print(f"  contrast: future.get() of the 8x batch ({contrast['batch_mib']:.0f} MiB) grows the driver by "
          f"{contrast['growth_mib']:.1f} MiB")
    print()


def run_benchmarks(reps: Reps, quick: bool) -> dict:
    manager = ResourceManager(num_nodes=1, num_devices_per_node=NUM_WORKERS, backend="ray")
    producer, consumer = create_clusters_parallel(
        [(BenchWorker, WorkerConfig("producer", world_size=NUM_WORKERS)),
         (BenchWorker, WorkerConfig("consumer", world_size=NUM_WORKERS, share_devices_with=("producer",)))],
        manager,
    )
    try:
        actor_cls = ray.remote(num_cpus=0.01)(RawActor)
        actors = [actor_cls.remote() for _ in range(NUM_WORKERS)]
        ray.get([a.noop.remote() for a in actors])
        arrays = make_numpy_batch()

        figures = {"os_cpu_count": os.cpu_count(), "ray_logical_cpus": NUM_RAY_CPUS, "num_workers": NUM_WORKERS,
                   "quick": quick, "repetitions": dataclasses.asdict(reps),
                   "load_average_1min": {"start": os.getloadavg()[0]}}
        figures["driver_rss"] = bench_driver_rss(producer, consumer, reps)
        figures["noop"] = bench_noop(producer, actors, reps)
        figures["dp_echo"] = bench_dp_echo(producer, actors, arrays, reps)
        figures["dataproto_ops"] = bench_dataproto_ops(arrays, reps)
        figures["load_average_1min"]["end"] = os.getloadavg()[0]
    finally:
        for cluster in (producer, consumer):
            cluster.shutdown()
        manager.shutdown()

    figures["noop_ratio_vs_ray"] = figures["noop"]["ratio"]
    figures["dp_echo_ratio_vs_ray"] = figures["dp_echo"]["ratio"]
    figures["driver_rss_growth"] = figures["driver_rss"]["growth"]
    figures["targets"] = {"noop_ratio_vs_ray": TARGET_CALL_RATIO, "dp_echo_ratio_vs_ray": TARGET_CALL_RATIO,
                          "driver_rss_growth": TARGET_RSS_GROWTH}
    figures["passed"] = {key: figures[key] <= target for key, target in figures["targets"].items()}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)

    with local_ray(NUM_RAY_CPUS):
        figures = run_benchmarks(Reps.for_mode(args.quick), args.quick)

    print_report(figures)
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())
