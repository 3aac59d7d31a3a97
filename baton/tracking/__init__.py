"""Metric sinks (jsonl always; tensorboard and wandb when configured) and run plots."""

from baton.tracking.plot import plot_run
from baton.tracking.tracker import Tracker

__all__ = ["Tracker", "plot_run"]
