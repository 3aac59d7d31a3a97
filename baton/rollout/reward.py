"""Rewarding a group of samples in the rollout system: the pipeline's `reward_fn` (the reward registry's convention,
scored by `score_rows`, in processes of their own whenever a time limit applies, so that a row holding the
interpreter cannot freeze the driver) or a custom per-sample function by import path (slime's `custom_rm_path`).
Scoring runs off the event loop, so a slow reward never holds generation; a group is waited on at most `timeout_s`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from typing import Any, Callable, Mapping

from baton.rewards import PRED, RewardError, RewardRoutes, overlong_penalty, score_rows, scoring_pool
from baton.rollout.sample import Sample


def in_thread(fn: Callable, *args) -> asyncio.Future:
    """`fn(*args)` in a daemon thread of its own, awaited on the running loop. One thread per call: a reward that
    hangs holds only its own thread (given up on by the timeouts, it cannot starve the others of a pool's)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value=None, error: BaseException | None = None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as error:  # the user's function: handed to the awaiting task
            outcome = (None, error)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for it any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="rollout-reward", daemon=True).start()
    return future


class RewardTimeout(TimeoutError):
    """A group's reward took longer than the rollout system's reward_timeout_s."""


class GroupRewarder:
    """Sets `sample.reward` on every sample of a group.

    reward_fn: a reward registry name or import path, or {data_source: reward} (see `baton.rewards.RewardRoutes`),
        called as the reward worker calls it: `fn(response, label, prompt=..., **metadata, **reward_kwargs)`; a
        number, or a dict with "score" and further numeric fields (and "pred"), which the sample keeps as its
        reward dict. reward_kwargs: its settings (the config's); no metadata field may name one.
    custom: `fn(args, sample) -> float | dict`, plain or a coroutine function, instead of reward_fn; run in a thread
        of this process (the user's own code, trusted to return).
    num_processes / timeout_s_per_row: reward_fn scored in that many processes, a row past the limit killed and
        handled by `on_error` (as the reward workers do). Without them, reward_fn is scored in one process of its
        own whenever a limit applies (`baton.rewards.scoring_pool`): a slow reward's default, or else `timeout_s`
        per row, a row past it scored 0 and counted; with no limit at all, in a thread of this process.
    overlong: (max_response_len, buffer_len, penalty_factor): DAPO's soft overlong penalty added to the score of
        training samples (not of a context with `evaluation` set), with verl's `overlong_reward` and `overlong`
        fields, as the reward workers add it (`overlong_buffer`); None: none.
    """

    def __init__(self, reward_fn: str | Mapping[str, str], *, on_error: str = "raise", num_processes: int = 0,
                 timeout_s_per_row: float | None = None, custom: Callable | None = None,
                 timeout_s: float | None = 60.0, overlong: tuple[int, int, float] | None = None,
                 reward_kwargs: Mapping[str, Any] | None = None):
        self.on_error, self.custom, self.timeout_s = on_error, custom, timeout_s
        self.routes = RewardRoutes(reward_fn, reward_kwargs)
        self.overlong = overlong
        self.pool = (scoring_pool(self.routes, num_processes, timeout_s_per_row, fallback_timeout_s=timeout_s)
                     if custom is None else None)
        self._pool_lock = threading.Lock()  # the scoring pool serves one group at a time
        self.num_errors = self.num_timeouts = 0  # rows scored 0 by reward_on_error "zero", timeouts among them
        self._reported = (0, 0)  # (num_errors, num_timeouts) already reported, or left out (`uncounted`)

    async def __call__(self, args: Any, group: list[Sample]) -> None:
        try:
            await asyncio.wait_for(self._score(args, group), self.timeout_s)
        except asyncio.TimeoutError:
            raise RewardTimeout(f"the reward of group {group[0].group_index} took longer than {self.timeout_s:g} s "
                                "(rollout_system.reward_timeout_s)") from None
        if self.overlong is not None and not getattr(args, "evaluation", False):
            add_overlong_penalty(group, *self.overlong)

    async def _score(self, args: Any, group: list[Sample]) -> None:
        if self.custom is not None:
            for sample in group:
                if inspect.iscoroutinefunction(self.custom):
                    sample.reward = await self.custom(args, sample)
                else:
                    sample.reward = await in_thread(self.custom, args, sample)
            return
        result = await in_thread(self._score_rows, group)
        self.num_errors += result.num_errors
        self.num_timeouts += result.num_timeouts
        for row, sample in enumerate(group):
            extras = {key: values[row] for key, values in result.extras.items()}
            if result.preds is not None:
                extras[PRED] = result.preds[row]
            sample.reward = {"score": result.scores[row], **extras} if extras else result.scores[row]

    def _score_rows(self, group: list[Sample]):
        keys = set.intersection(*(set(s.metadata) for s in group)) - {"prompt"}
        columns = {"prompt": [s.prompt for s in group], **{k: [s.metadata[k] for s in group] for k in sorted(keys)}}
        with self._pool_lock if self.pool is not None else contextlib.nullcontext():
            return score_rows(self.routes, [s.response for s in group], [s.label for s in group], columns,
                              self.on_error, self.pool)

    @contextlib.contextmanager
    def uncounted(self):
        """The reward errors of rows scored in the block (held-out sets, baselines) are left out of `error_metrics`;
        the list it yields holds their (num_errors, num_timeouts) once the block ends."""
        errors, timeouts = self.num_errors, self.num_timeouts
        counted: list[int] = []
        yield counted
        counted += [self.num_errors - errors, self.num_timeouts - timeouts]
        self._reported = (self._reported[0] + counted[0], self._reported[1] + counted[1])

    def error_metrics(self) -> dict[str, float]:
        """`reward/num_errors` and `reward/num_timeouts` of the training rows scored since the last call (as the
        loop counts a step's): rows the reward function raised on or ran past its time limit on, scored 0."""
        errors, timeouts = self.num_errors, self.num_timeouts
        reported, self._reported = self._reported, (errors, timeouts)
        return {"reward/num_errors": float(errors - reported[0]), "reward/num_timeouts": float(timeouts - reported[1])}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def add_overlong_penalty(group: list[Sample], max_response_len: int, buffer_len: int, penalty_factor: float) -> None:
    """DAPO's soft overlong penalty (`baton.rewards.overlong_penalty`) added to each sample's score, kept as the
    reward fields `overlong_reward` (the penalty) and `overlong` (1.0 where it is below 0), verl's names."""
    import torch

    lengths = torch.tensor([sample.response_length for sample in group])
    penalties = overlong_penalty(lengths, max_response_len, buffer_len, penalty_factor).tolist()
    for sample, penalty in zip(group, penalties):
        reward = dict(sample.reward) if isinstance(sample.reward, dict) else {"score": sample.reward}
        taken = sorted({"overlong_reward", "overlong"} & reward.keys())
        if taken:
            raise RewardError(f"{sample.where()}: the reward returns the field(s) {taken}, which the overlong "
                              "penalty (overlong_buffer) writes; rename them")
        reward.update(score=sample.score() + penalty, overlong_reward=penalty, overlong=float(penalty < 0))
        sample.reward = reward
