"""Typed configuration of the pipelines: one tree per pipeline, loaded from YAML with `key.sub=value` overrides.

Batch knobs carry their unit: `num_prompts_per_step`, `num_samples_per_prompt`,
`micro_batch_size_per_worker`, `max_tokens_per_microbatch`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from baton.config import ConfigError
from baton.datasets.config import DataConfig
from baton.distributed import WorkerConfig
# The typed tree of a run: the configs of the components it holds (data, algorithm) are theirs, named here too.
from baton.rl.config import AlgorithmConfig, KLControlConfig, check_choice  # noqa: F401
from baton.strategy import OptimizerConfig, SamplingParams, StrategyConfig
from baton.strategy.capabilities import Capabilities, backends_that, capabilities
from baton.tracking.tracker import SINKS
from baton.workers.weight_sync import TRANSPORTS

# "policy": actor + rollout fused
MODEL_ROLES = ("actor", "rollout", "reference", "teacher", "critic", "reward_model", "policy")


@dataclass
class WorkerSettings:
    """How one role's workers run: how many, on which devices, with which limits and environment. A CPU-only role
    (reward) is just this; a model role (`RoleConfig`) adds its strategy."""

    world_size: int | None = None
    device_mapping: list[int] | None = None
    num_devices_per_worker: int = 1  # 0: a CPU-only worker, placed outside the device slots
    num_cpus_per_worker: float = 1.0  # CPU-only workers
    # torch threads per worker process; None: its CPU share (num_cpus_per_worker, or 1 per CPU device slot). On
    # the local backend every worker shares the driver's threads and this is ignored (with a warning).
    num_threads_per_worker: int | None = None
    # The cores of its node each worker process runs on (Ray backend; Linux); None: wherever the OS puts it. On a CPU
    # machine, a trainer given cores of its own is not slowed by the rollout engines beside it.
    cpu_cores: list[int] | None = None
    worker_cls: str | None = None  # import path "package.module:Class"; None: the role's default worker
    env_vars: dict[str, str] = field(default_factory=dict)  # set in each worker process before its constructor (Ray)
    # Ray backend: a call running longer than call_timeout_s, or a worker leaving its heartbeat (sent every
    # health_check_interval_s, answered even while a call runs; 0: off) unanswered for heartbeat_timeout_s, stops the
    # run with an error naming the worker. Raise call_timeout_s for steps that take longer than 30 minutes.
    call_timeout_s: float = 1800.0
    heartbeat_timeout_s: float = 60.0
    health_check_interval_s: float = 2.0

    def worker_config(self, name: str) -> WorkerConfig:
        """The cluster `name` of this role: one worker unless world_size or device_mapping say otherwise.
        Model roles may be given the same devices: they time-share them (offloading between turns)."""
        world_size = self.world_size if self.world_size or self.device_mapping else 1
        return WorkerConfig(name, world_size=world_size, device_mapping=self.device_mapping,
                            num_devices_per_worker=self.num_devices_per_worker, num_cpus_per_worker=self.num_cpus_per_worker,
                            num_threads_per_worker=self.num_threads_per_worker, cpu_cores=self.cpu_cores,
                            share_devices_with=MODEL_ROLES,
                            env_vars=dict(self.env_vars), call_timeout_s=self.call_timeout_s,
                            heartbeat_timeout_s=self.heartbeat_timeout_s,
                            health_check_interval_s=self.health_check_interval_s)

    def num_workers(self, name: str) -> int:
        """Workers in cluster `name` of this role; a layout that contradicts itself raises LayoutError with the fix."""
        return self.worker_config(name).resolve_world_size(None)[0]


@dataclass
class RoleConfig(WorkerSettings):
    """One model role's cluster: its workers (see `WorkerSettings`) and its strategy."""

    strategy: StrategyConfig = field(default_factory=StrategyConfig)

    def num_data_shards(self, name: str) -> int:
        """Into how many shards the role's workers split each batch: one per data-parallel rank, the workers of one
        tensor × context parallel group taking the same rows (`strategy.parallel`; a worker count the layout does
        not divide is refused by preflight)."""
        return max(1, self.num_workers(name) // self.strategy.parallel.model_parallel_size)

    def with_run_schedule(self, num_updates: int) -> "RoleConfig":
        """This role, its decaying lr schedule spanning `num_updates` optimizer steps when it sets no total_steps."""
        scheduler = self.strategy.scheduler
        if scheduler.name == "constant" or scheduler.total_steps is not None:
            return self
        scheduler = dataclasses.replace(scheduler, total_steps=num_updates)
        return dataclasses.replace(self, strategy=dataclasses.replace(self.strategy, scheduler=scheduler))

    def check_schedule(self, name: str, num_updates: int, counted: str) -> None:
        """ConfigError where this role's lr schedule decays to 0 before the run's `num_updates` optimizer steps end
        (`counted`: how the run's config makes that many, for the message), which would then train nothing."""
        scheduler = self.strategy.scheduler
        num_idle = scheduler.num_updates_at_zero_lr(num_updates)
        if num_idle:
            raise ConfigError(
                f"{name}.strategy.scheduler.total_steps={scheduler.total_steps}: the {scheduler.name} decay reaches lr 0 "
                f"after {num_updates - num_idle} updates, but this run makes {num_updates} ({counted}), so its last "
                f"{num_idle} would train nothing; set {name}.strategy.scheduler.total_steps={num_updates}, remove it "
                "(the decay then spans the run), or set min_lr_ratio above 0")


@dataclass
class RewardSettings(WorkerSettings):
    """The reward role's CPU-only workers (see `WorkerSettings`) and how each scores its rows.

    num_processes_per_worker: 0 scores the rows one after another in the worker's own process; N > 0 scores them
    concurrently in N spawned processes per worker. timeout_s_per_row (needs processes; None: no limit but the
    worker's call_timeout_s): a row that runs longer is cut off, its process killed, and treated like a row the
    function raised on (reward_on_error), counted in reward/num_errors and reward/num_timeouts. A slow reward
    (math_verify) without a timeout_s_per_row is scored in processes (at least one) with a limit of
    `baton.rewards.DEFAULT_TIMEOUT_S_PER_ROW` per row, a row past it scored 0 and counted whatever
    reward_on_error says (`baton.rewards.scoring_pool`)."""

    num_processes_per_worker: int = 0
    timeout_s_per_row: float | None = None

    def __post_init__(self):
        if self.num_processes_per_worker < 0:
            raise ValueError(f"num_processes_per_worker must be >= 0, got {self.num_processes_per_worker}")
        if self.timeout_s_per_row is not None and self.timeout_s_per_row <= 0:
            raise ValueError(f"timeout_s_per_row must be > 0 (or null: no limit), got {self.timeout_s_per_row}")
        if self.timeout_s_per_row is not None and self.num_processes_per_worker == 0:
            raise ValueError(f"timeout_s_per_row={self.timeout_s_per_row} needs num_processes_per_worker >= 1: a row "
                             "scored in the worker's own process cannot be cut off; set reward.num_processes_per_worker "
                             "(e.g. 4), or unset timeout_s_per_row")


def _reward_workers() -> RewardSettings:
    return RewardSettings(world_size=1, num_devices_per_worker=0)


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong penalty (verl's `reward_model.overlong_buffer`): a training response longer than
    sampling.max_new_tokens - len tokens gets min(-(length - (max_new_tokens - len)) / len * penalty_factor, 0)
    added to its reward. len 0: off."""

    len: int = 0
    penalty_factor: float = 1.0

    def __post_init__(self):
        if self.len < 0:
            raise ValueError(f"len must be >= 0 (0: no overlong penalty), got {self.len}")


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    num_samples_per_prompt: int = 8

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0: greedy)")

    def params(self, seed: int | None = None) -> SamplingParams:
        """These settings as the strategies' `SamplingParams` (seed None: the rollout's own generator)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, n=self.num_samples_per_prompt, seed=seed)


@dataclass
class TrainerConfig:
    """The loop: steps, validation, checkpoints, output; where it runs."""

    num_steps: int = 100
    num_prompts_per_step: int = 32
    val_every_steps: int = 10
    val_before_train: bool = True
    save_every_steps: int = 50
    keep_last_checkpoints: int = 2
    sync_every_steps: int = 1
    seed: int = 0
    run_dir: str = "runs/rlvr"
    resume: str | None = None  # "latest", a checkpoint directory, or None
    # A new run (resume null) into a run_dir that holds a previous run's metrics, summary or checkpoints is refused;
    # true: that run's metrics.jsonl, summary.json, metrics.png and checkpoints are removed first (nothing else).
    overwrite: bool = False
    tracker: list[str] = field(default_factory=lambda: ["jsonl"])  # and any of tensorboard, wandb, mlflow
    backend: str = "ray"  # "ray" or "local" (everything in the driver's process)
    ray_address: str | None = None
    ray_local_only: bool = True  # a local Ray instance listens on 127.0.0.1 only; false: on this node's address
    num_cpus: int | None = None  # logical CPUs of a local Ray instance; default: the cores this process may use
    num_devices_per_node: int | None = None
    num_nodes: int | None = None
    progress_bar: bool = True  # a bar on a terminal; elsewhere (a log file) a plain line per 30 s
    # At each validation, the first log_samples held-out prompts (the same ones each time), one response each, with
    # its reward and ground truth, go to samples.jsonl, the trackers and the console; 0: none. Every
    # log_samples_every_steps-th training step (0: never), the first log_samples prompts of its batch too (RL loops).
    log_samples: int = 4
    log_samples_every_steps: int = 0
    # A trace per sample (baton.tracking.trace): trace.json in the run directory, for Perfetto or chrome://tracing,
    # of every traced group's requests, reward, buffer wait and train step, and the trainer's phases; one prompt group
    # in trace_every_groups is traced. `baton trace RUN --sample g12-s3` prints one sample's path.
    trace: bool = False
    trace_every_groups: int = 1
    # Model roles whose devices overlap (device_mapping) take turns on them: the rollout is offloaded (vLLM: put to
    # sleep) while the actor, reference and critic compute, and they are offloaded while it generates; in DPO and
    # distillation the reference or teacher is offloaded while the actor trains, and reloaded to score. "auto": on
    # when such roles run on GPUs; true: on CPU too (where offloading frees nothing); false: every role keeps its
    # device memory. A colocated actor and rollout (colocate_actor_rollout) share tensors and are never offloaded.
    offload_idle_roles: bool | str = "auto"
    # How a weight sync's buckets go from the actor to the rollout (`ModelUpdatePair`'s transport): "auto" (the sources'
    # shared memory where both roles run on one node, else Ray's object store), "shared_memory", "object_store", or
    # "collective" (gloo groups of the sync's own, for roles on different nodes). weight_sync_delta: send only the
    # weights whose fingerprint changed since the last sync (every weight is still checked after).
    # weight_sync_fingerprints: false skips the check of every weight's fingerprint after each sync (one more pass
    # over the weights on each side; the probe still runs).
    weight_sync_transport: str = "auto"
    weight_sync_delta: bool = False
    weight_sync_fingerprints: bool = True

    def __post_init__(self):
        check_choice("trainer.weight_sync_transport", self.weight_sync_transport, TRANSPORTS)
        if self.trace_every_groups < 1:
            raise ValueError(f"trainer.trace_every_groups must be >= 1 (1: every group), got {self.trace_every_groups}")
        if self.weight_sync_delta and not self.weight_sync_fingerprints:
            raise ValueError("trainer.weight_sync_delta sends the weights whose fingerprint changed: it needs "
                             "trainer.weight_sync_fingerprints: true")
        if self.backend not in ("ray", "local"):
            raise ValueError(f"trainer.backend {self.backend!r} is not one of 'ray', 'local'")
        if self.overwrite and self.resume is not None:
            raise ValueError(f"trainer.overwrite=true would remove the run that trainer.resume={self.resume!r} "
                             "continues; set one of them")
        if not (isinstance(self.offload_idle_roles, bool) or self.offload_idle_roles == "auto"):
            raise ValueError(f"trainer.offload_idle_roles {self.offload_idle_roles!r} is not one of 'auto', true, "
                             "false")
        for name in ("num_steps", "num_prompts_per_step", "sync_every_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1")
        for name in ("log_samples", "log_samples_every_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be >= 0 (0 turns it off)")
        for sink in self.tracker:
            if sink not in SINKS:
                close = difflib.get_close_matches(sink, SINKS, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"trainer.tracker {sink!r} is not a tracker; {hint}trackers: {', '.join(SINKS)}")


@dataclass
class RewardModelSettings:
    """How the `reward_model` role scores: "scalar" (a value-head model, strategy kind value: its value at the
    response's last token) or "generative" (a causal LM judge: `template` with {prompt}, {response} and
    {ground_truth}, answered greedily in at most `max_new_tokens`, parsed by `parse_fn`, an import path
    `fn(text) -> float`). The step's score is the reward function's plus `weight` × the model's.

    The judge sees the response cut to its first `max_response_chars` characters and fenced between two lines that
    hold a random boundary, new for every call; an answer outside [min_score, max_score] counts as unparsed (scored
    0, counted in reward_model/judge/num_unparsed and num_out_of_range)."""

    type: str = "scalar"
    weight: float = 1.0
    template: str = "Question: {prompt}\nAnswer: {response}\nScore (0 to 1): "
    parse_fn: str = "baton.workers.reward_model:first_number"
    max_new_tokens: int = 4
    min_score: float = 0.0
    max_score: float = 1.0
    max_response_chars: int = 8000

    def __post_init__(self):
        if self.type not in ("scalar", "generative"):
            raise ValueError(f"reward_model_settings.type {self.type!r} is not one of 'scalar', 'generative'")
        if not math.isfinite(self.weight):
            raise ValueError(f"reward_model_settings.weight={self.weight} must be a finite number")
        if self.max_new_tokens < 1:
            raise ValueError(f"reward_model_settings.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not (math.isfinite(self.min_score) and math.isfinite(self.max_score) and self.min_score < self.max_score):
            raise ValueError(f"reward_model_settings.min_score={self.min_score} and max_score={self.max_score} must be "
                             "finite with min_score < max_score (the range the template asks the judge for)")
        if self.max_response_chars < 1:
            raise ValueError(f"reward_model_settings.max_response_chars={self.max_response_chars} must be >= 1")
        if "{response}" not in self.template:
            raise ValueError("reward_model_settings.template must contain {response} (the judged response); it may "
                             "also use {prompt} and {ground_truth}")


@dataclass
class RLVRConfig:
    """GRPO (no critic) or PPO (critic, GAE) on verifiable rewards."""

    pipeline_cls: str = "baton.pipelines.rlvr:RLVRPipeline"
    actor: RoleConfig = field(default_factory=RoleConfig)
    rollout: RoleConfig = field(default_factory=RoleConfig)
    reference: RoleConfig | None = None
    critic: RoleConfig | None = None
    colocate_actor_rollout: bool = False  # one process per device holds both; sync shares tensors
    # A registry name or import path, or a mapping {data_source: reward} with "default" for the other sources.
    reward_fn: str | dict[str, str] = "exact_match"
    # The reward function's settings, passed as keywords (data rows never set them; a data field named like one is
    # refused at load): {name: value}, or, with a mapping reward_fn, {entry: {name: value}} per entry of it.
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    reward_on_error: str = "raise"  # a row the reward function raises on stops the run; "zero": scores 0, counted
    reward: RewardSettings = field(default_factory=_reward_workers)  # the reward function's CPU-only workers
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # A model that scores responses besides the reward function (see RewardModelSettings); None: none.
    reward_model: RoleConfig | None = None
    reward_model_settings: RewardModelSettings = field(default_factory=RewardModelSettings)
    data: DataConfig | None = field(default_factory=DataConfig)  # None inside the demo: its top-level `data`
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    val_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, num_samples_per_prompt=1))
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def needs_reference(self) -> bool:
        """Whether the algorithm reads a reference's log-probs: a `reference:` section, or a KL loss or KL reward."""
        return self.reference is not None or self.algorithm.use_kl_loss or self.algorithm.use_kl_in_reward

    def updates_per_step(self) -> int | None:
        """The actor's (and critic's) optimizer steps per training step, num_ppo_epochs × num_mini_batches_per_step;
        None where the config alone does not fix them (a custom workflow)."""
        return self.algorithm.num_ppo_epochs * self.algorithm.num_mini_batches_per_step

    def with_run_schedules(self) -> "RLVRConfig":
        """This config, with each decaying lr schedule that sets no total_steps spanning the run's optimizer steps."""
        algo = self.algorithm
        per_step = self.updates_per_step() or algo.num_ppo_epochs * algo.num_mini_batches_per_step
        updates = self.trainer.num_steps * per_step
        return dataclasses.replace(self, actor=self.actor.with_run_schedule(updates),
                                   critic=self.critic.with_run_schedule(updates) if self.critic else None)

    def check_schedules(self) -> None:
        """ConfigError for an actor or critic lr schedule that ends at lr 0 before the run does, where the config says
        how many updates the run makes (else the run warns when it sees lr 0: `baton.tracking.health`)."""
        per_step = self.updates_per_step()
        if per_step is None:
            return
        counted = f"trainer.num_steps={self.trainer.num_steps} × {per_step} per step"
        for name in ("actor", "critic"):
            role = getattr(self, name)
            if role is not None:
                role.check_schedule(name, self.trainer.num_steps * per_step, counted)

    def check(self) -> None:
        """Raise ConfigError for combinations that cannot run; the pipeline calls this before Ray or any worker starts."""
        algo, trainer, num_samples = self.algorithm, self.trainer, self.sampling.num_samples_per_prompt
        _check_data(self.data)
        algo.check(num_samples, has_critic=self.critic is not None)
        self.check_schedules()
        if self.critic is not None and self.critic.strategy.kind != "value":
            raise ConfigError(f"critic.strategy.kind is {self.critic.strategy.kind!r}; a critic predicts values: "
                              "set critic.strategy.kind: value")
        if self.reward_model is not None:
            wanted = {"scalar": "value", "generative": "causal_lm"}[self.reward_model_settings.type]
            if self.reward_model.strategy.kind != wanted:
                raise ConfigError(f"reward_model.strategy.kind is {self.reward_model.strategy.kind!r}, but a "
                                  f"{self.reward_model_settings.type} reward model is kind {wanted!r}: set "
                                  f"reward_model.strategy.kind: {wanted}, or reward_model_settings.type")
            # A reward model holds a model of its own (frozen); a judge also generates.
            needs = ("trains", "generates") if self.reward_model_settings.type == "generative" else ("trains",)
            can = strategy_capabilities("reward_model.strategy", self.reward_model.strategy)
            if not all(getattr(can, what) for what in needs):
                able = sorted(set.intersection(*(set(backends_that(what)) for what in needs)))
                raise ConfigError(f"reward_model.strategy.name {self.reward_model.strategy.name!r}: a "
                                  f"{self.reward_model_settings.type} reward model runs on {' or '.join(able)}")
        if trainer.num_prompts_per_step % algo.num_mini_batches_per_step:
            raise ConfigError(
                f"trainer.num_prompts_per_step={trainer.num_prompts_per_step} does not split into "
                f"algorithm.num_mini_batches_per_step={algo.num_mini_batches_per_step} mini-batches of whole prompts; "
                f"use one of {_divisors(trainer.num_prompts_per_step)}")
        rows = trainer.num_prompts_per_step * num_samples // algo.num_mini_batches_per_step
        for name in ("actor", "critic"):
            role = getattr(self, name)
            shards = role.num_data_shards(name) if role is not None else 1
            if rows % shards:
                raise ConfigError(
                    f"a mini-batch of {rows} responses (trainer.num_prompts_per_step × sampling.num_samples_per_prompt "
                    f"/ algorithm.num_mini_batches_per_step) does not split evenly over the {shards} {name} "
                    f"workers (data-parallel shards); make it a multiple of {shards}")
        rollout_layout = (self.rollout.world_size, self.rollout.device_mapping)
        if self.colocate_actor_rollout and rollout_layout != (None, None) and rollout_layout != (
                self.actor.world_size, self.actor.device_mapping):
            raise ConfigError("colocate_actor_rollout puts actor and rollout in the same processes, so rollout.world_size "
                              "and rollout.device_mapping must equal the actor's (or leave them unset)")
        if self.colocate_actor_rollout and self.rollout.num_threads_per_worker not in (
                None, self.actor.num_threads_per_worker):
            raise ConfigError("colocate_actor_rollout puts actor and rollout in the same processes, which run "
                              "actor.num_threads_per_worker threads: set it there and leave rollout's unset")
        if self.colocate_actor_rollout and self.rollout.cpu_cores not in (None, self.actor.cpu_cores):
            raise ConfigError("colocate_actor_rollout puts actor and rollout in the same processes, which run on "
                              "actor.cpu_cores: set it there and leave rollout's unset")
        if strategy_capabilities("rollout.strategy", self.rollout.strategy).filtered_log_probs:
            _check_unfiltered_sampling(self.sampling, "sampling", self.rollout.strategy.name)
            _check_unfiltered_sampling(self.val_sampling, "val_sampling", self.rollout.strategy.name)
        _check_reward_fn(self.reward_fn, self.reward_on_error, self.reward_kwargs)
        buffer, max_new_tokens = self.overlong_buffer.len, self.sampling.max_new_tokens
        if buffer and buffer >= max_new_tokens:
            raise ConfigError(f"overlong_buffer.len={buffer} must be below sampling.max_new_tokens={max_new_tokens}: "
                              "the penalty starts max_new_tokens - len tokens in; use a smaller len (DAPO: a fifth of "
                              "the limit), or 0 for no penalty")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on (prompt, answer) pairs; the loss covers the answer tokens only."""

    pipeline_cls: str = "baton.pipelines.sft:SFTPipeline"
    actor: RoleConfig = field(default_factory=lambda: RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=3e-3))))
    data: DataConfig | None = field(default_factory=DataConfig)  # None inside the demo: its top-level `data`
    val_sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, num_samples_per_prompt=1))
    reward_fn: str | dict[str, str] = "exact_match"  # scores validation; as RLVRConfig's
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # as RLVRConfig's
    reward_on_error: str = "raise"  # a row the reward function raises on stops the run; "zero": scores 0, counted
    reward: RewardSettings = field(default_factory=_reward_workers)  # the reward function's CPU-only workers
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(num_prompts_per_step=64, run_dir="runs/sft"))

    def with_run_schedules(self) -> "SFTConfig":
        """This config, with a decaying lr schedule that sets no total_steps spanning the run (one update per step)."""
        return dataclasses.replace(self, actor=self.actor.with_run_schedule(self.trainer.num_steps))

    def check(self) -> None:
        """Raise ConfigError for combinations that cannot run; the pipeline calls this before Ray or any worker starts."""
        _check_data(self.data)
        self.actor.check_schedule("actor", self.trainer.num_steps, f"trainer.num_steps={self.trainer.num_steps}, one "
                                  "update each")
        shards = self.actor.num_data_shards("actor")
        if self.trainer.num_prompts_per_step % shards:
            raise ConfigError(f"trainer.num_prompts_per_step={self.trainer.num_prompts_per_step} does not split evenly "
                              f"over the {shards} actor workers (data-parallel shards); make it a multiple of {shards}")
        _check_reward_fn(self.reward_fn, self.reward_on_error, self.reward_kwargs)
        if self.trainer.offload_idle_roles is True:
            warnings.warn("trainer.offload_idle_roles=true is ignored: SFT trains one role, which shares its devices "
                          "with no other", stacklevel=2)


def _check_data(data: DataConfig | None) -> None:
    if data is None:
        raise ConfigError("no data: add a `data:` section (task: arithmetic, or task: files with train_path)")


def strategy_capabilities(key: str, strategy: StrategyConfig) -> Capabilities:
    """What a role's backend can do (`key`: the role's strategy section, for the message); ConfigError where its name
    is neither registered nor an import path that loads."""
    try:
        return capabilities(strategy.name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}.name: {e}") from e


def _check_unfiltered_sampling(sampling: SamplingConfig, key: str, rollout: str) -> None:
    """A rollout with `Capabilities.filtered_log_probs` (vLLM) reports the log-probs of the top-k / top-p filtered
    distribution, not the temperature-scaled one the actor recomputes (and the `vllm` engine refuses such requests):
    refuse the filters before any worker starts."""
    if sampling.temperature > 0 and (sampling.top_k > 0 or sampling.top_p < 1):
        unfiltered = [name for name in backends_that("generates") if name not in backends_that("filtered_log_probs")]
        raise ConfigError(f"{key}.top_k={sampling.top_k} / {key}.top_p={sampling.top_p} with rollout.strategy.name "
                          f"{rollout}: its log-probs would be the filtered distribution's, which the actor does not "
                          f"recompute; set {key}.top_k=0 and {key}.top_p=1.0, or use rollout.strategy.name="
                          f"{' / '.join(unfiltered)}")


def _check_reward_fn(spec: str | dict[str, str], on_error: str, kwargs: dict[str, Any] | None = None) -> None:
    """Every reward `spec` names resolves (a registry name, or an import path that imports) and takes the settings
    `kwargs` (reward_kwargs), before any worker starts."""
    from baton.rewards import REWARD_ON_ERROR, RewardRoutes

    try:
        RewardRoutes(spec, kwargs)
    except ValueError as e:
        raise ConfigError(str(e) if "reward_kwargs" in str(e) else f"reward_fn: {e}") from e
    check_choice("reward_on_error", on_error, REWARD_ON_ERROR)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
