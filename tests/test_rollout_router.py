"""The rollout system's engine pool: `EngineWorker`s on tiny-qwen2 behind a `Router`. Least-outstanding routing,
affinity, seeds, abort, refused requests and close on the local backend; an engine that dies (Ray), reports itself
unhealthy, or whose step fails is taken out, its requests retried on the other engine, and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from baton import Cluster, Dispatch, WorkerConfig, WorkerSpec, create_clusters_parallel, register
from baton.engines.protocol import EngineHealth, GenerationRequest
from baton.models.tokenizer import CHAR_VOCAB_SIZE
from baton.rollout.engine_worker import EngineWorker
from baton.rollout.router import EngineFailedError, Router
from baton.strategy import SamplingParams, StrategyConfig
from conftest import wait_until

NEVER = CHAR_VOCAB_SIZE  # a stop id outside the vocabulary: requests run to max_new_tokens
PROMPT = (5, 6, 7, 8)
TIMEOUT_S = 120  # bounds every wait; none is expected to come near it
CONFIG = StrategyConfig(model="tiny-qwen2", seed=0)


class ProbedEngineWorker(EngineWorker):
    """An engine worker a test can break: its health turns unhealthy, or its next decode step raises."""

    def __init__(self, config: StrategyConfig):
        super().__init__(config)
        self.unhealthy = False

    @register(Dispatch.ONE_TO_ALL_ONE)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL_ONE)
    def report_unhealthy(self) -> None:
        self.unhealthy = True

    @register(Dispatch.ONE_TO_ALL_ONE)
    def health(self) -> EngineHealth:
        health = super().health()
        if self.unhealthy:
            return EngineHealth(False, 0, 0, health.paused, health.sleeping, health.weight_version, "simulated failure")
        return health

    @register(Dispatch.ONE_TO_ALL_ONE)
    def fail_next_step(self) -> None:
        def step(new, cancelled):
            raise RuntimeError("simulated decode step failure")

        self.engine._step = step


def request(request_id: str, seed: int = 0, max_new_tokens: int = 8, temperature: float = 1.0,
            prompt: tuple[int, ...] = PROMPT) -> GenerationRequest:
    params = SamplingParams(n=1, seed=seed, temperature=temperature, max_new_tokens=max_new_tokens,
                            stop_token_ids=(NEVER,))
    return GenerationRequest(request_id, prompt, params)


def make_engines(manager, num_engines: int = 2, worker: type = EngineWorker, **config_kwargs) -> list[Cluster]:
    """`num_engines` clusters of one engine worker each (the router's pool), started together."""
    return create_clusters_parallel([(WorkerSpec(worker, (CONFIG,)), WorkerConfig(f"engine{i}", world_size=1,
                                                                                  device_mapping=[i], **config_kwargs))
                                     for i in range(num_engines)], manager)


def mark_versions(engines: list[Cluster]) -> None:
    """Give engine i weight version i (no weights change), so each result's `weight_version` names its engine."""
    for index, engine in enumerate(engines):
        if index:
            engine.import_weights([], version=index)


def tokens_so_far(engines: list[Cluster]) -> list[int]:
    """How many tokens each request in flight on the engines has generated (local backend: they run in this
    process)."""
    counts = []
    for engine in engines:
        worker = engine._group.hosts[0]._workers[engine._role]
        counts += [len(sequence.response_ids) for sequence in list(worker.engine._in_flight.values())]
    return counts


def results(futures) -> list:
    return [future.result(timeout=TIMEOUT_S) for future in futures]


@pytest.fixture(scope="module")
def local_engines():
    """Two engines with the same weights (CONFIG's seed); engine 1 at weight version 1 to tell them apart."""
    from baton import ResourceManager

    manager = ResourceManager(1, 2, backend="local")
    engines = make_engines(manager)
    mark_versions(engines)
    yield engines
    for engine in engines:
        engine.shutdown()
    manager.shutdown()


@pytest.fixture
def make_pool(make_manager):
    """`make_pool(backend, **config_kwargs)`: two `ProbedEngineWorker` engines marked by `mark_versions`, shut down
    after the test (a cluster's health monitor outlives its manager, and would touch Ray after it shut down)."""
    pools = []

    def make(backend: str, **config_kwargs) -> list[Cluster]:
        engines = make_engines(make_manager(backend, 1, 2), worker=ProbedEngineWorker, **config_kwargs)
        pools.append(engines)
        mark_versions(engines)
        return engines

    yield make
    for engine in (engine for engines in pools for engine in engines):
        engine.shutdown()


@pytest.fixture
def router(local_engines):
    router = Router(local_engines)
    yield router
    router.close()


# --- local backend -----------------------------------------------------------------------------------


def test_concurrent_requests_spread_over_the_engines_by_outstanding_load(router):
    requests = [request(f"r{i}", seed=i) for i in range(40)]
    done = results(router.submit(requests))
    assert [r.request_id for r in done] == [r.request_id for r in requests]
    assert all(r.finish_reason == "length" and len(r.response_ids) == 8 for r in done)
    metrics = router.metrics()
    # One call, both engines idle: least outstanding alternates 0, 1, 0, 1, ...
    assert metrics["router/engine_0/served"] == metrics["router/engine_1/served"] == 20
    assert sorted(r.weight_version for r in done) == [0] * 20 + [1] * 20
    assert metrics["router/engine_0/outstanding"] == metrics["router/engine_1/outstanding"] == 0
    assert metrics["router/num_in_flight"] == 0 and router.num_in_flight == 0
    assert metrics["router/retries"] == metrics["router/restarts"] == 0

    # From several threads at once: every request is served once, and neither engine is left idle.
    threaded: list = []
    lock = threading.Lock()

    def submit(thread_index: int) -> None:
        batch = router.submit([request(f"t{thread_index}-{i}", seed=i) for i in range(10)])
        with lock:
            threaded.extend(batch)

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    done = results(threaded)
    assert len({r.request_id for r in done}) == 40
    metrics = router.metrics()
    assert metrics["router/engine_0/served"] + metrics["router/engine_1/served"] == 80
    assert {r.weight_version for r in done} == {0, 1}
    assert metrics["router/engine_0/outstanding"] == metrics["router/engine_1/outstanding"] == 0


def test_a_seed_gives_the_same_tokens_on_either_engine(router):
    seeds = range(12)
    first = results(router.submit([request(f"a{s}", seed=s) for s in seeds]))
    # Reversed, each seed lands on the other engine (alternation starts at engine 0 again).
    second = results(router.submit([request(f"b{s}", seed=s) for s in reversed(seeds)]))[::-1]
    for a, b in zip(first, second):
        assert a.weight_version != b.weight_version, "the two runs of a seed should use different engines"
        assert a.response_ids == b.response_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)
    assert len({r.response_ids for r in first}) > 1, "different seeds should sample different responses"


def test_requests_with_one_affinity_key_stay_on_one_engine(router):
    greedy = dict(temperature=0.0, max_new_tokens=4)
    keys = ["conv-a", "conv-b", "conv-c", "conv-d"]
    first = results(router.submit([request(f"{k}-0", **greedy) for k in keys], keys))
    engine_of = {k: r.weight_version for k, r in zip(keys, first)}
    assert sorted(engine_of.values()) == [0, 0, 1, 1]  # new keys go by load, like unkeyed requests
    for turn in range(1, 4):
        # All of one key in one call, beside unkeyed load: least outstanding alone would spread them.
        batch = [request(f"{k}-{turn}-{j}", **greedy) for k in keys for j in range(3)] + [request(f"x{turn}-{j}")
                                                                                          for j in range(4)]
        batch_keys = [k for k in keys for _ in range(3)] + [None] * 4
        for result, key in zip(results(router.submit(batch, batch_keys)), batch_keys):
            if key is not None:
                assert result.weight_version == engine_of[key], f"{result.request_id} left {key}'s engine"
    metrics = router.metrics()
    assert metrics["router/retries"] == 0 and metrics["router/num_in_flight"] == 0


def test_abort_returns_partial_results_and_settles_each_future_once(router, local_engines, monkeypatch):
    ids = [f"long{i}" for i in range(4)]
    settled: list[tuple[str, bool]] = []  # (request id, whether it settled the request) of each result the router got
    settle = router._settle

    def counted_settle(index, item):
        settles = settle(index, item)
        if item.request_id in ids:
            settled.append((item.request_id, settles))
        return settles

    monkeypatch.setattr(router, "_settle", counted_settle)
    futures = router.submit([request(i, seed=n, max_new_tokens=200) for n, i in enumerate(ids)])
    wait_until(lambda: sum(n > 0 for n in tokens_so_far(local_engines)) == 4, "each request to decode a token")
    aborted = router.abort(ids + ["long0", "never-submitted"])
    assert [r.request_id for r in aborted] == ids  # duplicates and unknown ids skipped
    assert all(r.finish_reason == "abort" and 0 < len(r.response_ids) < 200 for r in aborted)
    assert all(len(r.response_ids) == len(r.log_probs) == len(r.weight_versions) for r in aborted)
    assert results(futures) == aborted
    assert router.num_in_flight == 0
    # Each result comes twice, from abort and, the engine's own copy, out of poll: the first settles it, the
    # router drops the other.
    wait_until(lambda: len(settled) >= 8, "the engines' copies of the aborted results to come out of poll")
    assert len(settled) == 8 and sorted(i for i, settles in settled if settles) == ids, settled
    assert all(e.health().num_running == 0 for e in local_engines)
    metrics = router.metrics()
    assert metrics["router/engine_0/outstanding"] == metrics["router/engine_1/outstanding"] == 0
    assert metrics["router/num_alive_engines"] == 2 and metrics["router/restarts"] == 0

    finished = router.generate(request("short")).result(timeout=TIMEOUT_S)
    assert router.abort(["short", "long1"]) == []  # finished and already aborted: not in flight
    assert finished.finish_reason == "length"


def test_a_duplicate_request_id_is_refused_and_leaves_nothing_behind(router):
    future = router.generate(request("dup", max_new_tokens=16))
    with pytest.raises(ValueError, match="already in flight"):
        router.generate(request("dup"))
    with pytest.raises(ValueError, match="already in flight"):
        router.submit([request("fresh"), request("dup")])
    with pytest.raises(ValueError, match="already in flight"):
        router.submit([request("twice"), request("twice")])
    assert future.result(timeout=TIMEOUT_S).finish_reason == "length"
    assert router.num_in_flight == 0  # "fresh" and "twice" were not left waiting
    assert router.generate(request("fresh")).result(timeout=TIMEOUT_S).request_id == "fresh"


def test_a_refused_request_fails_alone_and_the_engine_keeps_serving(router):
    futures = router.submit([request("ok0"), request("bad", prompt=(5, 10**6)), request("ok1")])
    with pytest.raises(EngineFailedError, match="outside the model's vocabulary"):
        futures[1].result(timeout=TIMEOUT_S)
    assert [r.finish_reason for r in results([futures[0], futures[2]])] == ["length", "length"]
    metrics = router.metrics()
    assert metrics["router/num_alive_engines"] == 2
    assert metrics["router/restarts"] == metrics["router/retries"] == 0
    assert router.generate(request("after")).result(timeout=TIMEOUT_S).finish_reason == "length"


def test_a_cancelled_caller_does_not_take_its_engine_out(router):
    future = router.generate(request("uncancellable", max_new_tokens=16))
    assert not future.cancel()  # a request is stopped with abort, not by cancelling its future

    async def give_up_waiting() -> None:  # as the engine pool waits: cancelling the task cancels the wrapper
        task = asyncio.ensure_future(asyncio.wrap_future(router.generate(request("abandoned", max_new_tokens=16))))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(give_up_waiting())
    assert future.result(timeout=TIMEOUT_S).finish_reason == "length"
    wait_until(lambda: router.num_in_flight == 0, "the abandoned request to finish")
    metrics = router.metrics()
    assert metrics["router/num_alive_engines"] == 2 and metrics["router/restarts"] == 0


def test_close_fails_what_is_in_flight(local_engines):
    router = Router(local_engines)
    futures = router.submit([request(f"c{i}", max_new_tokens=200) for i in range(4)])
    router.close()
    for future in futures:
        with pytest.raises(EngineFailedError, match="closed"):
            future.result(timeout=TIMEOUT_S)
    with pytest.raises(RuntimeError, match="closed"):
        router.generate(request("late"))
    for engine in local_engines:  # the engines stopped generating them, and have no result left queued
        assert engine.health().num_running == 0
        assert engine.poll(0.0) == []


def test_a_failure_seen_by_a_call_to_a_restarted_engines_earlier_incarnation_is_ignored(make_pool):
    engines = make_pool("local")
    router = Router(engines)
    try:
        router._engine_failed(0, RuntimeError("engine 0 died"), incarnation=0)
        wait_until(lambda: router.metrics()["router/num_alive_engines"] == 2, "engine 0 back in the pool")
        assert router._state[0].incarnation == 1 and router.metrics()["router/restarts"] == 1
        router._engine_failed(0, RuntimeError("a poll of the dead engine 0, answered late"), incarnation=0)
        assert router.metrics()["router/num_alive_engines"] == 2 and router.metrics()["router/restarts"] == 1
        assert results([router.generate(request("after"))])[0].finish_reason == "length"
    finally:
        router.close()


def test_an_unhealthy_engine_is_taken_out_retried_elsewhere_and_restarted(make_pool):
    engines = make_pool("local")
    restarted = []
    router = Router(engines, health_interval_s=0.1, on_restart=restarted.append)
    try:
        futures = router.submit([request(f"u{i}", seed=i, max_new_tokens=48) for i in range(6)])
        engines[0].report_unhealthy()
        done = results(futures)
        assert [r.request_id for r in done] == [f"u{i}" for i in range(6)]
        assert all(r.finish_reason == "length" and len(r.response_ids) == 48 for r in done)
        wait_until(lambda: router.metrics()["router/restarts"] == 1, "engine 0 restarted")  # may lag the retries
        metrics = router.metrics()
        assert metrics["router/retries"] >= 1
        assert metrics["router/restarts"] == 1 and restarted == [0]
        assert metrics["router/engine_0/served"] + metrics["router/engine_1/served"] == 6
        assert router._state[0].last_error is not None and "simulated failure" in router._state[0].last_error
        wait_until(lambda: router.metrics()["router/num_alive_engines"] == 2, "engine 0 back in the pool")
        again = results(router.submit([request(f"v{i}") for i in range(4)]))
        assert {r.weight_version for r in again} == {0, 1}  # the restarted engine serves again
        assert router.metrics()["router/restarts"] == 1
    finally:
        router.close()


def test_a_failed_decode_step_retries_its_requests_on_another_engine(make_pool):
    engines = make_pool("local")
    restarted = []
    router = Router(engines, on_restart=restarted.append)
    try:
        engines[0].fail_next_step()
        futures = router.submit([request(f"f{i}", seed=i) for i in range(6)])
        done = results(futures)  # not EngineFailedError: the requests were the engine's victims, not its cause
        assert [r.request_id for r in done] == [f"f{i}" for i in range(6)]
        assert all(r.finish_reason == "length" for r in done)
        wait_until(lambda: router.metrics()["router/restarts"] == 1, "engine 0 restarted")  # may lag the retries
        metrics = router.metrics()
        assert metrics["router/retries"] == 3 and metrics["router/restarts"] == 1 and restarted == [0]
        assert "simulated decode step failure" in router._state[0].last_error
        assert results([router.generate(request("g"))])[0].weight_version == 0  # the restarted engine 0 serves
    finally:
        router.close()


def test_without_restarts_a_failed_engine_stays_out_and_requests_fail_once_none_is_left(make_pool):
    engines = make_pool("local")
    router = Router(engines, restart_engines=False)
    try:
        engines[0].fail_next_step()
        done = results(router.submit([request(f"p{i}", seed=i) for i in range(4)]))
        assert [r.weight_version for r in done] == [1] * 4  # engine 0's two retried on engine 1
        metrics = router.metrics()
        assert metrics["router/num_alive_engines"] == 1
        assert metrics["router/retries"] == 2 and metrics["router/restarts"] == 0

        engines[1].fail_next_step()
        futures = router.submit([request(f"q{i}", seed=i) for i in range(2)])
        for future in futures:  # settled, not left waiting for an engine that never comes back
            with pytest.raises(EngineFailedError, match="no engine is alive and restart_engines is off"):
                future.result(timeout=TIMEOUT_S)
        with pytest.raises(EngineFailedError, match="no engine is alive"):
            router.generate(request("late")).result(timeout=TIMEOUT_S)
        assert router.num_in_flight == 0
    finally:
        router.close()


def test_a_request_fails_after_max_retries_engines_failed_under_it(make_pool):
    engines = make_pool("local")
    router = Router(engines, max_retries=0)
    try:
        engines[0].fail_next_step()
        futures = router.submit([request(f"m{i}", seed=i) for i in range(4)])
        for index, future in enumerate(futures):
            if index % 2:  # engine 1's
                assert future.result(timeout=TIMEOUT_S).finish_reason == "length"
            else:
                with pytest.raises(EngineFailedError, match=r"failed on 1 engine\(s\); the last, engine 0"):
                    future.result(timeout=TIMEOUT_S)
        wait_until(lambda: router.metrics()["router/num_alive_engines"] == 2, "engine 0 back in the pool")
        assert router.metrics()["router/retries"] == 0 and router.metrics()["router/restarts"] == 1
    finally:
        router.close()


# --- Ray -----------------------------------------------------------------------------------------------


@pytest.mark.ray
def test_a_killed_engine_is_restarted_and_every_request_completes_once(make_pool):
    engines = make_pool("ray", health_check_interval_s=0.5, heartbeat_timeout_s=20.0)
    restarted = []

    def on_restart(index: int) -> None:  # where the engine pool gives a restarted engine the current weights
        restarted.append(index)
        engines[index].import_weights([], version=7)

    router = Router(engines, on_restart=on_restart)
    try:
        pid = engines[0].pid()
        requests = [request(f"k{i}", seed=i, max_new_tokens=96) for i in range(8)]
        futures = router.submit(requests)
        wait_until(lambda: engines[0].health().num_running > 0, "engine 0 to run its requests")
        os.kill(pid, signal.SIGKILL)
        done = results(futures)
        assert [r.request_id for r in done] == [r.request_id for r in requests]
        assert all(r.finish_reason == "length" and len(r.response_ids) == 96 for r in done)
        wait_until(lambda: router.metrics()["router/num_alive_engines"] == 2, "engine 0 back in the pool")
        metrics = router.metrics()
        assert metrics["router/retries"] > 0 and metrics["router/restarts"] == 1 and restarted == [0]
        assert metrics["router/engine_0/served"] + metrics["router/engine_1/served"] == len(requests)
        assert metrics["router/num_in_flight"] == 0
        assert engines[0].pid() != pid
        again = results(router.submit([request(f"n{i}") for i in range(4)]))
        assert sorted(r.weight_version for r in again) == [1, 1, 7, 7]  # engine 0, restarted, with on_restart's weights
    finally:
        router.close()
