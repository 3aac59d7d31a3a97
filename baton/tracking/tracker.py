"""`Tracker`: where a run's metrics go. `metrics.jsonl` in the run directory always; tensorboard
and wandb when asked for (their packages are optional and imported only then)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

SINKS = ("jsonl", "tensorboard", "wandb")


class Tracker:
    def __init__(self, run_dir: str, sinks: Sequence[str] = ("jsonl",), project: str = "baton",
                 experiment: str | None = None, config: dict[str, Any] | None = None, resume: bool = False):
        unknown = set(sinks) - set(SINKS)
        if unknown:
            raise ValueError(f"unknown tracker sinks {sorted(unknown)}; valid: {list(SINKS)}")
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._jsonl = open(self.path, "a" if resume else "w")
        self._tensorboard = self._wandb = None
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("the tensorboard sink needs the tensorboard package: pip install tensorboard") from None
            self._tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if "wandb" in sinks:
            try:
                import wandb
            except ImportError:
                raise ImportError("the wandb sink needs the wandb package: pip install wandb") from None
            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=run_dir,
                                     resume="allow" if resume else None)

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

    def close(self) -> None:
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str) -> list[dict[str, float]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
