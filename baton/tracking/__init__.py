"""Metric and sample sinks (jsonl always; tensorboard and wandb when configured) and run plots."""

from baton.tracking.plot import plot_run
from baton.tracking.tracker import Tracker, read_metrics, run_metrics, run_samples

__all__ = ["Tracker", "plot_run", "read_metrics", "run_metrics", "run_samples"]
