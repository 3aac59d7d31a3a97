"""A trace per sample: where each sample went (request → engine → reward → buffer → train step, with the weight
version of its tokens) and what the trainer did meanwhile, as Chrome trace events, which Perfetto
(ui.perfetto.dev) and chrome://tracing open.

`trainer.trace: true` turns it on (`trainer.trace_every_groups: N` traces one prompt group in N; the trainer's
phases are traced always). The run directory then holds `trace.events.jsonl`, one event per line, appended every
step (so a run that dies keeps its trace up to then), and, once the run ends, `trace.json`, the same as one trace
file (`baton trace RUN` writes it for a run that was killed). Each track is one part of the run as the driver sees
it: "driver" (each group's generation and reward), "engine <i>" (each request, from its hand-over to the engine to
its result), "reward", "buffer" (a group from generated to trained) and "trainer" (each step's phases, the weight
sync among them). Every span of a sample carries its id, "g<group>-s<sample>" (group spans: the group and its
samples' ids), and the weight versions of its tokens; `baton trace RUN --sample ID` prints one sample's path.

The spans are timed where the driver sees them: an engine's span is its request's time in flight as the router saw
it, the trainer's are its phases as the pipeline waited for them (a worker's own time inside is not traced).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import threading
import time
from typing import Iterator

TRACE_FILE = "trace.json"
EVENTS_FILE = "trace.events.jsonl"
_REQUEST_ID = re.compile(r"^(eval-)?g(\d+)-s(\d+)-")
_KEPT_BATCHES = 16  # batches made ahead and not yet trained that the tracer remembers (more than any lookahead)

_current: "Tracer | None" = None


def tracer() -> "Tracer | None":
    """The running pipeline's tracer, None when tracing is off."""
    return _current


def sample_id(group_index: int, sample_index: int) -> str:
    return f"g{group_index}-s{sample_index}"


def request_sample(request_id: str) -> tuple[str | None, int | None, bool]:
    """(sample id, group index, evaluation) of a rollout request id ("g12-s3-7", "eval-g4-s0-2"); Nones where it
    is another's."""
    match = _REQUEST_ID.match(request_id)
    if match is None:
        return None, None, False
    group, sample = int(match.group(2)), int(match.group(3))
    return sample_id(group, sample), group, match.group(1) is not None


_nesting = threading.local()  # how deep this thread is in `_costed` methods (a method calling another counts once)


def _costed(method):
    """Count the CPU time a `Tracer` method takes in its caller's thread into `cost_s` (what tracing adds to the run;
    CPU, not wall time, which would also count the other threads that hold the interpreter meanwhile)."""

    @functools.wraps(method)
    def timed_method(self, *args, **kwargs):
        depth = getattr(_nesting, "depth", 0)
        _nesting.depth, start = depth + 1, time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            _nesting.depth = depth
            if depth == 0:
                self.cost_s += time.thread_time() - start

    return timed_method


class Tracer:
    """Collects a run's spans (thread-safe) and writes them under `run_dir` (see the module docstring).

    every_groups: trace one prompt group in this many (by its index, so the same groups every run); the
    trainer's spans are always kept."""

    def __init__(self, run_dir: str, every_groups: int = 1):
        if every_groups < 1:
            raise ValueError(f"trainer.trace_every_groups must be >= 1 (1: every group), got {every_groups}")
        self.run_dir, self.every_groups = run_dir, every_groups
        self.events_path = os.path.join(run_dir, EVENTS_FILE)
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self._tracks: dict[str, int] = {}
        self._ready: dict[int, float] = {}  # group index -> when it was generated and rewarded
        self._batches: dict[int, list[tuple[int, int, list[int]]]] = {}  # trained version -> (group, sample, versions)
        self.cost_s = 0.0  # seconds spent in this tracer's methods, written to trace.json ("otherData")
        for event in read_events(self.events_path):  # a resumed run goes on with the tracks it had
            if event.get("ph") == "M" and event.get("name") == "process_name":
                self._tracks[event["args"]["name"]] = event["pid"]

    # --- what the run reports ------------------------------------------------------------------------

    def traced(self, group_index: int | None) -> bool:
        return group_index is not None and group_index % self.every_groups == 0

    @_costed
    def span(self, track: str, name: str, start: float, end: float, **args) -> None:
        """A span on `track` from `start` to `end` (time.time() seconds)."""
        self._add({"ph": "X", "name": name, "pid": self._track(track), "tid": 0, "ts": round(start * 1e6),
                   "dur": max(round((end - start) * 1e6), 0), "args": args})

    @contextlib.contextmanager
    def timed(self, track: str, name: str, **args) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.span(track, name, start, time.time(), **args)

    @_costed
    def group_ready(self, group_index: int) -> None:
        """Group `group_index` is generated and rewarded: its wait in the buffer starts."""
        if self.traced(group_index):
            with self._lock:
                self._ready[group_index] = time.time()

    @_costed
    def batch_made(self, samples, trained_version: int, staleness) -> None:
        """`samples` (rollout `Sample`s) make the batch that trains weight version `trained_version`; `staleness`: each
        sample's, as the staleness ledger measures it."""
        kept = [(s.group_index, s.sample_index, list(s.weight_versions), int(stale))
                for s, stale in zip(samples, staleness) if self.traced(s.group_index)]
        with self._lock:
            self._batches[trained_version] = kept
            for old in [v for v in self._batches if v < trained_version - _KEPT_BATCHES]:  # never trained (rollout-only)
                del self._batches[old]

    @_costed
    def train_started(self, step: int, trained_version: int) -> None:
        """Step `step` starts training version `trained_version` on the batch `batch_made` reported: each of its
        groups' wait in the buffer ends, and each group gets a "train" mark with its samples, their tokens' weight
        versions (oldest, newest) and staleness (one list entry per sample)."""
        now = time.time()
        with self._lock:
            batch = self._batches.pop(trained_version, [])
        groups: dict[int, list[tuple[int, list[int], int]]] = {}
        for group, sample, versions, stale in batch:
            groups.setdefault(group, []).append((sample, [v for v in versions if v >= 0], stale))
        trainer = self._track("trainer")
        for group, samples in groups.items():
            with self._lock:
                at = self._ready.pop(group, None)
            ids = [sample_id(group, sample) for sample, _, _ in samples]
            if at is not None:
                self.span("buffer", "buffered", at, now, group=group, samples=ids, step=step)
            self._add({"ph": "i", "s": "t", "name": "train", "pid": trainer, "tid": 0, "ts": round(now * 1e6),
                       "args": {"group": group, "samples": ids, "step": step, "trained_version": trained_version,
                                "versions": [[min(made), max(made)] if made else [] for _, made, _ in samples],
                                "staleness": [stale for _, _, stale in samples]}})

    # --- files ---------------------------------------------------------------------------------------

    @_costed
    def flush(self) -> None:
        """Append the events so far to `trace.events.jsonl`."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            with open(self.events_path, "a") as f:
                f.write("".join(json.dumps(event) + "\n" for event in pending))

    def write_trace(self) -> str | None:
        """`trace.json` from `trace.events.jsonl` (after `flush`), with what tracing cost the run's steps
        (`otherData.tracer_s`: CPU seconds in the tracer's methods, this write left out); its path (None: nothing
        was traced, a run that failed before its first step)."""
        self.flush()
        return write_trace(self.run_dir, {"tracer_s": self.cost_s}) if os.path.isfile(self.events_path) else None

    def _track(self, name: str) -> int:
        with self._lock:
            pid = self._tracks.get(name)
            if pid is None:
                pid = self._tracks[name] = len(self._tracks) + 1
                self._pending.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                      "args": {"name": name}})
            return pid

    def _add(self, event: dict) -> None:
        with self._lock:
            self._pending.append(event)


def start(run_dir: str, every_groups: int = 1) -> Tracer:
    """Trace the running pipeline into `run_dir` (the one tracer of this process) until `stop`."""
    global _current
    _current = Tracer(run_dir, every_groups)
    return _current


def stop() -> None:
    """Write the trace and stop tracing."""
    global _current
    current, _current = _current, None
    if current is not None:
        current.write_trace()


def write_trace(run_dir: str, other: dict | None = None) -> str:
    """`run_dir`'s `trace.json` (Chrome's object format, what Perfetto opens) from its `trace.events.jsonl`, written
    atomically; `other`: the file's "otherData". A run that ended writes it itself; one that was killed leaves the
    events only (`baton trace RUN` writes it then)."""
    path = os.path.join(run_dir, TRACE_FILE)
    events = read_events(os.path.join(run_dir, EVENTS_FILE))
    if not events:
        raise ValueError(f"{run_dir} has no {EVENTS_FILE}: was it run with trainer.trace: true?")
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other or {}}, f)
    os.replace(partial, path)
    return path


def read_events(path: str) -> list[dict]:
    """A trace's events: `trace.events.jsonl` (one per line; a torn last line, from a run killed while writing it,
    is skipped) or `trace.json`."""
    if not os.path.isfile(path):
        return []
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)["traceEvents"]
    events = []
    with open(path) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def sample_events(run_dir: str, wanted: str) -> list[dict]:
    """Every span and mark of a run's trace that names sample `wanted` ("g12-s3"), or its group as a whole, in time
    order, each with its track's name under "track" (evaluation requests left out)."""
    match = re.fullmatch(r"g(\d+)-s(\d+)", wanted)
    if match is None:
        raise ValueError(f"sample id {wanted!r}: give it as g<group>-s<sample>, e.g. g12-s3 (the ids the trace's "
                         "spans carry)")
    group = int(match.group(1))
    events = read_events(os.path.join(run_dir, EVENTS_FILE)) or read_events(os.path.join(run_dir, TRACE_FILE))
    tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    mine = [{**e, "track": tracks.get(e["pid"], "?")} for e in events if e.get("ph") in ("X", "i")
            and not e["args"].get("eval") and (
                e["args"].get("sample") == wanted or wanted in e["args"].get("samples", ())
                or (e["args"].get("group") == group and "sample" not in e["args"] and "samples" not in e["args"]))]
    return sorted(mine, key=lambda e: e["ts"])


def sample_path(run_dir: str, wanted: str) -> list[str]:
    """`sample_events` as lines: time from the sample's first event, track, name, duration, arguments."""
    events = sample_events(run_dir, wanted)
    lines = []
    for event in events:
        args = {k: v for k, v in event["args"].items() if k != "samples"}
        took = f" {event['dur'] / 1e6:.3f} s" if event["ph"] == "X" else ""
        lines.append(f"+{(event['ts'] - events[0]['ts']) / 1e6:8.3f} s  {event['track']:>10}  {event['name']}{took}  "
                     f"{json.dumps(args, sort_keys=True)}")
    return lines


__all__ = ["EVENTS_FILE", "TRACE_FILE", "Tracer", "read_events", "request_sample", "sample_events", "sample_id",
           "sample_path", "start", "stop", "tracer", "write_trace"]
