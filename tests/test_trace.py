"""A trace per sample (`trainer.trace`, `baton.tracking.trace`): a rollout-system run writes trace.json in Chrome's
trace event format (what Perfetto opens), with a track per part of the run, and one trained sample's path is
complete from its request to the step that trained it; `baton trace` prints it."""

from __future__ import annotations

import json
import os

import pytest

from baton.cli import main
from baton.pipelines.base import run_pipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRPipeline
from baton.tracking.trace import EVENTS_FILE, TRACE_FILE, Tracer, read_events, sample_events, sample_path
from test_rollout_pipeline import tiny


def check_schema(trace: dict) -> None:
    """Chrome's JSON object format as Perfetto's importer reads it: complete ("X"), instant ("i") and metadata ("M")
    events with integer pid, tid and microsecond times."""
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"} and trace["displayTimeUnit"] == "ms"
    for event in trace["traceEvents"]:
        assert event["ph"] in ("X", "i", "M") and isinstance(event["name"], str), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int) and isinstance(event["args"], dict)
        if event["ph"] == "M":
            assert event["name"] == "process_name" and isinstance(event["args"]["name"], str)
            continue
        assert isinstance(event["ts"], int) and event["ts"] > 0
        if event["ph"] == "X":
            assert isinstance(event["dur"], int) and event["dur"] >= 0
        else:
            assert event["s"] in ("t", "p", "g")
        json.dumps(event["args"])


def test_a_traced_async_run_follows_each_sample_from_its_request_to_its_train_step(tmp_path, capsys):
    config = tiny(tmp_path, num_steps=3, mode="async", max_staleness=2, deterministic=True)
    config.trainer.trace = True
    run_pipeline(RolloutRLVRPipeline, config)
    with open(tmp_path / TRACE_FILE) as f:
        trace = json.load(f)
    check_schema(trace)
    assert trace["otherData"]["tracer_s"] > 0  # what tracing cost the run's steps, for bench/trace.py
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert tracks == {"driver", "engine 0", "engine 1", "reward", "buffer", "trainer"}
    assert trace["traceEvents"] == read_events(str(tmp_path / EVENTS_FILE))  # the file a killed run leaves says the same

    trained = [e for e in trace["traceEvents"] if e["name"] == "train"]
    assert {e["args"]["step"] for e in trained} == {1, 2, 3}
    last = next(e for e in trained if e["args"]["step"] == 3)  # step 3 trains version 2 on tokens of version 0
    assert last["args"]["versions"] == [[0, 0], [0, 0]] and last["args"]["staleness"] == [2, 2]  # a group's 2 samples
    sample = last["args"]["samples"][1]
    path = sample_events(str(tmp_path), sample)
    names = [event["name"] for event in path]
    assert names == ["group", "request", "reward", "buffered", "train"]  # the group's span holds its requests
    assert path[1]["track"].startswith("engine ") and path[1]["args"]["versions"] == [0, 0]
    lines = sample_path(str(tmp_path), sample)
    assert len(lines) == len(path) and lines[-1].split()[3:5] == ["trainer", "train"]
    phases = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == trained[0]["pid"]}
    assert {"gen", "update_actor", "sync"} <= phases  # the trainer's track: each step's phases, the sync among them

    assert main(["trace", str(tmp_path), "--sample", sample]) == 0
    assert capsys.readouterr().out.splitlines() == lines
    assert main(["trace", str(tmp_path), "--sample", "g9999-s0"]) == 1
    with pytest.raises(SystemExit):
        main(["trace", str(tmp_path), "--sample", "sample 3"])


def test_one_group_in_n_is_traced_and_a_torn_last_line_is_skipped(tmp_path):
    tracer = Tracer(str(tmp_path), every_groups=4)
    assert [group for group in range(10) if tracer.traced(group)] == [0, 4, 8] and not tracer.traced(None)
    tracer.span("driver", "group", 1.0, 2.5, group=4)
    tracer.flush()
    with open(tmp_path / EVENTS_FILE, "a") as f:
        f.write('{"ph": "X", "na')  # a run killed while writing
    events = read_events(str(tmp_path / EVENTS_FILE))
    assert [e["name"] for e in events] == ["process_name", "group"] and events[1]["dur"] == 1_500_000
    assert os.path.getsize(tmp_path / EVENTS_FILE) > 0 and not os.path.exists(tmp_path / TRACE_FILE)
    assert main(["trace", str(tmp_path)]) == 0  # a killed run's trace.json, from its events
    with open(tmp_path / TRACE_FILE) as f:
        check_schema(json.load(f))
    with pytest.raises(ValueError, match="trainer.trace_every_groups must be >= 1"):
        Tracer(str(tmp_path), every_groups=0)
