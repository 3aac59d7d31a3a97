"""The batch `generate(DataProto)` of the pipelines over any `Engine`: one request per sample, all in flight at once
so that the engine batches them continuously, gathered in row order into the generate() layout
(`baton.strategy.base`) by the same `generation_output` as the `hf` strategy's batch path."""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from baton.data import DataProto
from baton.engines.loop import LoopThread
from baton.engines.protocol import Engine, GenerationRequest, GenerationResult
from baton.strategy.base import SamplingParams
from baton.strategy.sampling import generation_output, padded_responses, prompt_row_seeds


def generate_batch(engine: Engine, runner: LoopThread, prompts: DataProto, params: SamplingParams, *,
                   generator: torch.Generator, pad_token_id: int, call_id: str) -> DataProto:
    """`params.n` samples per prompt of a left-padded prompt batch (a prompt's samples in consecutive rows), from
    `engine`, whose event loop `runner` runs; waits without a time limit (a worker call is bounded by the caller).

    Row k is request `f"{call_id}-{k}"`, seeded by `prompt_row_seeds` (the prompts' `sample_seeds`, else draws of
    `params.seed`'s generator or of `generator`, which advances): on CPU, the seeds the `hf` strategy's batch path
    gives its rows, so over the `hf` engine this returns that path's output. Raises RuntimeError when the engine aborted a request (it
    was closed under the call).
    """
    input_ids, attention_mask = prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].cpu()
    if len(prompts) and bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("generate needs LEFT-padded prompts (the last column must be real tokens); "
                         "tokenize with padding_side='left'")
    seeds = prompt_row_seeds(prompts, params, generator)
    requests = [
        GenerationRequest(f"{call_id}-{row}", input_ids[row // params.n][attention_mask[row // params.n].bool()].tolist(),
                          dataclasses.replace(params, n=1, seed=seed))
        for row, seed in enumerate(seeds)
    ]
    results = runner.run(_generate_all(engine, requests), timeout_s=None)
    if any(result.finish_reason == "abort" for result in results):
        raise RuntimeError("the engine aborted requests of a generate call (was it closed?)")
    out = padded_responses([r.response_ids for r in results], [r.log_probs for r in results],
                           [r.finish_reason == "stop" for r in results], pad_token_id)
    return generation_output(prompts, params, **out)


async def _generate_all(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return await asyncio.gather(*(engine.generate(request) for request in requests))
