"""`RolloutSystemConfig`: how the rollout system generates a step's samples and how far generation runs ahead of
training (`mode`). Its functions are each a name in that plug-in's registry or an import path
("package.module:function"), resolved when the config is built, before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from baton.config.registry import Registry, check_call

MODES = ("sync", "one_step_off", "async")
STALE_POLICIES = ("drop", "withhold", "pace")  # see baton.rollout.staleness

# The registry of each plug-in setting; the shipped functions are named by import path (imported on first use).
ROLLOUT_FUNCTIONS = Registry("rollout function", {"generate_rollout": "baton.rollout.functions:generate_rollout",
                                                  "sft_rollout": "baton.rollout.functions:sft_rollout"})
GENERATE_FUNCTIONS = Registry("generate function", {
    "generate_sample": "baton.rollout.functions:generate_sample",
    "generate_trajectory": "baton.agentic.rollout:generate_trajectory",
    "agent_episode": "baton.agentic.agent:generate_agent_episode"})
REWARD_FUNCTIONS = Registry("rollout reward function", {"trajectory_reward": "baton.agentic.rollout:trajectory_reward"})
EVAL_FUNCTIONS = Registry("eval function", {"eval_rollout": "baton.rollout.functions:eval_rollout"})
DYNAMIC_FILTERS = Registry("dynamic filter", {"nonzero_reward_std": "baton.rollout.functions:nonzero_reward_std"})
BUFFER_FILTERS = Registry("buffer filter", {"take_first": "baton.rollout.data_source:take_first"})
PLUGINS = {"rollout_function": ROLLOUT_FUNCTIONS, "generate_function": GENERATE_FUNCTIONS,
           "reward_function": REWARD_FUNCTIONS, "eval_function": EVAL_FUNCTIONS, "dynamic_filter": DYNAMIC_FILTERS,
           "buffer_filter": BUFFER_FILTERS}
# How the rollout system calls each plug-in: (the contract, for messages; the arguments, as placeholders), checked
# against the function's signature when the config is built.
PLUGIN_CALLS = {
    "rollout_function": ("fn(args, rollout_id, data_source, evaluation)", (None, 0, None, False), {}),
    "generate_function": ("fn(args, sample, params)", (None, None, None), {}),
    "reward_function": ("fn(args, sample)", (None, None), {}),
    "eval_function": ("fn(args, rollout_id, data_sources, evaluation)", (None, 0, None, True), {}),
    "dynamic_filter": ("fn(args, group)", (None, None), {}),
    "buffer_filter": ("fn(buffer, num_groups)", (None, 0), {}),
}


@dataclass
class RolloutSystemConfig:
    """The rollout system's settings (`rollout_system:` in an RLVR config run by `RolloutRLVRPipeline`).

    Each function below is a name in its registry (`PLUGINS`) or an import path "package.module:function".

    mode: "sync" generates step N's samples, then trains on them; "one_step_off" generates step N+1's while step N
        trains (its tokens are at most one version old); "async" generates continuously, admitting a prompt group
        only while the samples ahead of it keep it within `max_staleness`.
    max_staleness: the most policy versions between the weights that sampled a trained token and the weights that
        train on it (the definition and its enforcement: `baton.rollout.staleness`); async mode admits a group only
        within it.
    stale_policy: what becomes of a group that would break the bound: "drop" (its prompt goes back to the buffer,
        `rollout/num_dropped/stale`), "withhold" (it trains with its stale tokens out of the loss, its rewards kept
        in the group's baseline) or "pace" (async steps take their groups in the order they were admitted, so none
        goes stale, and a partial sample too old to resume restarts).
    deterministic: (one_step_off, async) the same seed gives the same samples, metrics and weights run after run
        (one machine, one thread count), generation still overlapping training: step t's groups are generated
        together, in data order, entirely with the weights of version t - 1 - L (L = 1 in one_step_off,
        max_staleness in async: that many steps' rollouts run ahead of training), and new weights go into the
        engines only once the rollouts that sample with the old ones are done. Timing then decides nothing a step
        trains on; a step waits where generation falls behind instead of training on fresher groups. Over-sampling
        (which keeps the groups that finish first) is refused with it.
    rollout_function: slime's contract, `fn(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]`
        (a coroutine function or a plain one); `args` is a `RolloutContext`.
    generate_function: per sample, `async fn(args, sample, params) -> Sample` (None: one engine request, resumed
        from the sample's partial response). reward_function: `fn(args, sample) -> float | dict` (a coroutine
        function or a plain one; None: the pipeline's `reward_fn` over the decoded response).
    eval_function: `fn(args, rollout_id, data_sources, evaluation=True) -> {name: list[list[Sample]]}`, every eval
        set's rewarded groups (`data_sources`: name -> a `RolloutDataSource` over that set); the evaluator computes
        `eval/{name}/...` from them.
    over_sampling_factor: prompt groups started per group the step needs (DAPO's over-sampling); groups that pass
        `dynamic_filter` (`fn(args, group) -> bool | (bool, reason)`; None keeps every group) are kept until the step
        has enough, and the rest are aborted and go back to the buffer. max_groups_started_factor: at most this many
        groups started per group needed (DAPO's max_num_gen_batches): past it the step trains on the groups it kept
        (`rollout/num_groups` says how many), as a filter that drops nearly every group (a model that solves
        most prompts) would otherwise make a step generate without end.
    partial_rollout: aborted samples keep their tokens, log-probs and versions and continue from there when drawn
        again; off, they go back to the buffer as fresh prompts. mask_stale_partial_tokens: a resumed sample's tokens
        from before its last resume are masked out of the loss. max_new_tokens_per_rollout: (with partial_rollout)
        a sample generates at most this many tokens in one rollout; one not finished by then stops at that token
        boundary and its group goes back to the buffer when the rollout ends, to continue in a later rollout with
        newer weights (the step starts other groups in its place, up to max_groups_started_factor). A long response
        then holds no step, and in deterministic mode weight updates land inside responses at recorded token
        boundaries, so a checkpoint holds partial rollouts. The default generate function honours it (a custom one,
        the agentic one among them, does not). A continued sample's first tokens are a rollout older than the
        rest: deterministic mode needs them out of the loss (mask_stale_partial_tokens) or withheld by the policy.
    buffer_filter: which buffered groups `get_samples` takes (see `RolloutDataSource`).
    abort_timeout_s: the longest an abort waits for engines and reward functions before it gives up on a group
        (the group goes back to the buffer). reward_timeout_s: one group's reward, at most (None: no limit); a
        group past it is dropped (`rollout/num_dropped/reward_timeout`).
    watchdog_s: a step that gets no finished group for this long stops with an error naming the silent engines.
    rollout_timeout_s: one whole rollout (a rollout or eval function's call, or an async step's wait for its groups)
        at most this long, whatever the function does: past it the step stops with the same kind of error.
    save_rollouts: a path template with `{rollout_id}`: every rollout's groups are written there (jsonl).
    load_rollouts: a path template: train on the saved rollouts instead of generating (train-only mode: no engines
        start, and nothing is validated).
    rollout_only: generate (and save) each step's rollout and train nothing (the weights stay as loaded).
    probe_every_syncs: the weight sync's probe (the engines' log-probs on a few fixed rows against the actor's)
        runs on the first sync and then on every N-th; 1 checks every sync. Each check holds the engines' steps for
        one forward pass (scored between two steps). A wrong mapping of weights shows at the first sync.
    """

    mode: str = "sync"
    max_staleness: int = 1
    stale_policy: str = "drop"
    deterministic: bool = False
    rollout_function: str = "generate_rollout"
    generate_function: str | None = None
    reward_function: str | None = None
    eval_function: str = "eval_rollout"
    over_sampling_factor: float = 1.0
    dynamic_filter: str | None = None
    max_groups_started_factor: float = 8.0
    partial_rollout: bool = False
    mask_stale_partial_tokens: bool = False
    max_new_tokens_per_rollout: int | None = None
    buffer_filter: str | None = None
    abort_timeout_s: float = 30.0
    reward_timeout_s: float | None = 60.0
    watchdog_s: float = 600.0
    rollout_timeout_s: float = 3600.0
    save_rollouts: str | None = None
    load_rollouts: str | None = None
    rollout_only: bool = False
    # The router: one poll of an engine waits this long for a result; health checked this often; a request retried
    # on this many further engines when its engine dies.
    poll_s: float = 0.02
    health_interval_s: float = 5.0
    max_retries: int = 2
    max_num_seqs_per_engine: int = 256
    probe_every_syncs: int = 1

    @property
    def lookahead(self) -> int:
        """How many steps' rollouts are prepared ahead of the one training: none in sync mode, one in one_step_off
        and in free-running async (whose producer generates beside it), max_staleness in deterministic async."""
        if self.mode == "sync":
            return 0
        return self.max_staleness if self.mode == "async" and self.deterministic else 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"rollout_system.mode {self.mode!r} is not one of {MODES}")
        if self.max_staleness < 0:
            raise ValueError(f"rollout_system.max_staleness must be >= 0, got {self.max_staleness}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"rollout_system.stale_policy {self.stale_policy!r} is not one of {STALE_POLICIES}")
        if self.mode != "sync" and self.max_staleness < 1:
            raise ValueError(f"rollout_system.mode {self.mode!r} with max_staleness 0 cannot overlap generation and "
                             "training; use mode 'sync', or max_staleness >= 1")
        if self.deterministic and (self.over_sampling_factor > 1.0 or self.dynamic_filter is not None):
            raise ValueError("rollout_system.deterministic: over-sampling and a dynamic filter keep the groups that "
                             "finish first, which timing decides; set over_sampling_factor: 1 and dynamic_filter: "
                             "null, or deterministic: false")
        if self.over_sampling_factor < 1.0:
            raise ValueError(f"rollout_system.over_sampling_factor must be >= 1 (groups started per group needed), "
                             f"got {self.over_sampling_factor}")
        if self.max_groups_started_factor < self.over_sampling_factor:
            raise ValueError(f"rollout_system.max_groups_started_factor={self.max_groups_started_factor} is below "
                             f"over_sampling_factor={self.over_sampling_factor}; raise it (it bounds the groups started "
                             "per step, the first round included)")
        for name in ("abort_timeout_s", "watchdog_s", "rollout_timeout_s", "poll_s", "health_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout_system.{name} must be > 0, got {getattr(self, name)}")
        if self.reward_timeout_s is not None and self.reward_timeout_s <= 0:
            raise ValueError(f"rollout_system.reward_timeout_s must be > 0 (or null: no limit), got "
                             f"{self.reward_timeout_s}")
        for name in ("save_rollouts", "load_rollouts"):
            template = getattr(self, name)
            if template is not None and "{rollout_id}" not in template:
                raise ValueError(f"rollout_system.{name} {template!r} must contain '{{rollout_id}}' (e.g. "
                                 "runs/x/rollouts/{rollout_id}.jsonl)")
        if self.probe_every_syncs < 1:
            raise ValueError(f"rollout_system.probe_every_syncs must be >= 1 (1: every sync), got "
                             f"{self.probe_every_syncs}")
        if self.rollout_only and self.load_rollouts is not None:
            raise ValueError("rollout_system.rollout_only with load_rollouts would neither generate nor train; set one")
        if self.mask_stale_partial_tokens and not self.partial_rollout:
            raise ValueError("rollout_system.mask_stale_partial_tokens needs partial_rollout: true")
        if self.max_new_tokens_per_rollout is not None:
            if self.max_new_tokens_per_rollout < 1 or not self.partial_rollout:
                raise ValueError(f"rollout_system.max_new_tokens_per_rollout={self.max_new_tokens_per_rollout} needs "
                                 "partial_rollout: true and a value >= 1 (tokens per sample per rollout)")
            if (self.deterministic and self.mode != "sync" and self.lookahead + 1 > self.max_staleness
                    and not (self.mask_stale_partial_tokens or self.stale_policy == "withhold")):
                raise ValueError("rollout_system.max_new_tokens_per_rollout in deterministic mode: a continued "
                                 f"sample's first tokens are {self.lookahead + 1} versions old when it trains, over "
                                 f"max_staleness={self.max_staleness}; set mask_stale_partial_tokens: true or "
                                 "stale_policy: withhold")
        for name, registry in PLUGINS.items():
            if getattr(self, name) is not None:
                fn = registry.get(getattr(self, name), key=f"rollout_system.{name}")
                contract, args, kwargs = PLUGIN_CALLS[name]
                check_call(fn, f"rollout_system.{name} {getattr(self, name)!r}", contract, *args, **kwargs)
