"""The role workers: actor, rollout, reference, critic (model roles) and reward (plain CPU logic)."""

from __future__ import annotations

import numpy as np
import torch

from baton.data import DataProto
from baton.distributed import Dispatch, Worker, register
from baton.models import load_tokenizer
from baton.rewards import REWARD_EXTRA_PREFIX, REWARD_ON_ERROR, get_reward_fn, score_rows
from baton.strategy import LossFn, SamplingParams, StrategyConfig
from baton.workers.model import ModelWorker


def _check_trains_one_model(worker: ModelWorker) -> None:
    """The hf strategy keeps an independent model per worker: trained on several workers, each copy would step on
    its own shard and drift apart from the others (and a weight sync sends rank 0's only)."""
    from baton.strategy.hf import HFStrategy  # here: a reward worker's process never loads the model code

    if worker.world_size > 1 and isinstance(worker.strategy, HFStrategy):
        raise ValueError(
            f"{type(worker).__name__} {worker.context.cluster_name!r}: the 'hf' strategy trains one independent model per "
            f"worker, not one model over world_size={worker.world_size} workers; use strategy 'fsdp2' or world_size=1"
        )


class ActorWorker(ModelWorker):
    """The policy being trained: log-probs and optimizer steps."""

    def __init__(self, config: StrategyConfig):
        super().__init__(config)
        _check_trains_one_model(self)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, batch: DataProto, loss_fn: LossFn, loss_unit: str = "token") -> dict[str, float]:
        return self.strategy.train_step(batch, loss_fn, loss_unit)


class RolloutWorker(ModelWorker):
    """Generates responses; receives the actor's weights."""

    @register(Dispatch.DP_COMPUTE)
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """Samples, with the temperature they were drawn at in `meta_info["temperature"]`."""
        return self.strategy.generate(prompts, params)

    @register(Dispatch.ONE_TO_ALL)
    def sampling_state(self):
        """The sampling generator's state (None for strategies that sample deterministically), for exact resume."""
        generator = getattr(self.strategy, "generator", None)
        return generator.get_state() if generator is not None else None

    @register(Dispatch.ALL_TO_ALL)
    def load_sampling_state(self, state) -> None:
        if state is not None:
            self.strategy.generator.set_state(state)

    @register(Dispatch.ONE_TO_ALL)
    def share_weights_with(self, role: str) -> None:
        """Use the weights of the `role` worker fused into this process, without copying them."""
        self.strategy.share_weights_from(self.colocated_worker(role).strategy)


class ReferenceWorker(ModelWorker):
    """A frozen copy of the initial policy, for KL terms: `compute_log_probs` only."""


class CriticWorker(ModelWorker):
    """A value model (strategy kind "value")."""

    def __init__(self, config: StrategyConfig):
        super().__init__(config)
        _check_trains_one_model(self)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: DataProto) -> DataProto:
        return self.strategy.forward(batch)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, batch: DataProto, loss_fn: LossFn, loss_unit: str = "token") -> dict[str, float]:
        return self.strategy.train_step(batch, loss_fn, loss_unit)


class RewardWorker(Worker):
    """Scores decoded responses with a reward function (registry name or import path). Pure CPU.

    Reads `responses`, `response_mask` and the non-tensor `ground_truth` column; every other
    non-tensor column is passed to the function as a keyword argument.

    on_error: a row the function raises on stops the run with a RewardError naming the function and the row
    ("raise"), or scores 0 ("zero"); `compute_rewards` counts those rows in meta_info["metrics"]["reward/num_errors"].
    A function that returns a non-number (None, a string, nan) raises RewardError either way.
    """

    def __init__(self, reward_fn: str, tokenizer: str | None = None, on_error: str = "raise"):
        if on_error not in REWARD_ON_ERROR:
            raise ValueError(f"on_error {on_error!r} is not one of {REWARD_ON_ERROR}")
        self.reward_name, self.on_error = reward_fn, on_error
        self.reward_fn = get_reward_fn(reward_fn)
        self.tokenizer = load_tokenizer(tokenizer)

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: DataProto) -> DataProto:
        """`scores` [rows] and `token_level_scores` [rows, response_len] (the score on the last response token),
        `reward_extra/<key>` [rows] float32 for each further field of a function that returns a dict (verl's
        compute_score dict: the reward under "score"), non-tensor `response_text`, and
        meta_info["metrics"]["reward/num_errors"] (rows scored 0 by on_error "zero")."""
        responses, mask = batch.batch["responses"], batch.batch["response_mask"]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        if "ground_truth" not in batch.non_tensor_batch:
            raise ValueError(f"compute_rewards needs a non-tensor 'ground_truth' column; got {sorted(batch.non_tensor_batch)}")
        fields = {k: v for k, v in batch.non_tensor_batch.items() if k != "ground_truth"}
        values, extras, num_errors = score_rows(self.reward_fn, self.reward_name, texts,
                                                batch.non_tensor_batch["ground_truth"], fields, self.on_error)
        scores = torch.tensor(values, dtype=torch.float32)
        token_level = torch.zeros(mask.shape, dtype=torch.float32)
        last = (mask.sum(-1) - 1).clamp(min=0)
        token_level[torch.arange(len(batch)), last] = scores * (mask.sum(-1) > 0)
        columns = {REWARD_EXTRA_PREFIX + k: torch.tensor(v, dtype=torch.float32) for k, v in extras.items()}
        return DataProto.from_dict({"scores": scores, "token_level_scores": token_level, **columns},
                                   {"response_text": np.array(texts, dtype=object)},
                                   meta_info={"metrics": {"reward/num_errors": num_errors}})
