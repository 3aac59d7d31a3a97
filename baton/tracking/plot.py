"""A PNG of a run: reward, validation accuracy (and pass@n), KL (or, with KL off, entropy), response length and,
with a rollout correction, the importance weights' effective sample share and the rollout/trainer mismatch KL,
against step. A run of several stages (SFT then GRPO) draws them one after another on the step axis, each stage's
steps after the last one of the stage before, with the boundaries marked."""

from __future__ import annotations

import fnmatch
import json
import os

from baton.tracking.tracker import read_metrics

# Each panel is a list of (title, metric keys) choices: the first one the run logged is drawn; a panel
# with none of them is left out (a run without KL shows entropy; an SFT-only run has neither). A key may be a
# glob pattern; the panel draws the logged key it matches with the largest number in it (pass@n, not pass@2).
PANELS = [
    [("reward (RL) / loss (SFT, DPO, distillation)", ["critic/score/mean", "sft/loss", "dpo/loss", "distill/loss"])],
    [("validation accuracy", ["val/accuracy", "val/pass@*"])],
    [("KL to reference", ["actor/kl", "actor/reward_kl_penalty"]), ("policy entropy (KL off)", ["actor/entropy"])],
    [("response length", ["response_length/mean"]), ("validation response length", ["val/response_length/mean"])],
    [("off-policy: IS effective sample share, mismatch KL", ["rollout_corr/ess", "rollout/mismatch_kl"])],
]


def choose_panels(sources: dict[str, list[dict]]) -> list[tuple[str, list[str]]]:
    """The (title, keys) to draw for these runs' records (label → records); at least the first panel."""
    logged = {key for records in sources.values() for record in records for key, v in record.items() if v is not None}
    chosen = []
    for choices in PANELS:
        for title, patterns in choices:
            keys = [key for key in (_largest_match(logged, p) for p in patterns) if key is not None]
            if keys:
                chosen.append((title, keys))
                break
    return chosen or [PANELS[0][0]]


def _largest_match(logged: set[str], pattern: str) -> str | None:
    """`pattern` if it was logged; for a glob ("val/pass@*"), the logged match with the largest number after "@"."""
    if pattern in logged:
        return pattern
    matches = [key for key in fnmatch.filter(logged, pattern) if key.rsplit("@", 1)[-1].isdigit()]
    return max(matches, key=lambda key: int(key.rsplit("@", 1)[1]), default=None)


def run_stages(run_dir: str) -> dict[str, list[dict]]:
    """The records of every `metrics.jsonl` under `run_dir` (label: its directory, "run" for the top), in the order
    the stages ran: the order the run's summary.json names them (a recipe's summary has a section per stage),
    else by when each file was last written."""
    found = {}
    for root, _, files in os.walk(run_dir):
        if "metrics.jsonl" in files:
            label = os.path.relpath(root, run_dir)
            found["run" if label == "." else label] = os.path.join(root, "metrics.jsonl")
    named = []
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        named = [label for label in summary if label in found] if isinstance(summary, dict) else []
    except (OSError, ValueError):
        pass
    rest = sorted((label for label in found if label not in named), key=lambda label: os.path.getmtime(found[label]))
    return {label: read_metrics(found[label]) for label in named + rest}


def stage_offsets(stages: dict[str, list[dict]]) -> dict[str, int]:
    """Where each stage starts on the shared step axis: after the last step of the stage before it."""
    offsets, start = {}, 0
    for label, records in stages.items():
        offsets[label] = start
        start += max((int(r["step"]) for r in records), default=0)
    return offsets


def plot_run(run_dir: str, out_path: str | None = None) -> str:
    """Plot `metrics.jsonl` of `run_dir` (every stage subdirectory that has one, each as its own line, stages one
    after another on the step axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = run_stages(run_dir)
    if not sources:
        raise FileNotFoundError(f"no metrics.jsonl under {run_dir}; is it a baton run directory?")
    offsets = stage_offsets(sources)
    panels = choose_panels(sources)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for label, records in sources.items():
            for key in keys:
                points = [(r["step"] + offsets[label], r[key]) for r in records if r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=f"{label}: {key}")
        for label, offset in list(offsets.items())[1:]:  # where a later stage begins
            ax.axvline(offset, color="gray", linestyle="--", linewidth=0.8)
            ax.annotate(label, (offset, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step (stages one after another)" if len(sources) > 1 else "step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"not logged in this run\n({', '.join(keys)})", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8, color="gray")
    fig.tight_layout()
    out_path = out_path or os.path.join(run_dir, "metrics.png")
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
