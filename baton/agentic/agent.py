"""Agent programs: any function that plays one episode by calling an OpenAI-compatible endpoint, trained through
`AgentEndpoint` (`agentic.agent: "package.module:function"`).

The contract: `fn(base_url, task, seed, **agent_kwargs) -> reward`, where `base_url` is the endpoint's address for
this episode (give it to `openai.OpenAI(base_url=base_url, api_key=...)`), `task` the episode's row (its `prompt`
and the row's other fields, `env_seed` among them) and `seed` the episode's seed. It returns the episode's reward:
a number, or a dict with a numeric "reward" and further numbers (logged as `reward_extra/<key>`). It needs nothing
from baton.

The function runs in the environment processes (`EnvPool`), one thread per episode, bounded by
`agent_timeout_s`: one that raises, hangs or kills its process costs its own episode (FAILED, dropped and
counted), not the step. `generate_agent_episode` is the generate function (slime's contract) that opens the
episode's session, runs the program, and makes the sample from the session's recorded tokens: the prompt of the
sequence the episode ended on, then every reply (loss mask 1) and what came between them (loss mask 0). An
episode aborted (the rollout stopping) is played again from the start when drawn again: a program's state cannot
be saved.
"""

from __future__ import annotations

import itertools
import math

from baton.agentic.pool import EnvError
from baton.config import import_object
from baton.rollout.functions import reset_sample
from baton.rollout.sample import TRAINABLE, Sample, Status
from baton.strategy import SamplingParams

_episodes = itertools.count()


class AgentProgram:
    """The environment-process side: an "environment" whose one call, `run`, plays a whole episode with the agent
    program. `agent`: its import path; `agent_kwargs`: passed to it."""

    def __init__(self, agent: str, agent_kwargs: dict | None = None):
        self.fn, self.kwargs = import_object(agent), dict(agent_kwargs or {})
        self.agent = agent

    def reset(self, seed: int) -> str:
        return ""

    def step(self, action: str):
        raise RuntimeError("an agent program plays its episode in run(), not step by step")

    def run(self, base_url: str, task: dict, seed: int | None) -> dict[str, float]:
        return episode_reward(self.fn(base_url, task, seed, **self.kwargs), self.agent)


def episode_reward(value, agent: str) -> dict[str, float]:
    """The program's return value as {"reward", ...}: finite numbers only."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = {"reward": value}
    if not isinstance(value, dict) or "reward" not in value:
        raise TypeError(f"agent {agent} returned {type(value).__name__}; return the episode's reward, a number or a "
                        "dict with a numeric 'reward'")
    out = {}
    for key, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise TypeError(f"agent {agent} returned {key}={number!r}; every value must be a finite number")
        out[str(key)] = float(number)
    return out


def task_row(sample: Sample) -> dict:
    """What the program is given of the episode's row: the prompt and the row's other fields."""
    return {"prompt": sample.prompt, **{k: v for k, v in sample.metadata.items() if k not in _OWN_METADATA}}


_OWN_METADATA = {"partial_state", "trajectory_reward", "env_error", "num_resumes"}


async def generate_agent_episode(args, sample: Sample, params: SamplingParams) -> Sample:
    """One episode of the agent program for `sample` (see the module docstring); `args.extras` holds the pipeline's
    `agentic` settings, `env_pool` (running `AgentProgram`s) and `endpoint`."""
    if sample.status in TRAINABLE:  # played already (a surplus group put back)
        return sample
    settings, pool, endpoint = args.extras["agentic"], args.extras["env_pool"], args.extras["endpoint"]
    key = f"g{sample.group_index}-s{sample.sample_index}-a{next(_episodes)}"
    session = endpoint.open(key, sample, args, params, settings.max_turns, settings.max_tokens,
                            settings.max_tokens_per_turn)
    failure = None
    try:
        await pool.reset(key, int(sample.metadata.get("env_seed", 0)))
        reward = await pool.run(key, (endpoint.base_url(key), task_row(sample), sample.seed),
                                settings.agent_timeout_s)
    except EnvError as error:
        failure = str(error).splitlines()[0]
    finally:
        await pool.close(key)
        endpoint.close(key)
    if session.aborted:  # nothing of it is kept: it is played again from the start
        reset_sample(sample, keep_tokens=False)
        sample.status = Status.ABORTED
        return sample
    if failure is None and not session.calls:
        failure = f"agent {settings.agent} made no request to the endpoint"
    if failure is not None:
        sample.status = Status.FAILED
        sample.metadata["env_error"] = failure
        return sample
    ids = session.ids
    sample.prompt_ids, sample.prompt = ids[:session.prompt_len], args.tokenizer.decode(ids[:session.prompt_len])
    sample.response_ids, sample.loss_mask = ids[session.prompt_len:], session.mask
    sample.rollout_log_probs, sample.weight_versions = session.log_probs, session.versions
    sample.response = args.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    sample.status = Status.TRUNCATED if session.truncated else Status.COMPLETED
    sample.metadata["trajectory_reward"] = {
        "score": reward.pop("reward"), "turns": float(session.calls), "success": float(reward.get("success", 0.0)),
        "tool_call_parse_errors": float(session.tool_call_parse_errors),
        "chain_resets": float(session.chain_resets), **{k: v for k, v in reward.items() if k != "success"}}
    return sample


__all__ = ["AgentProgram", "episode_reward", "generate_agent_episode", "task_row"]
