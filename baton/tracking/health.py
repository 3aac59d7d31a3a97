"""The health monitor: reads each step's logged metrics and says, once per kind, when training is going wrong, with
the likely cause and what to change. Each warning is written above the progress bar and logged as
`health/<kind>` = 1 at the step it was given (so a run's metrics show it).

The thresholds (docs/troubleshooting.md, "Health warnings") are set to stay quiet on a healthy run:

- accuracy_drop: the held-out accuracy (`val/accuracy`; else the mean validation reward `val/reward/mean`) of the
  last two validations both below the stage's start (its first validation) by more than max(0.1, 25% of the start).
- entropy_collapse: in a policy-gradient run (steps that log `actor/pg_loss`), `actor/entropy` below 10% of its
  first value for 3 steps in a row.
- kl_blowup: the KL to the reference (`actor/kl`, `actor/reward_kl_penalty`) above 1 nat per token; the policy's
  change within a step (`actor/ppo_kl`) above 0.1; the actor's log-probs of the samples off the rollout's
  (`rollout/logprob_diff/mean`) by more than 0.5 on average.
- grad_norm_spike: `actor/grad_norm` (or `critic/grad_norm`) above 10 × the median of the last 50 nonzero values
  (once 5 are known) at two steps within 50: with gradient clipping on (the default) one spike's update is bounded,
  and one comes with a loss leaving a plateau (the demo's SFT has one); spikes that repeat are the problem.
- not_finite: a loss or grad norm that is NaN or infinite (the weights are then NaN too).
- lr_schedule_ended: `actor/lr` (or `critic/lr`) at 0 with steps left: the lr schedule ended before the stage.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque

from tqdm import tqdm

LR_HINT = ("lower actor.strategy.optimizer.lr, e.g. by 3x (GRPO on a new task: start near 1e-4 to 3e-4 for the tiny "
           "model, 1e-6 to 3e-6 for a pretrained model of 0.5B to 7B; docs/troubleshooting.md, \"Health warnings\")")

ACCURACY_DROP_MIN, ACCURACY_DROP_SHARE = 0.1, 0.25
ENTROPY_SHARE, ENTROPY_PATIENCE = 0.1, 3
KL_LIMITS = {"actor/kl": 1.0, "actor/reward_kl_penalty": 1.0, "actor/ppo_kl": 0.1, "rollout/logprob_diff/mean": 0.5}
SPIKE_FACTOR, SPIKE_WINDOW, SPIKE_MIN_HISTORY, SPIKE_REPEATS = 10.0, 50, 5, 2
GRAD_NORM_KEYS = ("actor/grad_norm", "critic/grad_norm")
LR_KEYS = ("actor/lr", "critic/lr")


class HealthMonitor:
    """Watches one stage of `num_steps` steps. `check(step, metrics, first_val)` takes a step's metrics as the pipeline
    logs them (validation included) and the stage's validation before training (None: the first one seen is the
    start); it writes each kind's warning the first time it applies and returns `{"health/<kind>": 1.0}` for those."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.warned: set[str] = set()
        self.start_val: tuple[str, float] | None = None  # (key, value) of the stage's first validation
        self.recent_vals: deque[float] = deque(maxlen=2)
        self.first_entropy: float | None = None
        self.num_low_entropy_steps = 0
        self.grad_norms = {key: deque(maxlen=SPIKE_WINDOW) for key in GRAD_NORM_KEYS}
        self.spike_steps: list[int] = []  # the steps of the spikes seen within the last SPIKE_WINDOW steps

    def check(self, step: int, metrics: dict[str, float], first_val: dict[str, float] | None = None
              ) -> dict[str, float]:
        found = {}
        for kind, problem in (("not_finite", self._not_finite(metrics)),
                              ("lr_schedule_ended", self._lr_ended(step, metrics)),
                              ("grad_norm_spike", self._grad_norm_spike(step, metrics)),
                              ("kl_blowup", self._kl_blowup(metrics)),
                              ("entropy_collapse", self._entropy_collapse(metrics)),
                              ("accuracy_drop", self._accuracy_drop(metrics, first_val))):
            if problem is not None and kind not in self.warned:
                self.warned.add(kind)
                found[f"health/{kind}"] = 1.0
                tqdm.write(f"baton: warning: step {step}: {problem}", file=sys.stderr)
        return found

    def state_dict(self) -> dict:
        """What a resumed run needs to go on watching as if it had not stopped: the kinds already warned of (each
        warns once per stage, across resumes too), the stage's start and the running figures."""
        return {"warned": sorted(self.warned), "start_val": list(self.start_val) if self.start_val else None,
                "recent_vals": list(self.recent_vals), "first_entropy": self.first_entropy,
                "num_low_entropy_steps": self.num_low_entropy_steps,
                "grad_norms": {key: list(history) for key, history in self.grad_norms.items()},
                "spike_steps": list(self.spike_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.warned = set(state["warned"])
        self.start_val = tuple(state["start_val"]) if state["start_val"] else None
        self.recent_vals.clear()
        self.recent_vals.extend(state["recent_vals"])
        self.first_entropy, self.num_low_entropy_steps = state["first_entropy"], state["num_low_entropy_steps"]
        for key, history in self.grad_norms.items():
            history.clear()
            history.extend(state["grad_norms"].get(key, ()))
        self.spike_steps = list(state.get("spike_steps", ()))

    # --- each kind: the message when it applies, else None ----------------------------------------

    def _accuracy_drop(self, metrics: dict[str, float], first_val: dict[str, float] | None) -> str | None:
        key = next((k for k in ("val/accuracy", "val/reward/mean") if k in metrics), None)
        if key is None:
            return None
        if self.start_val is None:
            start = first_val.get(key) if first_val else None
            if start is None:  # no validation before training: the first one is the start
                self.start_val = (key, metrics[key])
                return None
            self.start_val = (key, start)
        start_key, start = self.start_val
        if key != start_key:
            return None
        self.recent_vals.append(metrics[key])
        floor = start - max(ACCURACY_DROP_MIN, ACCURACY_DROP_SHARE * abs(start))
        if len(self.recent_vals) < 2 or not all(value < floor for value in self.recent_vals):
            return None
        name = "held-out accuracy" if key == "val/accuracy" else "mean validation reward"
        shown = ", ".join(f"{value:.3f}" for value in self.recent_vals)
        return (f"{name} fell from {start:.3f} at the start of this stage to {shown} in the last two validations "
                f"({key}). The usual cause is a learning rate too high for the task, whose updates undo what the "
                f"model knew; {LR_HINT}. A policy that found a way to score the reward without solving the task "
                "(read its samples) shows the same way")

    def _entropy_collapse(self, metrics: dict[str, float]) -> str | None:
        if "actor/pg_loss" not in metrics or "actor/entropy" not in metrics:
            return None
        entropy = metrics["actor/entropy"]
        if self.first_entropy is None:
            self.first_entropy = entropy
            return None
        low = entropy < ENTROPY_SHARE * self.first_entropy
        self.num_low_entropy_steps = self.num_low_entropy_steps + 1 if low else 0
        if self.num_low_entropy_steps < ENTROPY_PATIENCE:
            return None
        return (f"the policy's entropy (actor/entropy) fell from {self.first_entropy:.3f} to {entropy:.3f}, below "
                f"{ENTROPY_SHARE:.0%} of its first value for {self.num_low_entropy_steps} steps: it samples nearly "
                "the same response every time, so a group's samples agree and teach little. What usually helps: a "
                "lower actor.strategy.optimizer.lr, a higher sampling.temperature, algorithm.entropy_coeff above 0 "
                "(e.g. 0.001), or clip-higher (algorithm.clip_ratio_high, DAPO's 0.28)")

    def _kl_blowup(self, metrics: dict[str, float]) -> str | None:
        over = {key: metrics[key] for key, limit in KL_LIMITS.items()
                if key in metrics and math.isfinite(metrics[key]) and abs(metrics[key]) > limit}
        if not over:
            return None
        shown = ", ".join(f"{key} = {value:.3g} (limit {KL_LIMITS[key]:g})" for key, value in over.items())
        if "rollout/logprob_diff/mean" in over and len(over) == 1:
            return (f"the actor's log-probs of the rollout's samples are far from the rollout's own: {shown}. The "
                    "rollout is sampling from weights unlike the actor's: a weight sync that failed, "
                    "trainer.sync_every_steps too large, or engines that compute differently (dtype, kernels). Set "
                    "sync_every_steps=1, check the rollout's dtype against the actor's, or turn on "
                    "algorithm.rollout_correction")
        return (f"the policy is moving too far: {shown}. The usual cause is a learning rate too high for the task; "
                f"{LR_HINT}. With a reference, a larger algorithm.kl_loss_coef holds the policy nearer it")

    def _grad_norm_spike(self, step: int, metrics: dict[str, float]) -> str | None:
        spike = None
        for key, history in self.grad_norms.items():
            norm = metrics.get(key)
            if norm is None or not math.isfinite(norm):
                continue
            if spike is None and len(history) >= SPIKE_MIN_HISTORY:
                median = statistics.median(history)
                if norm > SPIKE_FACTOR * median:
                    spike = (key, norm, median, len(history))
            if norm > 0:  # a step without learning signal has no gradient; it says nothing about the scale
                history.append(norm)
        if spike is None:
            return None
        self.spike_steps = [s for s in self.spike_steps if step - s < SPIKE_WINDOW] + [step]
        if len(self.spike_steps) < SPIKE_REPEATS:
            return None
        key, norm, median, num = spike
        return (f"{key} = {norm:.3g}, over {SPIKE_FACTOR:g}x the median of the last {num} steps ({median:.3g}), "
                f"the {len(self.spike_steps)}th such spike within {SPIKE_WINDOW} steps (steps "
                f"{', '.join(map(str, self.spike_steps))}): batches keep pushing the weights far. Gradient clipping "
                f"(actor.strategy.grad_clip, default 1.0) bounds each step; if it is off, turn it on; {LR_HINT}")

    def _not_finite(self, metrics: dict[str, float]) -> str | None:
        bad = sorted(key for key, value in metrics.items()
                     if (key.endswith("loss") or key.endswith("grad_norm")) and not math.isfinite(value))
        if not bad:
            return None
        return (f"{', '.join(bad)} is not a finite number, so the weights it updated are NaN or infinite and every "
                "later step trains nothing. Resume from the last checkpoint before it (trainer.resume=<its path>) "
                f"with a lower learning rate and actor.strategy.grad_clip set; {LR_HINT}")

    def _lr_ended(self, step: int, metrics: dict[str, float]) -> str | None:
        ended = [key for key in LR_KEYS if metrics.get(key) == 0.0]
        if not ended or step >= self.num_steps:
            return None
        role = ended[0].split("/")[0]
        return (f"{ended[0]} is 0 with {self.num_steps - step} of {self.num_steps} steps left: the lr schedule "
                f"({role}.strategy.scheduler) ended before the stage, so those steps train nothing. Set "
                f"{role}.strategy.scheduler.total_steps to the stage's optimizer updates, or remove it (the decay then "
                "spans the run), or set min_lr_ratio above 0")
