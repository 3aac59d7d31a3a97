"""The role workers: actor, rollout, reference, teacher, critic (model roles) and reward (plain CPU logic)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from baton.data import DataProto
from baton.distributed import Worker, register, register_dispatch_mode
from baton.distributed.dispatch import Dispatch, split_dp_args
from baton.models import load_tokenizer
from baton.rewards import (PRED, REWARD_EXTRA_PREFIX, REWARD_ON_ERROR, RewardError, RewardRoutes, overlong_penalty,
                           score_rows, scoring_pool)
from baton.strategy import LossFn, SamplingParams, StrategyConfig
from baton.strategy.capabilities import backends_that, capabilities
from baton.strategy.logprobs import sampling_temperature
from baton.workers.model import ModelWorker


def _check_trains_one_model(worker: ModelWorker) -> None:
    """A backend that does not train over workers (`Capabilities.trains_over_workers`, e.g. hf) keeps an independent
    model per worker: trained on several workers, each copy would step on its own shard and drift apart from the
    others (and a weight sync sends rank 0's only)."""
    if worker.world_size > 1 and not capabilities(worker.config.name).trains_over_workers:
        choices = " or ".join(repr(name) for name in backends_that("trains_over_workers"))
        raise ValueError(
            f"{type(worker).__name__} {worker.context.cluster_name!r}: the {worker.config.name!r} strategy trains one "
            f"independent model per worker, not one model over world_size={worker.world_size} workers; use strategy "
            f"{choices} or world_size=1"
        )


class ActorWorker(ModelWorker):
    """The policy being trained: log-probs and optimizer steps."""

    def __init__(self, config: StrategyConfig):
        super().__init__(config)
        _check_trains_one_model(self)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, batch: DataProto, loss_fn: LossFn, loss_unit: str = "token") -> dict[str, float]:
        return self.strategy.train_step(batch, loss_fn, loss_unit)

    @register(Dispatch.DP_COMPUTE)
    def compute_base_log_probs(self, batch: DataProto) -> DataProto:
        """`compute_log_probs` of the model with its LoRA adapter off: the initial model's (`base_forward`)."""
        return self.strategy.base_forward(batch, temperature=sampling_temperature(batch))


class BaseModelReference:
    """The reference of a LoRA actor whose reference is its initial model: the actor's cluster, adapter off. It
    stands where a reference cluster would (`TrainingRoles.reference`), without a second copy of the model."""

    def __init__(self, actor):
        self.actor = actor

    def compute_log_probs(self, batch: DataProto) -> DataProto:
        return self.actor.compute_base_log_probs(batch)


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


class TeacherWorker(RolloutWorker):
    """A frozen model that a student distils: its top-k log-probs of every response token, and (as a rollout) its own
    responses to prompts. Never trained, never synced."""

    @register(Dispatch.DP_COMPUTE)
    def compute_top_k_log_probs(self, batch: DataProto, k: int) -> DataProto:
        """`top_k_log_probs` and `top_k_ids` [rows, response_len, k] at the batch's temperature
        (`sampling_temperature`), computed here: only k values and ids per token cross to the driver or the student,
        never a full-vocabulary tensor."""
        return self.strategy.top_k_log_probs(batch, k, temperature=sampling_temperature(batch))


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


def combine_reward_shares(shares: list[DataProto]) -> DataProto:
    """The reward workers' shares in dp order. A share lacks a `reward_extra/*` column when none of its rows returned
    that field (each one raised and was scored 0, or, under a data_source mapping, its rows' functions do not return
    it): there the column is 0 (None for `reward_extra/pred`), as on such rows within a share."""
    tensor_names = list(dict.fromkeys(k for share in shares for k in share.batch if k.startswith(REWARD_EXTRA_PREFIX)))
    pred = REWARD_EXTRA_PREFIX + PRED
    has_pred = any(pred in share.non_tensor_batch for share in shares)
    for share in shares:
        for name in tensor_names:
            share.batch.setdefault(name, torch.zeros(len(share), dtype=torch.float32))
        if has_pred:
            share.non_tensor_batch.setdefault(pred, np.full(len(share), None, dtype=object))
    return DataProto.concat(shares)


_REWARD_DP_COMPUTE = register_dispatch_mode(
    "reward_dp_compute", lambda layout, args, kwargs: split_dp_args(layout, args, kwargs, first_mp_rank_only=False),
    lambda layout, shares: combine_reward_shares(shares), lambda layout: layout.collect_ranks(),
    combine_fn=combine_reward_shares)


class RewardWorker(Worker):
    """Scores decoded responses with a reward function (registry name or import path), or with one per data_source
    (a mapping {data_source: reward}, "default" for the other sources; see `baton.rewards.RewardRoutes`). Pure CPU.

    Reads `responses`, `response_mask` and the non-tensor `ground_truth` column; every other non-tensor column is
    passed to the function as a keyword argument (a function with verl's `compute_score(data_source, solution_str,
    ground_truth, extra_info)` signature gets those four instead, as verl passes them). reward_kwargs: the
    functions' settings (the config's `reward_kwargs`, see `RewardRoutes`); a column named like a setting is an
    error, never a setting.

    on_error: a row the function raises on stops the run with a RewardError naming the function and the row
    ("raise"), or scores 0 ("zero"); `compute_rewards` counts those rows in meta_info["metrics"]["reward/num_errors"].
    A function that returns a non-number (None, a string, nan) raises RewardError either way.

    num_processes: 0 scores the rows one after another in this process; more scores them concurrently in that many
    processes of their own (`baton.rewards.ScoringPool`), where a row running past `timeout_s_per_row` (None: no
    limit) is cut off (its process killed) and treated like a row the function raised on (counted in
    "reward/num_timeouts" too). A slow reward (math_verify) is scored in processes with a limit by default (see
    `baton.rewards.scoring_pool`).

    overlong_buffer_len > 0: DAPO's soft overlong penalty (`baton.rewards.overlong_penalty`, with `max_response_len`
    the sampling limit) is added to the score of the batches `compute_rewards` is asked to penalise.
    """

    def __init__(self, reward_fn: str | Mapping[str, str], tokenizer: str | None = None, on_error: str = "raise",
                 num_processes: int = 0, timeout_s_per_row: float | None = None, max_response_len: int | None = None,
                 overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0,
                 reward_kwargs: Mapping[str, Any] | None = None):
        if on_error not in REWARD_ON_ERROR:
            raise ValueError(f"on_error {on_error!r} is not one of {REWARD_ON_ERROR}")
        if timeout_s_per_row is not None and num_processes < 1:
            raise ValueError(f"timeout_s_per_row={timeout_s_per_row} needs num_processes >= 1: a row scored in the "
                             "worker's own process cannot be cut off")
        if overlong_buffer_len and not (max_response_len and 0 < overlong_buffer_len < max_response_len):
            raise ValueError(f"overlong_buffer_len={overlong_buffer_len} needs a max_response_len above it, got "
                             f"{max_response_len}")
        self.on_error = on_error
        self.routes = RewardRoutes(reward_fn, reward_kwargs)
        self.pool = scoring_pool(self.routes, num_processes, timeout_s_per_row)
        self.max_response_len = max_response_len
        self.overlong_buffer_len, self.overlong_penalty_factor = overlong_buffer_len, overlong_penalty_factor
        self.tokenizer = load_tokenizer(tokenizer)

    @register(_REWARD_DP_COMPUTE)
    def compute_rewards(self, batch: DataProto, apply_overlong_penalty: bool = False) -> DataProto:
        """`scores` [rows] and `token_level_scores` [rows, response_len] (the score on the last response token),
        `reward_extra/<key>` [rows] float32 for each further numeric field of a function that returns a dict (verl's
        compute_score dict: the reward under "score"), non-tensor `response_text` and, where a function returns
        verl's "pred" (the extracted answer), non-tensor `reward_extra/pred` (None on rows without one), and
        meta_info["metrics"]["reward/num_errors"] (rows scored 0 by on_error "zero") and ["reward/num_timeouts"].

        apply_overlong_penalty (training batches; validation scores the function's own): with an overlong buffer,
        the penalty is added to the score, and `reward_extra/overlong_reward` (the penalty) and
        `reward_extra/overlong` (1.0 where it is below 0) are verl's DAPO extra fields."""
        responses, mask = batch.batch["responses"], batch.batch["response_mask"]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        if "ground_truth" not in batch.non_tensor_batch:
            raise ValueError(f"compute_rewards needs a non-tensor 'ground_truth' column; got {sorted(batch.non_tensor_batch)}")
        fields = {k: v for k, v in batch.non_tensor_batch.items() if k != "ground_truth"}
        truths = batch.non_tensor_batch["ground_truth"]
        result = score_rows(self.routes, texts, truths, fields, self.on_error, self.pool)
        scores = torch.tensor(result.scores, dtype=torch.float32)
        lengths = mask.sum(-1)
        columns = {REWARD_EXTRA_PREFIX + k: torch.tensor(v, dtype=torch.float32) for k, v in result.extras.items()}
        if apply_overlong_penalty and self.overlong_buffer_len:
            penalty = overlong_penalty(lengths, self.max_response_len, self.overlong_buffer_len,
                                       self.overlong_penalty_factor)
            taken = sorted({"overlong_reward", "overlong"} & result.extras.keys())
            if taken:
                raise RewardError(f"reward_fn {self.routes.describe()} returns the field(s) {taken}, which the overlong "
                                  "penalty (overlong_buffer) writes; rename them")
            scores = scores + penalty
            columns[REWARD_EXTRA_PREFIX + "overlong_reward"] = penalty
            columns[REWARD_EXTRA_PREFIX + "overlong"] = (penalty < 0).to(torch.float32)
        token_level = torch.zeros(mask.shape, dtype=torch.float32)
        last = (lengths - 1).clamp(min=0)
        token_level[torch.arange(len(batch)), last] = scores * (lengths > 0)
        non_tensors = {"response_text": np.array(texts, dtype=object)}
        if result.preds is not None:
            non_tensors[REWARD_EXTRA_PREFIX + PRED] = np.array(result.preds, dtype=object)
        return DataProto.from_dict({"scores": scores, "token_level_scores": token_level, **columns}, non_tensors,
                                   meta_info={"metrics": {"reward/num_errors": result.num_errors,
                                                          "reward/num_timeouts": result.num_timeouts}})
