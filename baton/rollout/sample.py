"""`Sample`: one response to one prompt as the rollout system carries it, and `samples_to_data`, the one conversion of
finished samples to a training batch in the generate() layout."""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from baton.data import DataProto
from baton.rewards import REWARD_EXTRA_PREFIX
from baton.strategy.logprobs import position_ids_from_mask


class Status(str, enum.Enum):
    """Where a sample is: PENDING (not started, or partly generated and put back), COMPLETED (stopped on a stop
    token), TRUNCATED (hit the length limit), ABORTED (generation was cut off, e.g. by a weight update), FAILED (its
    generation or environment raised)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


FINISH_REASONS = {Status.COMPLETED: "stop", Status.TRUNCATED: "length", Status.ABORTED: "abort"}
TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


@dataclass
class Sample:
    """One response to one prompt: the unit the rollout system generates, rewards, buffers and trains on.

    Fields:
        group_index: the prompt group; every sample of a prompt shares it, and it becomes the `uid` column that
            GRPO-style advantages group by.
        sample_index: the sample's place in its group, 0-based.
        prompt: the prompt text (a chat prompt already rendered).
        prompt_ids: the prompt's token ids, unpadded.
        label: the ground truth the reward checks, None for none.
        response: the response text.
        response_ids: every token after the prompt, unpadded: the model's and, in multi-turn rollouts, the
            environment's (tool outputs, user turns).
        loss_mask: None means all ones; else one 0/1 per response token, 0 on tokens the model did not write
            (environment tokens) or that are masked out as too stale.
        reward: a number, or a dict holding the score under a key (`score`) and further numeric fields; None until
            rewarded.
        rollout_log_probs: one log-prob per response token, as the sampling policy computed it; 0.0 on
            environment tokens.
        weight_versions: the policy weight version that sampled each response token; -1 on environment tokens.
        status: see `Status`.
        seed: the sample's sampling seed, None for unseeded.
        metadata: free-form and JSON-serialisable: the dataset row's other fields (data_source among them),
            anything a rollout function records.

    Invariant (`check()`): loss_mask (when set), rollout_log_probs and weight_versions each hold exactly
    `response_length` entries. A partly generated sample keeps it too, so it can be buffered and resumed.
    """

    group_index: int
    sample_index: int
    prompt: str
    prompt_ids: list[int]
    label: str | None = None
    response: str = ""
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] | None = None
    reward: float | dict | None = None
    rollout_log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    status: Status = Status.PENDING
    seed: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def where(self) -> str:
        """The sample's name in messages: "group G sample S"."""
        return f"group {self.group_index} sample {self.sample_index}"

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def effective_loss_mask(self) -> list[int]:
        """The loss mask with None spelled out: one 0/1 per response token."""
        return [1] * self.response_length if self.loss_mask is None else [int(m) for m in self.loss_mask]

    def oldest_version(self) -> int | None:
        """The oldest weight version among its trained tokens (the model's, in the loss: environment tokens and
        masked ones aside), None if it has none; the staleness ledger measures staleness from it."""
        versions = np.asarray(self.weight_versions, dtype=np.int64)  # in C: a long trace's tokens are many
        trained = versions >= 0
        if self.loss_mask is not None:
            if len(self.loss_mask) != len(versions):
                self.check()  # the error naming the sample and the list
            trained &= np.asarray(self.loss_mask, dtype=bool)
        return int(versions[trained].min()) if trained.any() else None

    def score(self, reward_key: str = "score") -> float:
        """The scalar reward: `reward` itself if a number, `reward[reward_key]` if a dict."""
        reward = self.reward
        if reward is None:
            raise ValueError(f"{self.where()} has no reward; reward it before training on it")
        if isinstance(reward, dict):
            if reward_key not in reward:
                raise ValueError(f"{self.where()}: the reward dict has no {reward_key!r} (keys: {sorted(reward)}); "
                                 "return the score under that key, or set the reward key to the one that holds it")
            reward = reward[reward_key]
        if not isinstance(reward, numbers.Real):
            raise ValueError(f"{self.where()}: the reward is {reward!r}, not a number")
        return float(reward)

    def check(self) -> None:
        """Raise ValueError naming the sample when a per-token list does not hold one entry per response token."""
        length = self.response_length
        for name in ("loss_mask", "rollout_log_probs", "weight_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != length:
                raise ValueError(f"{self.where()}: {name} has {len(values)} entries but the response has {length} "
                                 f"tokens; append one entry to {name} for every token appended to response_ids")
        if self.loss_mask is not None and any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"{self.where()}: loss_mask holds values other than 0 and 1; use 1 to train on a "
                             "token and 0 to mask it")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (given JSON-safe reward and metadata); `Sample.from_dict` reads it back."""
        out = dataclasses.asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        """The sample `to_dict` wrote (copied: the sample shares no list with `d`); unknown keys raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(d.keys() - names)
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown key {unknown[0]!r}; a Sample's fields are {sorted(names)}")
        try:
            status = Status(d.get("status", Status.PENDING))
        except ValueError:
            raise ValueError(f"Sample.from_dict: status {d['status']!r} is not one of "
                             f"{[s.value for s in Status]}") from None
        try:
            return cls(**{**copy.deepcopy(d), "status": status})
        except TypeError as e:  # a required field is missing
            raise ValueError(f"Sample.from_dict: {e}") from None


def samples_to_data(samples: list[Sample], pad_token_id: int, temperature: float,
                    reward_key: str = "score") -> DataProto:
    """Finished, rewarded samples as a training batch in `baton.strategy.sampling.generation_output`'s layout.

    Tensors (rows = samples, P = longest prompt, R = longest response):
        prompts [rows, P] long, left-padded with pad_token_id; responses [rows, R] long, right-padded;
        input_ids = cat(prompts, responses); attention_mask [rows, P + R] long, 1 on every real token (environment
        and stale-masked tokens included); position_ids from the attention mask;
        response_mask [rows, R] long: the effective loss mask, 0 on padding;
        rollout_log_probs [rows, R] float32, 0 on padding; rollout_weight_versions [rows, R] int64, -1 on padding;
        scores [rows] float32; token_level_scores [rows, R] float32, the score on each last response token;
        reward_extra/<key> [rows] float32 for each further numeric field of dict rewards (0 where a sample lacks it).
    Non-tensors: uid (group_index), ground_truth (label), prompt, finish_reason ("stop" / "length"), and each
    metadata key every sample has. meta_info: {"temperature": temperature}.

    Only COMPLETED and TRUNCATED samples train; any other status raises ValueError naming the sample.
    """
    if not samples:
        raise ValueError("samples_to_data needs at least one sample")
    for sample in samples:
        sample.check()
        if sample.status not in TRAINABLE:
            raise ValueError(f"{sample.where()} has status {sample.status.value!r}; only completed or truncated "
                             "samples can be trained: finish it, drop it, or put its group back in the data source")
    rows = len(samples)
    prompt_len = max(len(s.prompt_ids) for s in samples)
    response_len = max(s.response_length for s in samples)
    scores = torch.tensor([s.score(reward_key) for s in samples], dtype=torch.float32)  # [rows]
    prompt_ids, response_ids = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    prompts = _padded(prompt_ids, prompt_len, pad_token_id, torch.long, left=True)  # [rows, P]
    prompt_mask = _real([len(ids) for ids in prompt_ids], prompt_len, left=True)
    responses = _padded(response_ids, response_len, pad_token_id, torch.long)  # [rows, R]
    response_real = _real([len(ids) for ids in response_ids], response_len)
    response_mask = _padded([s.effective_loss_mask() for s in samples], response_len, 0, torch.long)
    log_probs = _padded([s.rollout_log_probs for s in samples], response_len, 0.0, torch.float32)
    versions = _padded([s.weight_versions for s in samples], response_len, -1, torch.int64)
    lengths = torch.tensor([len(ids) for ids in response_ids])  # [rows]
    token_level_scores = torch.zeros(rows, response_len, dtype=torch.float32)
    made = lengths > 0
    token_level_scores[torch.arange(rows)[made], lengths[made] - 1] = scores[made]  # on each last response token
    attention_mask = torch.cat([prompt_mask, response_real], dim=1)  # [rows, P + R]
    tensors = {
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask), "rollout_log_probs": log_probs,
        "rollout_weight_versions": versions, "scores": scores, "token_level_scores": token_level_scores,
    }
    tensors.update(_reward_extras(samples, reward_key))
    non_tensors = {
        "uid": np.array([s.group_index for s in samples], dtype=np.int64),
        "ground_truth": _object_column([s.label for s in samples]),
        "prompt": _object_column([s.prompt for s in samples]),
        "finish_reason": _object_column([FINISH_REASONS[s.status] for s in samples]),
    }
    shared = [k for k in samples[0].metadata if all(k in s.metadata for s in samples)]
    for key in shared:
        if key in non_tensors or key in tensors:
            raise ValueError(f"{samples[0].where()}: the metadata key {key!r} is also a column of the training "
                             "batch; rename it")
        non_tensors[key] = _object_column([s.metadata[key] for s in samples])
    return DataProto.from_dict(tensors, non_tensors, meta_info={"temperature": temperature})


def _padded(rows: list[list], width: int, fill, dtype: torch.dtype, left: bool = False) -> torch.Tensor:
    """[len(rows), width]: each row padded with `fill` to `width` (on the left with `left`). The rows go into the
    tensor flat, through one boolean mask of the real positions (row-major, the order they are listed in)."""
    real = _real([len(row) for row in rows], width, left).bool()  # [rows, width]
    out = torch.full((len(rows), width), fill, dtype=dtype)
    out[real] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype)
    return out


def _real(lengths: list[int], width: int, left: bool = False) -> torch.Tensor:
    """[len(lengths), width] long: 1 on each row's first (last, with `left`) `length` positions, else 0."""
    lengths = torch.tensor(lengths, dtype=torch.long)[:, None]
    columns = torch.arange(width)
    return (columns >= width - lengths if left else columns < lengths).long()


def _reward_extras(samples: list[Sample], reward_key: str) -> dict[str, torch.Tensor]:
    """`reward_extra/<key>` [rows] float32 for each further numeric field of the dict rewards, 0 where absent."""
    names = list(dict.fromkeys(k for s in samples if isinstance(s.reward, dict) for k, v in s.reward.items()
                               if k != reward_key and isinstance(v, numbers.Real)))
    columns = {}
    for name in names:
        values = [s.reward.get(name, 0.0) if isinstance(s.reward, dict) else 0.0 for s in samples]
        columns[REWARD_EXTRA_PREFIX + name] = torch.tensor(
            [float(v) if isinstance(v, numbers.Real) else 0.0 for v in values], dtype=torch.float32)
    return columns


def _object_column(values: list[Any]) -> np.ndarray:
    """A 1-D object array with one element per value (a list stays one element, not a second dimension)."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


__all__ = ["FINISH_REASONS", "Sample", "Status", "samples_to_data"]
