"""The training loop's progress: a tqdm bar on a terminal; elsewhere (a log file, a pipe) one plain line per
interval, so that the log reads line by line instead of filling with carriage returns."""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable

from tqdm import tqdm

LINE_INTERVAL_S = 30.0


def progress(iterable: Iterable, desc: str, initial: int, total: int, enabled: bool = True, file=None):
    """A progress display over `iterable` (steps initial + 1 … total): tqdm's bar where `file` (default stderr) is a
    terminal, a `LineProgress` where it is not, tqdm disabled where not `enabled`. Both take `set_postfix`,
    `update`, `close` and count done steps in `n`."""
    file = file or sys.stderr
    if enabled and not _is_terminal(file):
        return LineProgress(iterable, desc, initial, total, file)
    return tqdm(iterable, desc=desc, unit="step", disable=not enabled, initial=initial, total=total, file=file)


class LineProgress:
    """The part of tqdm's interface the loop uses, written as lines: "desc: step 3/10 (30%), 12.0 s, 4.00 s/step,
    key=value" after the first step, then after the first step at least `interval_s` after the last line, and
    after the last step (or at `close`, where steps were done since the last line)."""

    def __init__(self, iterable: Iterable, desc: str, initial: int, total: int, file, interval_s: float = LINE_INTERVAL_S):
        self.iterable, self.desc, self.total, self.file, self.interval_s = iterable, desc, total, file, interval_s
        self.initial = self.n = initial
        self.postfix: dict = {}
        self.start_s = self.last_line_s = time.perf_counter()
        self.last_line_n: int | None = None

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def set_postfix(self, postfix: dict) -> None:
        self.postfix = dict(postfix)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.last_line_n is None or self.n >= self.total or now - self.last_line_s >= self.interval_s:
            self.write_line(now)

    def close(self) -> None:
        if self.n != self.last_line_n and self.n > self.initial:
            self.write_line(time.perf_counter())

    def write_line(self, now: float) -> None:
        elapsed_s, done = now - self.start_s, self.n - self.initial
        parts = [f"{self.desc}: step {self.n}/{self.total} ({self.n / max(self.total, 1):.0%})", f"{elapsed_s:.1f} s"]
        if done > 0:
            parts.append(f"{elapsed_s / done:.2f} s/step")
        parts += [f"{key}={value}" for key, value in self.postfix.items()]
        self.file.write(", ".join(parts) + "\n")
        self.file.flush()
        self.last_line_s, self.last_line_n = now, self.n


def quiet_library_bars(file=None) -> None:
    """Where `file` (default stderr) is no terminal, turn off transformers' and huggingface_hub's progress bars
    (loading and writing weights, at each checkpoint), whose carriage returns would fill a log file: in this process
    and, through the environment they inherit, in the worker processes it starts. An explicit
    HF_HUB_DISABLE_PROGRESS_BARS is kept."""
    if _is_terminal(file or sys.stderr):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _is_terminal(file) -> bool:
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty())


__all__ = ["LINE_INTERVAL_S", "LineProgress", "progress", "quiet_library_bars"]
