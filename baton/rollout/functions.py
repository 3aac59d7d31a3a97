"""The shipped rollout functions (slime's contract: `fn(args, rollout_id, data_source, evaluation=False) ->
list[list[Sample]]`, `args` a `RolloutContext`) and the pieces they are made of, for custom ones to reuse:
one sample's generation, one group's generation and reward, the dynamic filter.

`generate_rollout` is DAPO's over-sampling with dynamic filtering: it starts `over_sampling_factor` times the
groups the step needs, keeps those that pass the filter until it has enough, then aborts the rest (bounded by
`abort_timeout_s`) and puts them back in the buffer: with partial rollouts they keep what they generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections import Counter

from baton.engines.protocol import GenerationRequest
from baton.rollout.reward import RewardTimeout
from baton.rollout.sample import TRAINABLE, Sample, Status
from baton.strategy import SamplingParams
from baton.tracking import trace

_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class RolloutStalledError(TimeoutError):
    """No group finished within the watchdog's time: the message names the silent engines and the stage."""


async def generate_sample(args, sample: Sample, params: SamplingParams) -> Sample:
    """One engine request for `sample` (seeded by `sample.seed`), continued from its partial response if it has one:
    the engine bounds the whole response by `params.max_new_tokens`. Sets the response, its log-probs, versions and
    status; with `mask_stale_partial_tokens` the tokens made before this resume get loss mask 0. With
    `max_new_tokens_per_rollout` (training rollouts only) the request stops after that many new tokens, and a
    response not finished by then is ABORTED there, to continue in a later rollout."""
    if sample.status in TRAINABLE:  # generated already (a surplus group put back into the buffer)
        return sample
    prefix = len(sample.response_ids)
    if prefix >= params.max_new_tokens:
        sample.status = Status.TRUNCATED
        return sample
    chunk = None if getattr(args, "evaluation", False) else args.config.max_new_tokens_per_rollout
    cut = chunk is not None and prefix + chunk < params.max_new_tokens
    request = GenerationRequest(args.request_id(sample), sample.prompt_ids,
                                dataclasses.replace(params, n=1, seed=sample.seed,
                                                    max_new_tokens=prefix + chunk if cut else params.max_new_tokens),
                                sample.response_ids, sample.rollout_log_probs, sample.weight_versions)
    result = await args.generate_request(request)
    mask = sample.loss_mask  # None: all ones
    if prefix and args.config.mask_stale_partial_tokens:
        mask = [0] * prefix
    if mask is not None:
        mask = list(mask) + [1] * (len(result.response_ids) - prefix)
    sample.loss_mask = mask
    sample.response_ids, sample.rollout_log_probs = list(result.response_ids), list(result.log_probs)
    sample.weight_versions = list(result.weight_versions)
    sample.status = Status.ABORTED if cut and result.finish_reason == "length" else _STATUS[result.finish_reason]
    sample.response = args.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    if prefix:
        sample.metadata["num_resumes"] = sample.metadata.get("num_resumes", 0) + 1
    return sample


class GroupFailed(RuntimeError):
    """Every sample of a group failed (e.g. its environment raised or hung): the group is dropped and counted."""


async def generate_group(args, group: list[Sample], params: SamplingParams) -> list[Sample]:
    """Every sample of the group (concurrently), then its reward, unless a sample was aborted (the group is then
    returned unrewarded, to go back to the buffer). A sample whose generation FAILED (a multi-turn episode whose
    environment raised or hung) is taken out of the group and counted (`rollout/num_dropped/failed_samples`);
    a group left with none raises GroupFailed."""
    current = trace.tracer()
    traced = (current is not None and not getattr(args, "evaluation", False) and bool(group)
              and current.traced(group[0].group_index))
    start = time.time()
    await asyncio.gather(*(args.generate(sample, params) for sample in group))
    failed = [sample for sample in group if sample.status == Status.FAILED]
    if failed:
        group[:] = [sample for sample in group if sample.status != Status.FAILED]
        key = "rollout/num_dropped/failed_samples"
        args.metrics[key] = args.metrics.get(key, 0.0) + float(len(failed))
        if not group:
            raise GroupFailed(f"every sample of group {failed[0].group_index} failed: "
                              f"{failed[0].metadata.get('env_error', 'no reason recorded')}")
    if all(sample.status in TRAINABLE for sample in group) and any(s.reward is None for s in group):
        await args.reward(group)
    if traced:
        done = all(sample.status in TRAINABLE for sample in group)
        current.span("driver", "group", start, time.time(), group=group[0].group_index, done=done,
                     samples=[trace.sample_id(s.group_index, s.sample_index) for s in group])
        if done:
            current.group_ready(group[0].group_index)
    return group


def nonzero_reward_std(args, group: list[Sample]) -> tuple[bool, str]:
    """DAPO's dynamic filter: keep a group whose rewards differ (a group of equal rewards teaches GRPO nothing)."""
    scores = [sample.score() for sample in group]
    return (len(scores) > 1 and statistics.pstdev(scores) > 0), "zero_std"


async def generate_rollout_async(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """`args.num_groups_per_step` groups that pass the dynamic filter (see the module docstring). Rollout N is
    trained by step N, at weight version N - 1: the staleness ledger (`args.ledger`) settles each group for it (a
    buffered one staler than the bound allows goes back as a fresh prompt, `rollout/num_dropped/stale`, or has its
    stale tokens withheld, by `rollout_system.stale_policy`). A group with a sample cut at
    `max_new_tokens_per_rollout` goes back to the buffer when the rollout ends (`rollout/num_cut_groups`), and
    another starts in its place; past the limit of groups started, cut groups continue in this rollout until the
    step has its groups. In deterministic mode the groups started together finish together before any other
    starts, and are looked at in data order."""
    config, params = args.config, args.sampling_params
    needed = args.num_groups_per_step
    running: dict[asyncio.Task, list[Sample]] = {}
    kept: list[list[Sample]] = []
    cut: list[list[Sample]] = []  # to continue in a later rollout
    group_of: dict[asyncio.Task, int] = {}
    drops: Counter = Counter()
    wait_for = asyncio.ALL_COMPLETED if config.deterministic else asyncio.FIRST_COMPLETED

    limit = math.ceil(needed * config.max_groups_started_factor)  # DAPO's max_num_gen_batches, in groups
    started = 0

    def run(groups: list[list[Sample]]) -> None:
        for group in groups:
            args.ledger.prepare(group, rollout_id - 1)
            task = asyncio.ensure_future(generate_group(args, group, params))
            running[task], group_of[task] = group, group[0].group_index  # (a group's failed samples leave it)

    def start(count: int) -> None:
        nonlocal started
        groups = data_source.get_samples(max(0, min(count, limit - started)))
        run(groups)
        started += len(groups)

    start(math.ceil(needed * config.over_sampling_factor))
    while len(kept) < needed:
        if len(kept) + len(running) < needed:  # the filter dropped too many: start more
            start(math.ceil((needed - len(kept)) * config.over_sampling_factor) - len(running))
        if not running and cut:  # the limit is reached: the cut groups go on rather than leave the step short
            cut, going_on = cut[needed - len(kept):], cut[:needed - len(kept)]
            run(continued(going_on))
            continue
        if not running:  # the limit is reached: the step trains on what it kept
            if not kept:
                raise RuntimeError(f"rollout {rollout_id}: the dynamic filter dropped all {started} groups started "
                                   f"(rollout_system.max_groups_started_factor={config.max_groups_started_factor}): "
                                   f"{dict(drops)}; raise the factor, or loosen the filter")
            break
        done, _ = await asyncio.wait(running, timeout=config.watchdog_s, return_when=wait_for)
        if not done:
            raise RolloutStalledError(args.describe_stall(f"rollout {rollout_id}: no group finished within "
                                                          f"{config.watchdog_s:g} s (rollout_system.watchdog_s)"))
        for task in sorted(done, key=group_of.pop):
            group = running.pop(task)
            try:
                task.result()
            except RewardTimeout:
                drops["reward_timeout"] += 1
                continue
            except GroupFailed:
                drops["failed_groups"] += 1
                continue
            if not all(sample.status in TRAINABLE for sample in group):  # cut at max_new_tokens_per_rollout
                cut.append(group)
                continue
            if len(kept) >= needed:
                data_source.add_samples([group])  # surplus: finished after the step had enough
                continue
            _, back = args.ledger.settle([group], rollout_id - 1)  # a surplus group of an earlier step, say
            if back:
                data_source.add_samples(back)
                drops["stale"] += 1
                continue
            keep, reason = args.keep(group)
            if keep:
                kept.append(group)
            else:
                drops[reason] += 1
    await abort_groups(args, running, data_source)
    data_source.add_samples(continued(cut))
    if config.max_new_tokens_per_rollout is not None:
        args.metrics["rollout/num_cut_groups"] = float(len(cut))
    args.metrics["rollout/num_groups_started"] = float(started)
    args.metrics.update({f"rollout/num_dropped/{reason}": float(count) for reason, count in drops.items()})
    return kept


async def abort_groups(args, running: dict[asyncio.Task, list[Sample]], data_source) -> None:
    """Abort the groups still running and put them back in the buffer: with partial rollouts as they stand (their
    tokens kept), else as fresh prompts. Waits at most `abort_timeout_s` (a reward still running is given up on)."""
    if not running:
        return
    await args.abort([sample for group in running.values() for sample in group])
    done, pending = await asyncio.wait(running, timeout=args.config.abort_timeout_s)
    for task in pending:
        task.cancel()
    for task, group in running.items():
        if task in done and not task.cancelled() and task.exception() is None and all(
                s.status in TRAINABLE and s.reward is not None for s in group):
            data_source.add_samples([group])  # it finished anyway: surplus
            continue
        for sample in group:
            if sample.status not in TRAINABLE or not args.config.partial_rollout:
                reset_sample(sample, keep_tokens=args.config.partial_rollout)
        data_source.add_samples([group])
    args.metrics["rollout/num_aborted_groups"] = float(len(running))


def continued(groups: list[list[Sample]]) -> list[list[Sample]]:
    """The groups, their unfinished samples made drawable again with their tokens kept."""
    for group in groups:
        for sample in group:
            if sample.status not in TRAINABLE:
                reset_sample(sample, keep_tokens=True)
    return groups


def reset_sample(sample: Sample, keep_tokens: bool) -> None:
    """Make a sample drawable again: PENDING, unrewarded; its partial response kept or dropped (with the state a
    generate function kept to continue it, the metadata's `partial_state`)."""
    sample.status, sample.reward = Status.PENDING, None
    if not keep_tokens:
        sample.response, sample.response_ids, sample.loss_mask = "", [], None
        sample.rollout_log_probs, sample.weight_versions = [], []
        sample.metadata.pop("partial_state", None)


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """The default rollout function (slime's contract), run on the engine pool's event loop."""
    return args.run(generate_rollout_async(args, rollout_id, data_source, evaluation))


async def eval_rollout_async(args, rollout_id: int, data_sources: dict, evaluation: bool = True) -> dict:
    """Every prompt of every eval set (`data_sources`: name -> its data source), generated and rewarded."""
    out = {}
    for name, source in data_sources.items():
        groups = source.get_samples(len(source.dataset))
        results = await asyncio.gather(*(generate_group(args, group, args.sampling_params) for group in groups),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, GroupFailed):
                raise result
        out[name] = [group for group, result in zip(groups, results) if not isinstance(result, GroupFailed)]
    return out


def eval_rollout(args, rollout_id: int, data_sources: dict, evaluation: bool = True) -> dict:
    """The default eval function: {name: groups} of every eval set, on the engine pool's event loop."""
    return args.run(eval_rollout_async(args, rollout_id, data_sources, evaluation))


def sft_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """SFT through the rollout machinery (slime's `sft_rollout`): no generation; each prompt's sample is its dataset
    response (the sample's metadata field `args.response_key`, else its label), tokenized with an eos after it,
    rewarded 1. Train it with the SFT loss (`loss: sft`)."""
    groups = data_source.get_samples(args.num_groups_per_step)
    eos = args.tokenizer.eos_token_id
    for group in groups:
        for sample in group:
            response = sample.metadata.get(args.response_key, sample.label)
            if response is None or isinstance(response, (list, tuple)):
                raise ValueError(f"{sample.where()}: sft_rollout needs one response per prompt in the sample's "
                                 f"{args.response_key!r} field (or a label), got {response!r}; set data.response_key")
            ids = args.tokenizer(str(response), add_special_tokens=False)["input_ids"] + [eos]
            sample.response, sample.response_ids, sample.loss_mask = str(response), ids, None
            sample.rollout_log_probs, sample.weight_versions = [0.0] * len(ids), [args.weight_version] * len(ids)
            sample.status, sample.reward = Status.COMPLETED, 1.0
    return groups


__all__ = ["GroupFailed", "RolloutStalledError", "abort_groups", "continued", "eval_rollout", "eval_rollout_async",
           "generate_group", "generate_rollout", "generate_rollout_async", "generate_sample", "nonzero_reward_std",
           "reset_sample", "sft_rollout"]

