"""Rollout-only data generation (ROLL's rollout pipeline): generate and score responses over a dataset, no training.

`GeneratePipeline` takes a model (a registry name, a baton checkpoint's `actor` directory or any HF model directory
as `rollout.strategy.model`), samples `sampling.num_samples_per_prompt` responses for every prompt of a split,
scores them with the reward function, and writes one row per prompt: the prompt, its answer and other fields,
and per response its text, reward, finish reason and token log-probs. The prompts go in order, a chunk of
`num_prompts_per_chunk` per step; each chunk is seeded by (trainer.seed, its index), written atomically as a part
file and checkpointed, so an interrupted run resumes (`trainer.resume=latest`) and writes exactly what an
uninterrupted one would. At the end the parts are joined into `output` (.jsonl or .parquet), and, where set:

- `sft_output`: rejection sampling fine-tuning data: per prompt up to `sft_responses_per_prompt` distinct
  responses rewarded at least `sft_min_reward` (rows prompt, answer, response: SFT with `data.task: files`,
  `data.response_key: response`);
- `dpo_output`: preference pairs: per prompt its best response against its worst, where their rewards differ
  (rows prompt, chosen, rejected, chosen_reward, rejected_reward: what `PreferenceDataset` reads).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from baton.config import ConfigError
from baton.data.atomic import atomic_file
from baton.datasets import collate_prompts
from baton.pipelines.base import Pipeline
from baton.pipelines.config import DataConfig, RewardSettings, RoleConfig, SamplingConfig, TrainerConfig
from baton.workers import RewardWorker
from baton.workers.roles import RolloutWorker

FORMATS = (".jsonl", ".parquet")
SPLITS = ("train", "val")
PARTS = "parts"  # under the run directory: one part file per chunk, and what settings made them
SETTINGS_FILE = "settings.json"


def _reward_workers() -> RewardSettings:
    return RewardSettings(world_size=1, num_devices_per_worker=0)


@dataclass
class GenerateConfig:
    """See the module docstring.

    split: which of the data's splits is generated over ("train" or "val"). max_prompts: its first N prompts
    (None: all). output / sft_output / dpo_output: paths (relative: under `trainer.run_dir`), each .jsonl or
    .parquet; an existing file is refused unless trainer.overwrite or trainer.resume is set.
    """

    pipeline_cls: str = "baton.pipelines.generate:GeneratePipeline"
    rollout: RoleConfig = field(default_factory=RoleConfig)
    reward_fn: str | dict[str, str] = "exact_match"
    reward_on_error: str = "raise"
    reward: RewardSettings = field(default_factory=_reward_workers)
    data: DataConfig = field(default_factory=DataConfig)
    split: str = "train"
    max_prompts: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    num_prompts_per_chunk: int = 64
    output: str = "rollouts.jsonl"
    sft_output: str | None = None
    sft_min_reward: float = 1.0
    sft_responses_per_prompt: int = 1
    dpo_output: str | None = None
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(run_dir="runs/generate"))

    def check(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"split {self.split!r} is not one of {SPLITS}")
        if self.num_prompts_per_chunk < 1:
            raise ConfigError(f"num_prompts_per_chunk={self.num_prompts_per_chunk} must be >= 1")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"max_prompts={self.max_prompts} must be >= 1 (or null: every prompt of the split)")
        if self.sft_responses_per_prompt < 1:
            raise ConfigError(f"sft_responses_per_prompt={self.sft_responses_per_prompt} must be >= 1")
        if self.reward_on_error not in ("raise", "zero"):
            raise ConfigError(f"reward_on_error {self.reward_on_error!r} is not 'raise' or 'zero'")
        paths = {}
        for key in ("output", "sft_output", "dpo_output"):
            path = getattr(self, key)
            if path is None:
                continue
            if os.path.splitext(path)[1] not in FORMATS:
                raise ConfigError(f"{key} {path!r} must end in one of {FORMATS}")
            where = self.path(path)
            if where in paths:
                raise ConfigError(f"{key} and {paths[where]} are the same file {path!r}; give each its own")
            paths[where] = key
            if os.path.exists(where) and not self.trainer.overwrite and self.trainer.resume is None:
                raise ConfigError(f"{key} {where!r} exists; keep it by choosing another path, or replace it with "
                                  "trainer.overwrite=true")

    def path(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self.trainer.run_dir, path)

    def settings(self) -> dict[str, Any]:
        """What decides the part files' contents: a resumed run must have made its parts with the same."""
        return {"model": str(self.rollout.strategy.model), "split": self.split, "max_prompts": self.max_prompts,
                "sampling": dataclasses.asdict(self.sampling), "num_prompts_per_chunk": self.num_prompts_per_chunk,
                "seed": self.trainer.seed, "reward_fn": self.reward_fn, "data": dataclasses.asdict(self.data)}


class GeneratePipeline(Pipeline):
    config_cls = GenerateConfig

    def __init__(self, config: GenerateConfig):
        super().__init__(config, config.trainer)
        self.prompts = self.train_data if config.split == "train" else self.val_data
        if self.prompts is None or not len(self.prompts):
            raise ConfigError(f"split {config.split!r} holds no prompts; set data.val_path (or split: train)")
        self.num_prompts = min(len(self.prompts), config.max_prompts or len(self.prompts))
        self.trainer = dataclasses.replace(self.trainer, num_steps=math.ceil(self.num_prompts
                                                                             / config.num_prompts_per_chunk))
        self.parts_dir = os.path.join(self.trainer.run_dir, PARTS)
        self._check_parts()
        clusters = self.create_clusters({
            "rollout": (RolloutWorker, config.rollout, (config.rollout.strategy,)),
            "reward": (RewardWorker, config.reward, (config.reward_fn, config.rollout.strategy.tokenizer,
                                                     config.reward_on_error, config.reward.num_processes_per_worker,
                                                     config.reward.timeout_s_per_row))})
        self.rollout, self.reward = clusters["rollout"], clusters["reward"]
        self.sampling_clusters = ["rollout"]
        self.maybe_resume()

    @classmethod
    def load_data(cls, config: GenerateConfig):
        from baton.datasets.load import load_datasets

        return load_datasets(config.data, config.rollout.strategy.tokenizer)

    def _check_parts(self) -> None:
        """A new run starts with no parts (overwrite removes a previous run's); a resumed one only continues parts
        made with its settings."""
        settings_path = os.path.join(self.parts_dir, SETTINGS_FILE)
        settings = json.loads(json.dumps(self.config.settings()))
        if self.trainer.overwrite or (self.trainer.resume is None and os.path.isdir(self.parts_dir)):
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        if os.path.isfile(settings_path):
            with open(settings_path) as f:
                made_with = json.load(f)
            changed = sorted(k for k in settings if settings[k] != made_with.get(k))
            if changed:
                raise ConfigError(f"{self.parts_dir} holds parts made with other settings ({', '.join(changed)}); "
                                  "resume with the same settings, or start again with trainer.overwrite=true")
        os.makedirs(self.parts_dir, exist_ok=True)
        with atomic_file(settings_path) as f:
            json.dump(settings, f, indent=1)

    def part_path(self, step: int) -> str:
        return os.path.join(self.parts_dir, f"part-{step - 1:05d}.jsonl")

    def generate_chunk(self, step: int) -> list[dict[str, Any]]:
        """The rows of chunk `step` (1-based): its prompts generated with a seed of (trainer.seed, step), scored."""
        config = self.config
        start = (step - 1) * config.num_prompts_per_chunk
        indices = list(range(start, min(start + config.num_prompts_per_chunk, self.num_prompts)))
        prompts = collate_prompts(self.prompts, indices, self.tokenizer, config.data.max_prompt_len, uid_offset=start)
        out = self.rollout.generate(prompts, config.sampling.params(seed=config.trainer.seed * 1_000_003 + step))
        rewards = self.reward.compute_rewards(out)
        n = config.sampling.num_samples_per_prompt
        mask = out.batch["response_mask"].bool()
        log_probs = out.batch["rollout_log_probs"]
        texts, scores = rewards.non_tensor_batch["response_text"], rewards.batch["scores"].tolist()
        finish = out.non_tensor_batch["finish_reason"]
        rows = []
        for i, index in enumerate(indices):
            example = self.prompts[index]
            samples = range(i * n, (i + 1) * n)
            rows.append({"index": index, **{k: _plain(v) for k, v in example.items()},
                         "responses": [str(texts[j]) for j in samples], "rewards": [float(scores[j]) for j in samples],
                         "finish_reasons": [str(finish[j]) for j in samples],
                         "log_probs": [log_probs[j][mask[j]].tolist() for j in samples]})
        return rows

    def run(self) -> dict:
        tracker = self.make_tracker()
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        for step in self.training_steps("generate"):
            with self.timer("step"):
                rows = self.generate_chunk(step)
                write_rows(self.part_path(step), rows)
            metrics = {**chunk_metrics(rows), **self.timings}
            tracker.log(metrics, step=step)
            self.bar.set_postfix({"reward": f"{metrics['generate/reward/mean']:.3f}"})
            self.do_checkpoint(step)
        tracker.close()
        rows = [row for step in range(1, self.trainer.num_steps + 1) for row in read_rows(self.part_path(step))]
        config = self.config
        outputs = {"output": write_rows(config.path(config.output), rows)}
        if config.sft_output is not None:
            outputs["sft_output"] = write_rows(config.path(config.sft_output), rejection_sampling(
                rows, config.sft_min_reward, config.sft_responses_per_prompt))
        if config.dpo_output is not None:
            outputs["dpo_output"] = write_rows(config.path(config.dpo_output), preference_pairs(rows))
        summary = {"wall_s": time.perf_counter() - start, "num_prompts": len(rows), **chunk_metrics(rows),
                   **{key: os.path.abspath(path) for key, path in outputs.items()},
                   **{f"num_rows/{key}": count_rows(path) for key, path in outputs.items()}}
        if self.resumed_from_step is not None:
            summary["resumed_from_step"] = self.resumed_from_step
        return self.finish(summary)


# --- rows ------------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A dataset field as JSON holds it (numpy scalars and arrays as Python numbers and lists)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def chunk_metrics(rows: list[dict]) -> dict[str, float]:
    """`generate/reward/mean`, `generate/accuracy` (share of responses rewarded >= 1), `generate/pass@n` (share of
    prompts with one), `generate/truncated_ratio` and `generate/response_length/mean` over `rows`."""
    rewards = np.array([r for row in rows for r in row["rewards"]], dtype=float)
    return {"generate/reward/mean": float(rewards.mean()), "generate/accuracy": float(np.mean(rewards >= 1.0)),
            "generate/pass@n": float(np.mean([max(row["rewards"]) >= 1.0 for row in rows])),
            "generate/truncated_ratio": float(np.mean([f == "length" for row in rows for f in row["finish_reasons"]])),
            "generate/response_length/mean": float(np.mean([len(lp) for row in rows for lp in row["log_probs"]]))}


def rejection_sampling(rows: Iterable[dict], min_reward: float = 1.0, per_prompt: int = 1) -> list[dict]:
    """Rejection sampling fine-tuning data: per prompt, up to `per_prompt` distinct responses rewarded at least
    `min_reward`, best first (ties: in sampling order), as rows {prompt, answer (where the row has one), response,
    reward}."""
    out = []
    for row in rows:
        ranked = sorted(range(len(row["responses"])), key=lambda j: -row["rewards"][j])
        kept: list[str] = []
        for j in ranked:
            if row["rewards"][j] >= min_reward and row["responses"][j] not in kept and len(kept) < per_prompt:
                kept.append(row["responses"][j])
                out.append({"prompt": row["prompt"], **({"answer": row["answer"]} if "answer" in row else {}),
                            "response": row["responses"][j], "reward": row["rewards"][j]})
    return out


def preference_pairs(rows: Iterable[dict]) -> list[dict]:
    """Per prompt, its best response (chosen) against its worst (rejected), where their rewards differ (ties: the
    first sampled), as rows {prompt, chosen, rejected, chosen_reward, rejected_reward}."""
    out = []
    for row in rows:
        rewards = row["rewards"]
        best, worst = int(np.argmax(rewards)), int(np.argmin(rewards))
        if rewards[best] > rewards[worst]:
            out.append({"prompt": row["prompt"], "chosen": row["responses"][best],
                        "rejected": row["responses"][worst], "chosen_reward": rewards[best],
                        "rejected_reward": rewards[worst]})
    return out


def write_rows(path: str, rows: list[dict]) -> str:
    """`rows` to `path` (.jsonl: one JSON object per line; .parquet), atomically; returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        with atomic_file(path, binary=True) as f:
            pq.write_table(pa.Table.from_pylist(rows), f)
    else:
        with atomic_file(path) as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return path


def read_rows(path: str) -> list[dict]:
    """The rows of a file written by `write_rows`."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def count_rows(path: str) -> int:
    return len(read_rows(path))


__all__ = ["GenerateConfig", "GeneratePipeline", "chunk_metrics", "preference_pairs", "read_rows",
           "rejection_sampling", "write_rows"]
