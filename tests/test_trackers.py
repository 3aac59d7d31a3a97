"""The Tracker's sinks: metrics.jsonl and samples.jsonl always (kept up to the resumed step on a resume, removed by
overwrite=true), and the optional tensorboard, wandb and mlflow sinks read back from what their packages wrote."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from baton.cli import main
from baton.pipelines.run_dir import previous_run, remove_previous_run
from baton.tracking import Tracker, run_metrics, run_samples

MOCK_GRPO = ["pipeline_cls=baton.pipelines.rlvr:RLVRPipeline", "actor.strategy.name=mock", "rollout.strategy.name=mock",
             "data.max_operand=9", "data.num_val_examples=8", "sampling.max_new_tokens=3",
             "sampling.num_samples_per_prompt=2", "trainer.backend=local", "trainer.num_prompts_per_step=4",
             "trainer.progress_bar=false", "trainer.num_steps=2"]

ROWS = [{"step": 0, "split": "val", "prompt": "2+3=", "response": "5", "ground_truth": "5", "reward": 1.0,
         "source": "val.jsonl"},
        {"step": 0, "split": "val", "prompt": "4+4=", "response": "9 | 1\nx", "ground_truth": "8", "reward": 0.0},
        {"step": 0, "split": "train", "prompt": "1+1=", "response": "2", "ground_truth": None, "reward": None}]


def test_log_samples_writes_one_json_line_per_row_with_the_step(tmp_path):
    tracker = Tracker(str(tmp_path))
    tracker.log_samples(ROWS, step=3)
    tracker.log_samples([{**ROWS[0], "reward": float("nan")}], step=4)
    tracker.close()
    rows = run_samples(str(tmp_path))
    assert [r["step"] for r in rows] == [3, 3, 3, 4]
    assert rows[0] == {**ROWS[0], "step": 3}  # the extra key is kept
    assert rows[2]["ground_truth"] is None and rows[2]["split"] == "train"
    assert rows[3]["reward"] is None  # NaN is not JSON


def test_a_resumed_run_keeps_the_samples_up_to_its_checkpoint_and_appends(tmp_path):
    tracker = Tracker(str(tmp_path))
    for step in (2, 4, 6):
        tracker.log_samples(ROWS[:1], step=step)
    tracker.close()  # interrupted after step 6; the last checkpoint is step 4
    tracker = Tracker(str(tmp_path), resumed_from_step=4)
    tracker.log_samples(ROWS[:1], step=6)
    tracker.close()
    assert [r["step"] for r in run_samples(str(tmp_path))] == [2, 4, 6]


def test_samples_jsonl_is_a_previous_runs_record_and_overwrite_removes_it(tmp_path):
    tracker = Tracker(str(tmp_path))
    tracker.log_samples(ROWS, step=1)
    tracker.close()
    os.remove(tmp_path / "metrics.jsonl")  # only the samples show that a run wrote here
    assert previous_run(str(tmp_path)) == ["samples.jsonl"]
    remove_previous_run(str(tmp_path))
    assert not (tmp_path / "samples.jsonl").exists() and previous_run(str(tmp_path)) == []


def log_a_run(run_dir, sinks, **kwargs) -> None:
    """Two steps of metrics and one validation's samples, through `sinks`."""
    tracker = Tracker(str(run_dir), sinks, config={"actor": {"optimizer": {"lr": 1e-3}}, "trainer": {"num_steps": 2}},
                      **kwargs)
    tracker.log({"loss": 0.5, "val/accuracy": 0.25, "flag": True}, step=1)
    tracker.log_samples(ROWS, step=1)
    tracker.log({"loss": 0.25, "grad_norm": float("inf")}, step=2)
    tracker.close()


def test_the_tensorboard_sink_writes_scalars_and_a_samples_table_per_split(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_a_run(tmp_path, ["jsonl", "tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(1, 0.25)]
    [val] = [e for e in events.Tensors("samples/val/text_summary")]
    table = val.tensor_proto.string_val[0].decode()
    assert val.step == 1 and table.splitlines()[0] == "| step | split | prompt | response | ground_truth | reward | source |"
    assert "| 1 | val | 4+4= | 9 \\| 1<br>x | 8 | 0.0 |  |" in table  # a pipe and a newline do not break the table
    assert "1+1=" in events.Tensors("samples/train/text_summary")[0].tensor_proto.string_val[0].decode()


def test_a_resumed_runs_tensorboard_shows_each_step_once(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(str(tmp_path), ["tensorboard"])
    for step in (1, 2, 3):
        tracker.log({"loss": float(step)}, step=step)
    tracker.close()  # interrupted after step 3; the last checkpoint is step 2
    tracker = Tracker(str(tmp_path), ["tensorboard"], resumed_from_step=2)
    tracker.log({"loss": 30.0}, step=3)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def wandb_history(run_dir, wait_s: float = 60.0) -> list[dict]:
    """The history rows an offline wandb run wrote to its transaction log (leveldb log format: 32 KiB blocks of
    chunks, each with a 7-byte header: crc32, length, type), as {key: value}. wandb's service may still be writing
    the log after `finish()` returns on a loaded machine: read again, up to `wait_s`, until its exit record is in."""
    import glob

    [path] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(path)
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [{"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


def wandb_records(path: str) -> list:
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a chunk header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if position + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records


def test_the_wandb_sink_offline_logs_metrics_by_step_and_samples_as_a_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_a_run(tmp_path, ["jsonl", "wandb"])
    history = wandb_history(tmp_path)
    assert [(row["_step"], row["loss"]) for row in history] == [(1, 0.5), (2, 0.25)]
    assert history[0]["val/accuracy"] == 0.25 and "flag" not in history[0]
    assert history[0]["samples/val/_type"] == "table-file" and history[0]["samples/val/nrows"] == 2
    [files] = (tmp_path / "wandb").glob("offline-run-*/files")
    table = json.loads((files / history[0]["samples/val/path"]).read_text())
    assert table["columns"] == ["step", "split", "prompt", "response", "ground_truth", "reward", "source"]
    assert table["data"][1] == [1, "val", "4+4=", "9 | 1\nx", "8", 0.0, None]
    assert history[0]["samples/train/nrows"] == 1


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_a_run(tmp_path, ["wandb"])
    tracker = Tracker(str(tmp_path), ["wandb"], resumed_from_step=1)
    tracker.log({"loss": 0.125}, step=3)
    tracker.close()
    runs = [path.name for path in (tmp_path / "wandb").glob("offline-run-*")]  # offline-run-<time>-<id>[-1]
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([0-9a-z]+)", name).group(1) for name in runs}
    assert len(runs) == 2 and len(ids) == 1


def test_the_mlflow_sink_logs_metrics_params_and_samples_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import json

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for tests like this one
    log_a_run(tmp_path / "run", ["jsonl", "mlflow"], experiment="first")
    client = MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("baton").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 0.5), (2, 0.25)]
    assert "grad_norm" not in run.data.metrics and "flag" not in run.data.metrics  # inf, and a bool
    assert run.data.params == {"actor.optimizer.lr": "0.001", "trainer.num_steps": "2"}
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    rows = json.loads(open(client.download_artifacts(run.info.run_id, "samples/val/step_1.json", str(tmp_path))).read())
    assert [r["prompt"] for r in rows] == ["2+3=", "4+4="]

    tracker = Tracker(str(tmp_path / "run"), ["mlflow"], resumed_from_step=1)
    tracker.log({"loss": 0.125}, step=2)
    tracker.close()
    [resumed] = client.search_runs([run.info.experiment_id])
    assert resumed.info.run_id == run.info.run_id
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.5, 0.25, 0.125]


def test_an_unknown_tracker_is_refused_by_baton_config_with_the_nearest_name(tmp_path, capsys):
    assert main(["config", *MOCK_GRPO, f"trainer.run_dir={tmp_path}", "trainer.tracker=[jsonl,wandbb]"]) == 2
    assert capsys.readouterr().err == ("baton: error: 'trainer': trainer.tracker 'wandbb' is not a tracker; did you "
                                       "mean 'wandb'? trackers: jsonl, tensorboard, wandb, mlflow\n")


@pytest.mark.parametrize("sink, package", [("wandb", "wandb"), ("tensorboard", "tensorboard"),
                                           ("mlflow", "mlflow-skinny")])
def test_a_tracker_whose_package_is_missing_is_refused_in_one_line_before_the_run_starts(tmp_path, capsys, monkeypatch,
                                                                                        sink, package):
    monkeypatch.setitem(sys.modules, sink, None)  # as if not installed: find_spec finds nothing, import fails
    expected = (f"baton: error: trainer.tracker has {sink!r}, but the {sink} tracker needs the {package} package, "
                f"which is not installed: pip install {package} (or pip install -e '.[trackers]' for every tracker)\n")
    assert main(["config", *MOCK_GRPO, f"trainer.run_dir={tmp_path}", f"trainer.tracker=[jsonl,{sink}]"]) == 2
    assert capsys.readouterr().err == expected
    assert main(["run", *MOCK_GRPO, f"trainer.run_dir={tmp_path}", f"trainer.tracker=[jsonl,{sink}]"]) == 2
    assert capsys.readouterr().err == expected
    assert not os.listdir(tmp_path)  # refused before the run wrote its config.yaml or started anything


def test_the_mlflow_tracker_without_a_store_it_can_open_is_refused_before_the_run_starts(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny: no SQLAlchemy for the default sqlite store
    assert main(["config", *MOCK_GRPO, f"trainer.run_dir={tmp_path}", "trainer.tracker=[mlflow]"]) == 2
    assert capsys.readouterr().err.startswith("baton: error: trainer.tracker has 'mlflow', whose tracking store is "
                                              "sqlite:///mlflow.db (MLflow's default, MLFLOW_TRACKING_URI being unset)")


def test_a_run_with_trackers_on_the_command_line_logs_to_each(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["run", *MOCK_GRPO, f"trainer.run_dir={tmp_path}", "trainer.tracker=[jsonl,tensorboard]"]) == 0
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    logged = run_metrics(str(tmp_path))
    assert [e.step for e in events.Scalars("val/accuracy")] == [0, 2]
    assert [e.value for e in events.Scalars("response_length/mean")] == pytest.approx(
        [logged[1]["response_length/mean"], logged[2]["response_length/mean"]])
