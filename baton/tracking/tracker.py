"""`Tracker`: where a run's metrics and samples go. `metrics.jsonl` and `samples.jsonl` in the run directory
always; tensorboard, wandb and mlflow when asked for (their packages are optional and imported only then)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
from typing import Any, Sequence

# Each sink with the module it imports and the pip package that brings it (None: nothing to install).
SINK_PACKAGES: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
SINKS = tuple(SINK_PACKAGES)


def missing_package(sink: str) -> str | None:
    """The one-line refusal of a sink whose package is not installed (found without importing it); None: ready."""
    package = SINK_PACKAGES.get(sink)
    if package is None or importlib.util.find_spec(package[0]) is not None:
        return None
    return (f"the {sink} tracker needs the {package[1]} package, which is not installed: pip install {package[1]} "
            f"(or pip install -e '.[trackers]' for every tracker)")


class Tracker:
    """`resumed_from_step`: a run resumed from that step's checkpoint keeps the records of steps up to it (in
    metrics.jsonl and samples.jsonl) and appends; the steps it runs again (between that checkpoint and the
    interruption) are logged once.

    `sinks` beside jsonl (always on): "tensorboard" (event files in run_dir/tensorboard), "wandb" (`wandb.init` with
    `project`, `experiment`, `config`; WANDB_MODE=offline writes under run_dir/wandb only; a resume continues the
    wandb run), "mlflow" (a run of
    experiment `project` in MLflow's tracking store, MLFLOW_TRACKING_URI; `config` flattened into its params)."""

    def __init__(self, run_dir: str, sinks: Sequence[str] = ("jsonl",), project: str = "baton",
                 experiment: str | None = None, config: dict[str, Any] | None = None,
                 resumed_from_step: int | None = None):
        unknown = set(sinks) - set(SINKS)
        if unknown:
            raise ValueError(f"unknown tracker sinks {sorted(unknown)}; valid: {list(SINKS)}")
        for sink in sinks:
            if problem := missing_package(sink):
                raise ImportError(problem)
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.samples_path = os.path.join(run_dir, "samples.jsonl")
        resume = resumed_from_step is not None
        if resume:
            keep_records_until(self.path, resumed_from_step)
            keep_records_until(self.samples_path, resumed_from_step)
        self._jsonl = open(self.path, "a" if resume else "w")
        self._samples = None  # opened at the first samples, so that a run that logs none leaves no empty file
        self._samples_mode = "a" if resume else "w"
        self._tensorboard = self._wandb = self._mlflow = None
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter
            # On a resume, tensorboard hides the earlier events of the steps this run logs again.
            self._tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                              purge_step=resumed_from_step + 1 if resume else None)
        if "wandb" in sinks:
            import wandb
            previous = wandb_run_id(run_dir) if resume else None  # a resumed run continues its wandb run
            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=run_dir, id=previous,
                                     resume="allow" if previous else None)
        if "mlflow" in sinks:
            self._mlflow = MlflowSink(run_dir, project, experiment, config or {}, resume)

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in clean.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in clean.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            self._mlflow.log(clean, step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        """Log what the model wrote at `step`: one JSON line per row in samples.jsonl, and per split a wandb Table
        (key "samples/<split>") and a tensorboard text of a markdown table (tag "samples/<split>") when those
        sinks are on. A row:

            {"step": int, "split": "val" | "train", "prompt": str, "response": str,
             "ground_truth": str | None, "reward": float | None, ...}

        Extra keys are kept; a row's "step" is set to `step`; a non-finite reward is written as null."""
        records = [{"step": step, **{k: _finite(v) for k, v in row.items() if k != "step"}} for row in rows]
        if self._samples is None:
            self._samples = open(self.samples_path, self._samples_mode)
        self._samples.write("".join(json.dumps(r, default=str) + "\n" for r in records))
        self._samples.flush()
        by_split: dict[str, list[dict]] = {}
        for record in records:
            by_split.setdefault(str(record.get("split", "val")), []).append(record)
        for split, split_rows in by_split.items():
            columns = list(dict.fromkeys(k for r in split_rows for k in r))
            if self._tensorboard is not None:
                self._tensorboard.add_text(f"samples/{split}", markdown_table(columns, split_rows), step)
            if self._wandb is not None:
                import wandb
                table = wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in split_rows])
                self._wandb.log({f"samples/{split}": table}, step=step)
            if self._mlflow is not None:
                self._mlflow.log_rows(split_rows, f"samples/{split}/step_{step}.json")

    def close(self) -> None:
        self._jsonl.close()
        if self._samples is not None:
            self._samples.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()


class MlflowSink:
    """A run in MLflow's tracking store (MLFLOW_TRACKING_URI): metrics with their step, the config flattened into
    params (`actor.optimizer.lr`), samples as JSON artifacts. The run is tagged with the run directory; a resumed
    run continues the latest MLflow run of that directory."""

    TAG = "baton.run_dir"

    def __init__(self, run_dir: str, project: str, experiment: str | None, config: dict[str, Any], resume: bool):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        found = self.client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found else self.client.create_experiment(project)
        where = os.path.abspath(run_dir)
        previous = self.client.search_runs([experiment_id], filter_string=f"tags.`{self.TAG}` = '{where}'",
                                           order_by=["attributes.start_time DESC"], max_results=1) if resume else []
        if previous:
            self.run_id = previous[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=experiment, tags={self.TAG: where}).info.run_id
        logged = self.client.get_run(self.run_id).data.params
        params = [Param(k, v) for k, v in flatten(config).items() if k not in logged]  # a param is set once
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in metrics.items()
                                                    if math.isfinite(v)])

    def log_rows(self, rows: list[dict], artifact_file: str) -> None:
        self.client.log_text(self.run_id, json.dumps(rows, indent=1, default=str), artifact_file)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def wandb_run_id(run_dir: str) -> str | None:
    """The id of the wandb run last written under `run_dir` (its wandb/latest-run link: `[offline-]run-<time>-<id>`)."""
    link = os.path.join(run_dir, "wandb", "latest-run")
    found = re.search(r"run-\d{8}_\d{6}-([0-9a-z]+)", os.readlink(link)) if os.path.islink(link) else None
    return found.group(1) if found else None


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as {"dotted.key": text} (MLflow params are flat strings of at most 6000 characters)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[f"{prefix}{key}"] = text[:6000]
    return flat


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _cell(value: Any) -> Any:
    """A value as a table cell: numbers, text and None as they are, anything else as its JSON."""
    return value if value is None or isinstance(value, (str, int, float)) else json.dumps(value, default=str)


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    """`rows` as a markdown table (pipes escaped, newlines as <br>), the form tensorboard's text tab renders."""
    def cell(value: Any) -> str:
        return "" if value is None else str(_cell(value)).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def read_metrics(path: str) -> list[dict[str, float]]:
    """The records of a metrics.jsonl (or samples.jsonl); a last line cut short (the run was killed while writing it)
    is skipped."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}: not a JSON record: {line[:80]!r}") from None
    return records


# Metrics of the machine and its timing, not of the run: timings, throughputs, and the router's load counters (which
# engine served how many requests, counted since the process started). No two runs share them, nor a run and its resume.
WALL_CLOCK_PREFIXES = ("timing_s/", "perf/", "router/")


def run_metrics(run_dir: str, *, wall_clock: bool = False) -> dict[int, dict[str, float]]:
    """The metrics a run logged (its `metrics.jsonl`), by step: each step's records merged in the order they were
    written (validation and training records of one step in one dict). wall_clock: keep the timings, throughputs and
    router counters (`WALL_CLOCK_PREFIXES`), which no two runs share."""
    steps: dict[int, dict[str, float]] = {}
    for record in read_metrics(os.path.join(run_dir, "metrics.jsonl")):
        kept = record if wall_clock else {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK_PREFIXES)}
        steps.setdefault(int(record["step"]), {}).update(kept)
    return steps


def run_samples(run_dir: str) -> list[dict]:
    """The sample rows a run logged (its `samples.jsonl`, schema in `Tracker.log_samples`), in the order written."""
    path = os.path.join(run_dir, "samples.jsonl")
    return read_metrics(path) if os.path.isfile(path) else []


def keep_records_until(path: str, step: int) -> None:
    """Rewrite `path` (atomically) with only its records of steps <= `step`."""
    if not os.path.isfile(path):
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(partial, path)
