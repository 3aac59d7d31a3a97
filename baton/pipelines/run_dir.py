"""A run directory: where its checkpoints lie, what shows that a run wrote it, and the refusal to write over one."""

from __future__ import annotations

import os
import shutil
import sys

from baton.config import ConfigError
from baton.pipelines.config import TrainerConfig
from baton.tracking.trace import EVENTS_FILE, TRACE_FILE

CHECKPOINT_PREFIX = "step_"
# with the checkpoints: what shows that a run wrote a directory
RUN_RECORDS = ("metrics.jsonl", "samples.jsonl", "summary.json")
# with the checkpoints: what `trainer.overwrite` removes
RUN_OUTPUTS = (*RUN_RECORDS, "metrics.png", EVENTS_FILE, TRACE_FILE)
# and the tensorboard sink's event files, which tensorboard would otherwise show beside the new run's (wandb's
# directory stays: each wandb run has its own there, and an offline one may not be synced yet)
RUN_OUTPUT_DIRS = ("tensorboard",)


def checkpoint_path(run_dir: str, step: int) -> str:
    """Where a run directory keeps the checkpoint of `step`."""
    return os.path.join(run_dir, "checkpoints", f"{CHECKPOINT_PREFIX}{step}")


def list_checkpoints(run_dir: str) -> list[str]:
    """The run directory's complete checkpoints, oldest first."""
    root = os.path.dirname(checkpoint_path(run_dir, 0))
    if not os.path.isdir(root):
        return []
    steps = sorted(int(d[len(CHECKPOINT_PREFIX):]) for d in os.listdir(root)
                   if d.startswith(CHECKPOINT_PREFIX) and d[len(CHECKPOINT_PREFIX):].isdigit())
    return [checkpoint_path(run_dir, s) for s in steps]


def previous_run(run_dir: str) -> list[str]:
    """What `run_dir` holds that a new run would write over: a metrics.jsonl or samples.jsonl with records,
    summary.json, checkpoints."""
    held = [name for name in RUN_RECORDS if os.path.isfile(os.path.join(run_dir, name))
            and os.path.getsize(os.path.join(run_dir, name)) > 0]
    steps = [os.path.basename(path) for path in list_checkpoints(run_dir)]
    if steps:
        shown = ", ".join(steps) if len(steps) <= 3 else f"{steps[0]} to {steps[-1]} ({len(steps)})"
        held.append(f"checkpoints/{shown}")
    return held


def run_dir_in_use(where: str, held: str, prefix: str) -> ConfigError:
    """The refusal of a new run into a directory that holds a previous one; `prefix`: the settings' ("trainer.")."""
    return ConfigError(f"{where} holds a previous run ({held}), which a new run would overwrite. Continue it with "
                       f"{prefix}resume=latest, keep it by choosing another {prefix}run_dir=..., or replace it with "
                       f"{prefix}overwrite=true")


def check_run_dir(trainer: TrainerConfig) -> None:
    """Refuse a new run (`trainer.resume` null, `trainer.overwrite` false) into a run directory that holds one."""
    held = previous_run(trainer.run_dir)
    if held and trainer.resume is None and not trainer.overwrite:
        raise run_dir_in_use(f"trainer.run_dir {trainer.run_dir!r}", ", ".join(held), "trainer.")


def remove_previous_run(run_dir: str) -> None:
    """Remove the outputs of the run that wrote `run_dir` before (`RUN_OUTPUTS`, `RUN_OUTPUT_DIRS` and its
    checkpoints, partial ones too), so that no later `resume=latest` picks up one of its checkpoints; says so on
    stderr. Nothing else in `run_dir` is touched."""
    removed = [name for name in RUN_OUTPUTS if os.path.isfile(os.path.join(run_dir, name))]
    for name in removed:
        os.remove(os.path.join(run_dir, name))
    for name in RUN_OUTPUT_DIRS:
        if os.path.isdir(os.path.join(run_dir, name)) and not os.path.islink(os.path.join(run_dir, name)):
            shutil.rmtree(os.path.join(run_dir, name))
            removed.append(f"{name}/")
    root = os.path.dirname(checkpoint_path(run_dir, 0))
    steps = sorted(d for d in os.listdir(root) if d.startswith(CHECKPOINT_PREFIX)
                   and d[len(CHECKPOINT_PREFIX):].removesuffix(".partial").isdigit()) if os.path.isdir(root) else []
    for step in steps:
        shutil.rmtree(os.path.join(root, step))
    if steps:
        removed.append(f"checkpoints ({', '.join(steps)})")
        if not os.listdir(root):
            os.rmdir(root)
    if removed:
        print(f"baton: overwrite=true: removed the previous run's {', '.join(removed)} from {run_dir}", file=sys.stderr)
