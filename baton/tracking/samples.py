"""What the model wrote, for a reader: the sample rows a run logs (`samples.jsonl`, `Tracker.log_samples`) and the
console's line and table after each validation."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Sequence

from tqdm import tqdm

from baton.data import DataProto

SAMPLE_KEYS = ("step", "split", "prompt", "response", "ground_truth", "reward")
TABLE_WIDTHS = {"prompt": 40, "response": 40, "ground truth": 16}  # each column cut to this many characters


@dataclass
class Validation:
    """What a validation gives: its metrics (`baton.rl.metrics.validation_set_metrics`'s set) and the rows of its
    first prompts (`sample_row`), one sample each."""

    metrics: dict[str, float]
    samples: list[dict] = field(default_factory=list)


def sample_row(step: int, split: str, prompt, response, ground_truth, reward) -> dict:
    """One row of samples.jsonl: {"step", "split" ("val" or "train"), "prompt", "response", "ground_truth" (None for
    none), "reward" (None for none)}, the same keys from every pipeline."""
    return {"step": int(step), "split": split, "prompt": str(prompt), "response": str(response),
            "ground_truth": None if ground_truth is None else str(ground_truth),
            "reward": None if reward is None else float(reward)}


def first_sample_rows(uids: Sequence, num_prompts: int) -> list[int]:
    """The row of each of the first `num_prompts` prompts' first sample, in row order (a prompt's samples share a
    uid)."""
    seen: set = set()
    rows = []
    for row, uid in enumerate(uids):
        if len(rows) == num_prompts:
            break
        if uid not in seen:
            seen.add(uid)
            rows.append(row)
    return rows


def model_text(tokenizer, ids: Sequence[int], mask: Sequence[int]) -> str:
    """The text the model wrote among a response's tokens `ids`: the tokens where `mask` is 1, decoded run by run
    (a multi-turn episode's turns, the environment's tokens between them left out), joined by newlines."""
    runs: list[list[int]] = []
    previous = 0
    for token, written in zip(ids, mask):
        if written and not previous:
            runs.append([])
        if written:
            runs[-1].append(int(token))
        previous = written
    texts = [tokenizer.decode(run, skip_special_tokens=True) for run in runs]
    return texts[0] if len(texts) == 1 else "\n".join(text.rstrip("\n") for text in texts)


def batch_rows(step: int, split: str, batch: DataProto, scores: Sequence[float], tokenizer,
               num_prompts: int) -> list[dict]:
    """Rows of a generated batch (the generate() layout: non-tensor `prompt`, `uid`, `ground_truth` where the data
    has answers; `responses` and `response_mask`): the first sample of each of its first `num_prompts` prompts,
    with its reward from `scores` [rows]."""
    columns = batch.non_tensor_batch
    truths = columns.get("ground_truth")
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]  # [rows, response_len] each
    rows = []
    for row in first_sample_rows(columns["uid"], num_prompts):
        response = model_text(tokenizer, responses[row].tolist(), mask[row].tolist())
        rows.append(sample_row(step, split, columns["prompt"][row], response,
                               None if truths is None else truths[row], scores[row]))
    return rows


# --- the console --------------------------------------------------------------------------------------

def validation_line(run: str, step: int, num_steps: int, metrics: dict[str, float]) -> str | None:
    """One line with the validation's figures that matter: accuracy, mean reward, the largest pass@k, response
    length, after the run's name (`run`: its directory's, e.g. a stage's "sft"); None when it logged none (no
    held-out data)."""
    if "val/accuracy" not in metrics:
        return None
    figures = [f"accuracy {metrics['val/accuracy']:.3f}"]
    if "val/reward/mean" in metrics:
        figures.append(f"mean reward {metrics['val/reward/mean']:.3f}")
    passes = sorted((int(key.removeprefix("val/pass@")), value) for key, value in metrics.items()
                    if key.startswith("val/pass@") and key.removeprefix("val/pass@").isdigit())
    if passes:
        figures.append(f"pass@{passes[-1][0]} {passes[-1][1]:.3f}")
    if "val/response_length/mean" in metrics:
        figures.append(f"response length {metrics['val/response_length/mean']:.1f} tokens")
    return f"baton: {run} step {step}/{num_steps} validation: " + ", ".join(figures)


def samples_table(rows: list[dict]) -> str:
    """`rows` as a plain-text table, prompt | response | ground truth | reward, each cell on one line (a newline
    shown as \\n) and cut to its column's width (`TABLE_WIDTHS`, "..." where cut)."""
    header = {"prompt": "prompt", "response": "response", "ground truth": "ground truth", "reward": "reward"}
    cells = [header] + [{"prompt": _cell(r["prompt"], TABLE_WIDTHS["prompt"]),
                         "response": _cell(r["response"], TABLE_WIDTHS["response"]),
                         "ground truth": _cell("-" if r["ground_truth"] is None else r["ground_truth"],
                                               TABLE_WIDTHS["ground truth"]),
                         "reward": "-" if r["reward"] is None else f"{r['reward']:.3f}"} for r in rows]
    widths = {name: max(len(c[name]) for c in cells) for name in header}
    lines = [" | ".join(c[name].ljust(widths[name]) for name in header).rstrip() for c in cells]
    lines.insert(1, "-+-".join("-" * widths[name] for name in header))
    return "\n".join(lines)


def print_validation(run: str, step: int, num_steps: int, metrics: dict[str, float], rows: list[dict],
                     file=None) -> None:
    """The validation's line and its samples' table on stderr, above the progress bar (`tqdm.write`)."""
    line = validation_line(run, step, num_steps, metrics)
    text = "\n".join(filter(None, [line, samples_table(rows) if rows else None]))
    if text:
        tqdm.write(text, file=file or sys.stderr)


def _cell(text: str, width: int) -> str:
    text = str(text).replace("\r", "").replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 3] + "..."


__all__ = ["SAMPLE_KEYS", "Validation", "batch_rows", "first_sample_rows", "model_text", "print_validation",
           "sample_row", "samples_table", "validation_line"]
