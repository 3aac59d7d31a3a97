"""Model-judged rewards: a scalar reward model (a value-head model's value at a response's last token) and a
generative judge (a causal LM served like a rollout, prompted with a template, its answer parsed to a score).

Both return `rm_scores` [rows] for a generated batch (`input_ids`, `attention_mask`, `responses`,
`response_mask`; the judge also reads the non-tensor `prompt`, and `ground_truth` where the batch has it).
"""

from __future__ import annotations

import math
import re
import secrets

import numpy as np
import torch

from baton.config import import_object
from baton.data import DataProto
from baton.distributed import Dispatch, register
from baton.strategy import SamplingParams, StrategyConfig
from baton.workers.model import ModelWorker

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def first_number(text: str) -> float:
    """The default judge parse function: the first number in the judge's answer, its exponent included ("1e20" is
    1e20, not 1); ValueError if there is none."""
    match = _NUMBER.search(text)
    if match is None:
        raise ValueError(f"no number in the judge's answer {text!r}")
    return float(match.group())


def last_token_values(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[rows]: each row's value at its last response token (0 for an empty response)."""
    lengths = response_mask.long().sum(-1)
    rows = torch.arange(values.shape[0])
    picked = values[rows, (lengths - 1).clamp(min=0)]
    return torch.where(lengths > 0, picked, torch.zeros_like(picked)).float()


class RewardModelWorker(ModelWorker):
    """A scalar reward model: a model of strategy kind "value" (a value head on the LM, as the critic), whose
    value at a response's last token is the response's score. It is frozen: it scores, never trains."""

    def __init__(self, config: StrategyConfig):
        if config.kind != "value":
            raise ValueError(f"a scalar reward model is a value-head model: set reward_model.strategy.kind=value "
                             f"(got {config.kind!r})")
        super().__init__(config)

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: DataProto) -> DataProto:
        values = self.strategy.forward(batch).batch["values"]  # [rows, response_len]
        return DataProto.from_dict({"rm_scores": last_token_values(values, batch.batch["response_mask"])})


def fence(response: str, boundary: str, max_chars: int) -> str:
    """The response as the judge sees it: its first `max_chars` characters between two lines that hold `boundary`
    (random per call, so the policy cannot write the closing line and address the judge past it)."""
    cut = response[:max_chars] + (" [cut]" if len(response) > max_chars else "")
    return f"<response {boundary}>\n{cut}\n</response {boundary}>"


class JudgeWorker(ModelWorker):
    """A generative reward model: each response, cut to `max_response_chars` and fenced (`fence`) with a random
    boundary per call, is put into `template` (`{prompt}`, `{response}` and, where the batch has it,
    `{ground_truth}`), the judge answers greedily (at most `max_new_tokens`), and `parse_fn` (an import path;
    `fn(text) -> float`) turns its answer into the score. An answer the function cannot parse (it raises), or whose
    number lies outside [min_score, max_score] (the range the template asks for), scores 0 and is counted
    (`reward_model/num_unparsed`, the out-of-range ones also in `reward_model/judge/num_out_of_range`)."""

    def __init__(self, config: StrategyConfig, template: str, parse_fn: str, max_new_tokens: int,
                 min_score: float = 0.0, max_score: float = 1.0, max_response_chars: int = 8000):
        if config.kind != "causal_lm":
            raise ValueError(f"a generative judge is a causal LM: set reward_model.strategy.kind=causal_lm "
                             f"(got {config.kind!r})")
        super().__init__(config)
        self.template, self.parse = template, import_object(parse_fn)
        self.max_new_tokens = max_new_tokens
        self.min_score, self.max_score, self.max_response_chars = min_score, max_score, max_response_chars
        self.tokenizer = self.strategy.tokenizer

    def render(self, batch: DataProto) -> list[str]:
        responses = self.tokenizer.batch_decode(batch.batch["responses"] * batch.batch["response_mask"].long(),
                                                skip_special_tokens=True)
        prompts = batch.non_tensor_batch["prompt"]
        truths = batch.non_tensor_batch.get("ground_truth", [None] * len(batch))
        boundary = secrets.token_hex(8)
        return [self.template.format(prompt=p, response=fence(r, boundary, self.max_response_chars), ground_truth=t)
                for p, r, t in zip(prompts, responses, truths)]

    def parse_score(self, answer: str) -> tuple[float, str | None]:
        """(score, None) for an answer that parses to a number in [min_score, max_score]; else (0.0, why not:
        "unparsed" or "out_of_range")."""
        try:
            value = float(self.parse(answer))
        except Exception:  # the judge's text, not the run, is at fault: 0 and counted
            return 0.0, "unparsed"
        if not math.isfinite(value):
            return 0.0, "unparsed"
        if not self.min_score <= value <= self.max_score:
            return 0.0, "out_of_range"
        return value, None

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: DataProto) -> DataProto:
        texts = self.render(batch)
        self.tokenizer.padding_side = "left"
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompts = DataProto.from_dict({"input_ids": encoded["input_ids"].long(),
                                       "attention_mask": encoded["attention_mask"].long()})
        out = self.strategy.generate(prompts, SamplingParams(temperature=0.0, n=1, max_new_tokens=self.max_new_tokens))
        answers = self.tokenizer.batch_decode(out.batch["responses"] * out.batch["response_mask"].long(),
                                              skip_special_tokens=True)
        scores, problems = zip(*map(self.parse_score, answers)) if answers else ((), ())
        result = DataProto.from_dict({"rm_scores": torch.tensor(scores, dtype=torch.float32)},
                                     {"judge_answer": np.array(answers, dtype=object)})
        # counts only: the metrics of the judge's workers are summed (the scores' mean is reward_model/score/mean)
        unparsed = sum(problem is not None for problem in problems)
        result.meta_info["metrics"] = {"reward_model/num_unparsed": unparsed,
                                       "reward_model/judge/num_unparsed": unparsed,
                                       "reward_model/judge/num_out_of_range": problems.count("out_of_range")}
        return result


__all__ = ["JudgeWorker", "RewardModelWorker", "fence", "first_number", "last_token_values"]
