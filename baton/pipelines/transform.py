"""The example pipeline: two CPU clusters transform arithmetic prompts, the data passing between them by reference.

Encoders turn prompt strings into padded character ids; evaluators read the ids back, compute
each sum and check it against the expected answer. The driver holds only a `DataProtoFuture`
between the two stages, so the encoded tensors go from encoder to evaluator workers directly.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from baton.data import DataProto
from baton.distributed import Dispatch, Worker, register
from baton.pipelines.base import Pipeline
from baton.pipelines.config import TrainerConfig, WorkerSettings
from baton.tracking.progress import progress

VOCAB = "<pad>0123456789+=".split("<pad>")[1]  # ids 1.. for these characters; 0 is padding


class Encoder(Worker):
    """Prompts (strings) → `input_ids` [rows, max_len] int64 and `lengths` [rows]."""

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def encode(self, data: DataProto) -> DataProto:
        prompts = data.non_tensor_batch["prompt"]
        max_len = max((len(p) for p in prompts), default=1)
        input_ids = torch.zeros(len(prompts), max_len, dtype=torch.int64)  # [rows, max_len]
        for row, prompt in enumerate(prompts):
            input_ids[row, : len(prompt)] = torch.tensor([VOCAB.index(ch) + 1 for ch in prompt])
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        out = DataProto.from_dict(
            {"input_ids": input_ids, "lengths": lengths},
            {"answer": data.non_tensor_batch["answer"]},
            meta_info={"metrics": {"encode/rows_per_worker": [len(prompts)]}},
        )
        return out


class Evaluator(Worker):
    """Decodes ids, evaluates `a+b=` and compares with `answer`: adds `predicted` and `correct`."""

    @register(Dispatch.DP_COMPUTE)
    def evaluate(self, data: DataProto) -> DataProto:
        predicted = []
        for ids, length in zip(data.batch["input_ids"].tolist(), data.batch["lengths"].tolist()):
            text = "".join(VOCAB[i - 1] for i in ids[:length])
            left, right = text.rstrip("=").split("+")
            predicted.append(int(left) + int(right))
        predicted = torch.tensor(predicted, dtype=torch.int64)
        answers = torch.tensor(data.non_tensor_batch["answer"].astype(np.int64))
        return DataProto.from_dict(
            {"predicted": predicted, "correct": (predicted == answers).float()},
            meta_info={"metrics": {"evaluate/rows_per_worker": [len(data)], "evaluate/rank": [self.rank]}},
        )


@dataclass
class TransformConfig:
    pipeline_cls: str = "baton.pipelines.transform:TransformPipeline"
    num_steps: int = 5
    num_rows_per_step: int = 1000
    num_encoders: int = 3
    num_evaluators: int = 2
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(run_dir="runs/transform"))


def make_prompts(num_rows: int, rng: random.Random) -> DataProto:
    pairs = [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(num_rows)]
    return DataProto.from_dict(
        non_tensors={"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": np.array([a + b for a, b in pairs])}
    )


class TransformPipeline(Pipeline):
    """`baton run examples/transform.yaml`: builds the two clusters, runs the steps, prints what happened."""

    config_cls = TransformConfig

    def __init__(self, config: TransformConfig):
        super().__init__(config, config.trainer)
        clusters = self.create_clusters({
            "encoder": (Encoder, WorkerSettings(world_size=config.num_encoders, num_devices_per_worker=0,
                                                num_cpus_per_worker=0.5), ()),
            "evaluator": (Evaluator, WorkerSettings(world_size=config.num_evaluators, num_devices_per_worker=0,
                                                    num_cpus_per_worker=0.5), ()),
        })
        self.encoders, self.evaluators = clusters["encoder"], clusters["evaluator"]

    def run(self) -> dict:
        config = self.config
        rng = random.Random(config.trainer.seed)
        num_correct = num_rows = 0
        start = time.perf_counter()
        for _ in progress(range(config.num_steps), "transform", initial=0, total=config.num_steps,
                          enabled=config.trainer.progress_bar):
            prompts = make_prompts(config.num_rows_per_step, rng)
            encoded = self.encoders.encode(prompts)  # DataProtoFuture: stays with the encoder workers
            scored = self.evaluators.evaluate(encoded)  # evaluator workers fetch their rows from the encoders
            num_correct += int(scored.batch["correct"].sum())
            num_rows += len(scored)
        wall_s = time.perf_counter() - start
        metrics = scored.meta_info["metrics"]
        print(f"\n{num_rows} prompts through {config.num_encoders} encoders → {config.num_evaluators} evaluators "
              f"in {wall_s:.2f} s ({num_rows / wall_s:,.0f} rows/s)")
        print(f"last step: evaluator ranks {metrics['evaluate/rank']} took {metrics['evaluate/rows_per_worker']} rows; "
              f"accuracy {num_correct / num_rows:.3f}")
        for row in range(3):
            print(f"  {prompts.non_tensor_batch['prompt'][row]:<10} → {int(scored.batch['predicted'][row])}")
        return {"rows": num_rows, "accuracy": num_correct / num_rows, "wall_s": wall_s}
