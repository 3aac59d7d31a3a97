"""Multi-turn trajectories on the rollout system: a custom generate function (slime's contract) that plays one
episode of an environment per sample, and the reward function that hands the episode's reward to training.

A trajectory is one token sequence after the prompt (the environment's first observation): the model's turn, the
environment's answer, the model's next turn, ... Each turn is one engine request whose prompt is the whole
conversation so far (with the sample's conversation as its affinity key, so it stays on one engine's prefix
cache) and which stops at a newline or eos. The loss mask is 1 on the model's tokens and 0 on every environment
token (whose log-probs are 0.0 and weight versions -1). The episode ends when the environment says done
(COMPLETED), at `max_turns`, or when the sequence reaches `max_tokens` (TRUNCATED). Its reward is the sum of the
turns' rewards; `turns` and `success` (the environment ended the episode with a positive reward) ride along.
An environment that raises, hangs past `env_timeout_s` or dies marks its sample FAILED: the rollout drops it
(`rollout/num_dropped/failed_samples`) and keeps the rest of its group.

An aborted episode (the async producer stopping for a checkpoint, say) ends the turn it was in. With
`rollout_system.partial_rollout` and an environment that can save its state (`state_dict`), the sample keeps the
turns played (tokens, log-probs, versions) and, in its metadata's `partial_state`, their rewards and the
environment's state: drawn again, after a resume too, the episode continues from its next turn, the aborted one
played again with the same seed. Otherwise it is played again from the start.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any

from baton.agentic.env import ENVIRONMENTS
from baton.agentic.pool import EnvError
from baton.config import ConfigError
from baton.config.registry import check_call
from baton.engines.protocol import GenerationRequest
from baton.rollout.sample import Sample, Status
from baton.strategy import SamplingParams

_episodes = itertools.count()


@dataclass
class AgenticSettings:
    """The environment and the limits of a trajectory.

    env / env_kwargs: the environment (a name in `baton.agentic.env.ENVIRONMENTS`, or the import path of a factory,
    "package.module:Class") and its arguments. max_turns: model turns per episode at most. max_tokens_per_turn: one
    turn's tokens at most. max_tokens: the whole trajectory's tokens (model and environment) at most. env_timeout_s:
    one environment call at most (then the sample fails). num_env_processes / episodes_per_env_process: the
    processes the environments run in, and the episodes each holds at once (the episodes in flight are bounded by
    their product). num_train_episodes / num_val_episodes: the episodes (environment seeds 0.. and 1_000_000..) that
    make the training prompts and the held-out set.

    agent / agent_kwargs: an agent program ("package.module:function", see `baton.agentic.agent`) that plays each
    episode through the OpenAI-compatible endpoint instead of baton's turn loop; the environment then only makes
    the episodes' rows (its first observation as the prompt, the seed as `env_seed`). agent_timeout_s: one
    episode of the program at most. tool_call_parser: how replies' tool calls are read ("hermes", "json", or
    null: none). endpoint_host / endpoint_port / endpoint_token: where the endpoint listens (port 0: a free one);
    a host other than loopback needs a token, which clients send as their API key.
    """

    env: str = "guess_number"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_tokens_per_turn: int = 6
    max_tokens: int = 64
    env_timeout_s: float = 10.0
    num_env_processes: int = 2
    episodes_per_env_process: int = 64
    num_train_episodes: int = 2000
    num_val_episodes: int = 100
    agent: str | None = None
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    agent_timeout_s: float = 300.0
    tool_call_parser: str | None = None
    endpoint_host: str = "127.0.0.1"
    endpoint_port: int = 0
    endpoint_token: str | None = None

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_tokens", "num_env_processes", "episodes_per_env_process",
                     "num_train_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"agentic.{name}={getattr(self, name)} must be >= 1")
        if self.num_val_episodes < 0:
            raise ValueError(f"agentic.num_val_episodes={self.num_val_episodes} must be >= 0")
        if self.env_timeout_s <= 0 or self.agent_timeout_s <= 0:
            raise ValueError(f"agentic.env_timeout_s={self.env_timeout_s} and agent_timeout_s={self.agent_timeout_s} "
                             "must be > 0")
        if self.agent is not None:
            from baton.agentic.endpoint import check_settings
            from baton.config import import_object

            check_call(import_object(self.agent), f"agentic.agent {self.agent!r}",
                       "fn(base_url, task, seed, **agentic.agent_kwargs)", "", {}, 0, **self.agent_kwargs)
            check_settings(self.tool_call_parser, self.endpoint_host, self.endpoint_token)
        # A bad name or import path, or a factory or methods whose signatures do not fit, fail when the config is read.
        check_env(ENVIRONMENTS.get(self.env, key="agentic.env"), f"agentic.env {self.env!r}", self.env_kwargs)


def check_env(factory, key: str, env_kwargs: dict) -> None:
    """ConfigError unless `factory` takes `env_kwargs` and, where it is a class, has `reset(seed)` and `step(action)`
    methods that take those arguments; read from the signatures (a factory function's product is known only once it
    is called, so only its own parameters are checked)."""
    check_call(factory, key, "factory(**agentic.env_kwargs)", **env_kwargs)
    if not isinstance(factory, type):
        return
    for method, contract, args in (("reset", "reset(seed)", (0,)), ("step", "step(action)", ("",))):
        raw = inspect.getattr_static(factory, method, None)
        if raw is None or not callable(getattr(factory, method)):
            raise ConfigError(f"{key}: {factory.__qualname__} has no {method}() method; an environment has "
                              "reset(seed) -> observation and step(action) -> (observation, reward, done, info)")
        unbound = not isinstance(raw, (staticmethod, classmethod))
        check_call(getattr(factory, method), key, contract,
                   *((None,) if unbound else ()), *args)


VAL_SEED_OFFSET = 1_000_000


def episode_rows(settings: AgenticSettings, seeds) -> list[dict[str, Any]]:
    """Prompt rows, one per environment seed: the episode's first observation as the prompt, the seed in
    `env_seed` (the generate function resets the environment with it)."""
    env = ENVIRONMENTS.get(settings.env)(**settings.env_kwargs)
    return [{"prompt": env.reset(seed), "env_seed": int(seed)} for seed in seeds]


def newline_id(tokenizer) -> int:
    """The token that ends a model's turn: a newline, which must be one token of its own."""
    ids = tokenizer("\n", add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"the tokenizer encodes a newline as {ids}, not one token; a turn ends at a newline token")
    return ids[0]


async def generate_trajectory(args, sample: Sample, params: SamplingParams) -> Sample:
    """One episode for `sample` (see the module docstring); `args.extras` holds the pipeline's `agentic`
    settings and `env_pool`."""
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):  # played already (a surplus group put back)
        return sample
    settings: AgenticSettings = args.extras["agentic"]
    pool = args.extras["env_pool"]
    tokenizer = args.tokenizer
    stop = (newline_id(tokenizer), tokenizer.eos_token_id)
    key = f"g{sample.group_index}-s{sample.sample_index}-e{next(_episodes)}"
    saved = sample.metadata.get("partial_state")  # the turns of an episode cut short, and its environment's state
    ids, log_probs, versions = list(sample.response_ids), list(sample.rollout_log_probs), list(sample.weight_versions)
    mask = sample.effective_loss_mask()
    rewards: list[float] = list(saved["rewards"]) if saved else []
    if not saved and ids:
        raise ValueError(f"{sample.where()}: a partial trajectory without its partial_state; reset the sample "
                         "(baton.rollout.functions.reset_sample) to play the episode again")
    done = False
    try:
        await pool.reset(key, sample.metadata["env_seed"], saved["env_state"] if saved else None)
        while not done and len(rewards) < settings.max_turns and len(ids) < settings.max_tokens:
            turn = len(rewards)
            seed = None if sample.seed is None else (sample.seed + turn) % (1 << 62)
            turn_params = dataclasses.replace(params, n=1, seed=seed, stop_token_ids=stop,
                                              max_new_tokens=min(settings.max_tokens_per_turn,
                                                                 settings.max_tokens - len(ids)))
            request = GenerationRequest(args.request_id(sample), tuple(sample.prompt_ids) + tuple(ids), turn_params)
            result = await args.generate_request(request, affinity_key=key)
            if result.finish_reason == "abort":  # the turns so far kept, the aborted one left out
                state = await pool.state(key) if args.config.partial_rollout and rewards else None
                if state is not None:
                    sample.response_ids, sample.loss_mask = ids, mask
                    sample.rollout_log_probs, sample.weight_versions = log_probs, versions
                    sample.response = tokenizer.decode(ids, skip_special_tokens=True)
                    sample.metadata["partial_state"] = {"rewards": rewards, "env_state": state}
                sample.status = Status.ABORTED
                return sample
            ids += result.response_ids
            mask += [1] * len(result.response_ids)
            log_probs += result.log_probs
            versions += result.weight_versions
            action = tokenizer.decode(result.response_ids, skip_special_tokens=True)
            observation, reward, done, _ = await pool.step(key, action)
            rewards.append(float(reward))
            if not done:
                observed = tokenizer(observation, add_special_tokens=False)["input_ids"][:settings.max_tokens - len(ids)]
                ids += observed
                mask += [0] * len(observed)
                log_probs += [0.0] * len(observed)
                versions += [-1] * len(observed)
    except EnvError as error:
        sample.status = Status.FAILED
        sample.metadata["env_error"] = str(error).splitlines()[0]
        return sample
    finally:
        await pool.close(key)
    total = float(sum(rewards))
    sample.metadata.pop("partial_state", None)
    sample.response_ids, sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = ids, mask, log_probs, versions
    sample.response = tokenizer.decode(ids, skip_special_tokens=True)
    sample.status = Status.COMPLETED if done else Status.TRUNCATED
    sample.metadata["trajectory_reward"] = {"score": total, "turns": float(len(rewards)),
                                            "success": float(done and total > 0)}
    return sample


def trajectory_reward(args, sample: Sample) -> dict[str, float]:
    """The episode's reward, as `generate_trajectory` (or an agent program) recorded it."""
    if "trajectory_reward" not in sample.metadata:
        raise ValueError(f"{sample.where()} has no trajectory reward: the trajectory_reward function scores episodes "
                         "of the agentic generate functions; set rollout_system.reward_function for others")
    return dict(sample.metadata["trajectory_reward"])


__all__ = ["AgenticSettings", "VAL_SEED_OFFSET", "episode_rows", "generate_trajectory", "trajectory_reward"]
