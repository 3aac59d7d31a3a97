"""What the `hf` and `vllm` engines share: requests waiting and in flight on the caller's event loop, one
scheduler task that runs each step in a one-thread executor (so the loop stays free while the model runs, and
every change to the model runs between two steps), and the `Engine` protocol's methods around it.

An engine supplies, as methods run in the executor: `_step(new, cancelled)` (hand over the new requests, drop the
cancelled ones, run one step; returns the finished requests' results), `_abort_running(request_ids)`,
`_load_weights(buckets, version)`, and what `sleep` releases (`_release` / `_retake`, when `_releases_memory`).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

import torch

from baton.engines.protocol import EngineHealth, FinishReason, GenerationRequest, GenerationResult


@dataclass(eq=False)
class Sequence:
    """A request and what it generated so far. `future` is the event loop's; the rest belongs to the executor."""

    request: GenerationRequest
    future: asyncio.Future
    stop_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None  # the hf engine's sampler; None: greedy
    response_ids: list[int] = field(init=False)  # the whole response so far, a resumed request's prefix first
    log_probs: list[float] = field(init=False)
    weight_versions: list[int] = field(init=False)

    def __post_init__(self):
        self.response_ids = list(self.request.prefix_response_ids)
        self.log_probs = list(self.request.prefix_log_probs)
        self.weight_versions = list(self.request.prefix_weight_versions)

    @property
    def input_ids(self) -> tuple[int, ...]:
        """What the model continues from: the prompt, then a resumed request's prefix (`DecodeBatch` reads it)."""
        return self.request.prompt_ids + self.request.prefix_response_ids

    @property
    def params(self):
        return self.request.params

    def result(self, finish_reason: FinishReason, engine_version: int) -> GenerationResult:
        version = self.weight_versions[-1] if self.weight_versions else engine_version
        return GenerationResult(self.request.request_id, tuple(self.response_ids), tuple(self.log_probs),
                                tuple(self.weight_versions), version, finish_reason)


class ServingLoop:
    """The request side of an engine (see the module docstring). `name` ("hf", "vllm") is used in messages;
    `max_num_running` caps the requests running at once (None: every waiting one joins the next step)."""

    name: str

    def __init__(self, executor: ThreadPoolExecutor, vocab_size: int, eos_token_id: int):
        self._executor, self.vocab_size, self.eos_token_id = executor, vocab_size, eos_token_id
        self._weight_version = 0
        self._waiting: list[Sequence] = []  # not yet handed to a step
        self._in_flight: dict[str, Sequence] = {}  # waiting or running
        self._cancelled: set[str] = set()  # generate() calls cancelled by their callers
        self._paused = self._sleeping = self._closed = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def _num_running(self) -> int:
        return len(self._in_flight) - len(self._waiting)

    # --- requests ---------------------------------------------------------------------------------

    def _check_request(self, request: GenerationRequest) -> None:
        """An engine's own refusals of a request (ValueError), beyond the shared ones."""

    def _new_sequence(self, request: GenerationRequest, stop_token_ids: frozenset[int],
                      future: asyncio.Future) -> Sequence:
        return Sequence(request, future, stop_token_ids)

    def start(self, request: GenerationRequest) -> asyncio.Future:
        """Queue `request` and return the future its result settles (call it on the engine's event loop): what
        `generate` awaits, for a caller that starts many requests at once without a task for each. Raises
        ValueError for a request the engine refuses. Stop a started request with `abort`."""
        loop = self._ensure_scheduler()
        if request.request_id in self._in_flight:
            raise ValueError(f"request {request.request_id!r} is already in flight; request ids must be unique")
        if any(not 0 <= t < self.vocab_size for t in (*request.prompt_ids, *request.prefix_response_ids)):
            raise ValueError(f"request {request.request_id!r} holds token ids outside the model's vocabulary "
                             f"[0, {self.vocab_size})")
        self._check_request(request)
        params = request.params
        stop = params.stop_token_ids if params.stop_token_ids is not None else (self.eos_token_id,)
        if request.prefix_response_ids and request.prefix_response_ids[-1] in stop:
            raise ValueError(f"request {request.request_id!r} resumes a response that ends with a stop token: it is "
                             "finished")
        sequence = self._new_sequence(request, frozenset(stop), loop.create_future())
        self._in_flight[request.request_id] = sequence
        self._waiting.append(sequence)
        self._wakeup.set()
        return sequence.future

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        future = self.start(request)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                self._cancelled.add(request.request_id)
                self._wakeup.set()
            raise

    async def abort(self, request_ids: Iterable[str]) -> list[GenerationResult]:
        request_ids = [i for i in dict.fromkeys(request_ids) if i in self._in_flight]
        aborted = {}
        for sequence in [s for s in self._waiting if s.request.request_id in request_ids]:
            self._waiting.remove(sequence)
            aborted[sequence.request.request_id] = sequence.result("abort", self._weight_version)
        running = [i for i in request_ids if i not in aborted]
        if running:
            aborted.update((r.request_id, r) for r in await self._run(self._abort_running, running))
        results = [aborted[i] for i in request_ids if i in aborted]
        for result in results:
            self._settle(result)
        return results

    # --- control ------------------------------------------------------------------------------------

    async def health(self) -> EngineHealth:
        num_running, num_waiting = (0, 0) if self._error is not None else await self._queue_counts()
        return EngineHealth(self._error is None, num_running, num_waiting, self._paused, self._sleeping,
                            self._weight_version, None if self._error is None else repr(self._error))

    async def _queue_counts(self) -> tuple[int, int]:
        """(running, waiting) requests for `health`: this loop's own bookkeeping, unless the backend queues too."""
        return self._num_running, len(self._waiting)

    async def pause(self) -> None:
        self._paused = True
        await self._run(lambda: None)  # the executor is FIFO: a step in flight has ended

    async def resume(self) -> None:
        self._paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    async def update_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        if version < self._weight_version:
            raise ValueError(f"weight version {version} is older than the engine's {self._weight_version}; versions "
                             "only go up")
        await self._run(self._load_weights, buckets, version)

    _releases_memory = False  # whether `sleep` releases memory here (`_release` / `_retake`), or only holds steps

    async def sleep(self) -> None:
        if self._in_flight:
            raise RuntimeError(f"{len(self._in_flight)} requests are in flight; abort them (or let them finish) "
                               "before sleep()")
        self._sleeping = True
        if self._releases_memory:
            await self._run(self._release)

    async def wake_up(self) -> None:
        if self._sleeping and self._releases_memory:
            await self._run(self._retake)
        self._sleeping = False
        if self._wakeup is not None:
            self._wakeup.set()

    async def close(self) -> None:
        """Abort what is in flight, stop the scheduler, run `_shutdown` and stop the executor thread. The engine
        serves nothing after; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        await self.abort(list(self._in_flight))
        if self._scheduler is not None and self._loop is asyncio.get_running_loop():
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler
        await self._run(self._shutdown)
        self._executor.shutdown()
        self._error = self._error or RuntimeError("the engine was closed")

    def _shutdown(self) -> None:
        """In the executor, last: release what the engine holds beyond the model."""

    # --- the scheduler (event loop) -----------------------------------------------------------------

    max_num_running: int | None = None

    def _ensure_scheduler(self) -> asyncio.AbstractEventLoop:
        if self._error is not None:
            raise RuntimeError(f"the {self.name} engine serves no more requests: {self._error!r}") from self._error
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._in_flight:
                raise RuntimeError("requests are in flight on another event loop; an engine serves one loop at a time")
            self._loop, self._wakeup = loop, asyncio.Event()
            self._scheduler = loop.create_task(self._schedule())
        return loop

    async def _run(self, fn, *args):
        """`fn(*args)` in the executor, after any step in flight."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run_between_steps(self, fn, *args):
        """`fn(*args)` in the engine's step thread, after any step in flight, for work the `Engine` protocol does not
        cover (scoring given tokens with the engine's weights): its steps and weight loads run in that thread one
        at a time, so nothing changes the model meanwhile, and requests in flight only wait for it."""
        return await self._run(fn, *args)

    async def _schedule(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while not (self._paused or self._sleeping) and (self._in_flight or self._cancelled):
                cancelled, self._cancelled = self._cancelled, set()
                for sequence in [s for s in self._waiting if s.request.request_id in cancelled]:
                    self._waiting.remove(sequence)
                    self._settle(sequence.result("abort", self._weight_version))
                room = self.max_num_running
                num_new = len(self._waiting) if room is None else max(0, room - self._num_running)
                new, self._waiting = self._waiting[:num_new], self._waiting[num_new:]
                try:
                    finished = await self._run(self._step, new, cancelled & set(self._in_flight))
                except Exception as error:  # a failed step: every waiting caller gets the error
                    self._fail(error)
                    return
                for result in finished:
                    self._settle(result)

    def _settle(self, result: GenerationResult) -> None:
        sequence = self._in_flight.pop(result.request_id)
        if not sequence.future.done():
            sequence.future.set_result(result)

    def _fail(self, error: Exception) -> None:
        self._error = error
        for sequence in self._in_flight.values():
            if not sequence.future.done():
                sequence.future.set_exception(RuntimeError(f"the {self.name} engine's step failed: {error!r}"))
        self._in_flight.clear()
        self._waiting.clear()
