"""RLVR on the rollout system (slime's programming model): a pool of inference engines behind a router, a data source
with a buffer, over-sampling with dynamic filtering, partial rollouts, and generation that runs ahead of training
(`rollout_system.mode`: sync, one_step_off, async) within a staleness bound.

The loop: the step's groups (generated now, by the rollout started during the last step, or taken from the
continuous producer) → training batch (staleness-checked) → old/ref log-probs and values → advantages → update →
weights into the engines in place → validate → checkpoint. The algorithm is the loop's (`RLAlgorithm`, held, not
inherited); only where the samples come from differs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from baton.config import ConfigError
from baton.data import DataProto
from baton.datasets import PromptDataset
from baton.datasets.load import load_datasets, load_prompt_file
from baton.pipelines.base import Pipeline
from baton.pipelines.config import RLVRConfig, RoleConfig
from baton.pipelines.policy import probe_tolerance, reference_for, reference_role
from baton.pipelines.rlvr import reward_model_role
from baton.pipelines.time_sharing import cluster_devices, on_gpus
from baton.rewards import RewardRoutes
from baton.rl import RLAlgorithm, SFTLoss, StaleSamplesWarning, TrainingRoles, add_model_scores, per_row
from baton.rl.metrics import reward_extra_metrics
from baton.rollout import RolloutDataSource, Sample
from baton.rollout.config import RolloutSystemConfig
from baton.rollout.engine_worker import EngineWorker
from baton.rollout.functions import RolloutStalledError
from baton.rollout.context import RolloutServices, load_plugin
from baton.rollout.evaluator import RolloutEvaluator
from baton.rollout.pool import EnginePool
from baton.rollout.producer import RolloutProducer
from baton.rollout.publisher import WeightPublisher
from baton.rollout.reward import GroupRewarder
from baton.strategy.capabilities import backends_that, can_share_weights, capabilities, shares_policy_weights
from baton.tracking import trace
from baton.workers import ActorWorker, CriticWorker
from baton.workers.weight_sync import probe_batch

# What the rollout system's reward gets by keyword beside the row's own fields (`GroupRewarder`): no uid or
# finish_reason, as the trainer's batches have.
ROLLOUT_REWARD_COLUMNS = ("prompt",)


@dataclass
class RolloutRewardConfig:
    """How the rollout system scores each finished group (off the driver's event loop): concurrently in
    num_processes processes of their own, where a row running past timeout_s_per_row is cut off and handled by
    reward_on_error (see `RewardSettings`); with num_processes 0, in one process whenever a limit applies (a slow
    reward's default, or rollout_system.reward_timeout_s per row: see `GroupRewarder`), else in a thread."""

    num_processes: int = 0
    timeout_s_per_row: float | None = None

    def __post_init__(self):
        if self.num_processes < 0:
            raise ValueError(f"reward.num_processes must be >= 0, got {self.num_processes}")
        if self.timeout_s_per_row is not None and self.num_processes < 1:
            raise ValueError(f"reward.timeout_s_per_row={self.timeout_s_per_row} needs reward.num_processes >= 1: a "
                             "row scored in a thread cannot be cut off")


@dataclass
class RolloutRLVRConfig(RLVRConfig):
    """`RLVRConfig` with the rollout system (`rollout_system`; see `RolloutSystemConfig`). The rollout role's workers
    are the engine pool: `rollout.world_size` engines of `rollout.num_devices_per_worker` devices each.
    eval_files: further held-out sets, name -> a jsonl/parquet file with the data's keys, each logged as
    `eval/{name}/...` (the data's own val set is `val/...`).
    loss: "policy" (the algorithm's RL loss on advantages) or "sft" (the response tokens' negative log-likelihood,
    slime's sft_loss: with `rollout_system.rollout_function: baton.rollout.functions:sft_rollout` the same machinery
    trains SFT on the dataset's responses)."""

    pipeline_cls: str = "baton.pipelines.rollout_rlvr:RolloutRLVRPipeline"
    rollout_system: RolloutSystemConfig = field(default_factory=RolloutSystemConfig)
    reward: RolloutRewardConfig = field(default_factory=RolloutRewardConfig)  # no reward workers: the GroupRewarder scores
    eval_files: dict[str, str] = field(default_factory=dict)
    loss: str = "policy"

    def updates_per_step(self) -> int | None:
        """The loop's with the policy loss; one with loss "sft"; none when only rolling out."""
        if self.rollout_system.rollout_only:
            return None
        return super().updates_per_step() if self.loss == "policy" else 1

    def check(self) -> None:
        super().check()
        if self.loss not in ("policy", "sft"):
            raise ConfigError(f"loss {self.loss!r} is not one of 'policy', 'sft'")
        if self.colocate_actor_rollout and self.rollout_system.load_rollouts is not None:
            raise ConfigError("colocate_actor_rollout puts an engine in each actor process, but "
                              "rollout_system.load_rollouts trains on saved rollouts without engines; unset one of them")
        if (self.colocate_actor_rollout and self.rollout_system.mode != "sync"
                and can_share_weights(self.actor.strategy.name, self.rollout.strategy.name)):
            raise ConfigError(f"colocate_actor_rollout: the engines generate with the actor's own tensors, which "
                              f"training changes in place, so they cannot generate while it trains "
                              f"(rollout_system.mode {self.rollout_system.mode!r}); use mode: sync, or "
                              "colocate_actor_rollout: false")
        if not capabilities(self.rollout.strategy.name).serves_requests:
            raise ConfigError(f"rollout.strategy.name {self.rollout.strategy.name!r}: the rollout system's engines serve "
                              f"requests, which {', '.join(backends_that('serves_requests'))} do; set one of them")


def engine_roles(rollout: RoleConfig) -> dict[str, RoleConfig]:
    """One role per engine, `rollout_<i>`, each a single worker on its share of the rollout role's devices."""
    count, per_engine = rollout.num_workers("rollout"), max(rollout.num_devices_per_worker, 1)
    mapping = rollout.device_mapping or list(range(count * per_engine))
    return {f"rollout_{i}": dataclasses.replace(rollout, world_size=1,
                                                device_mapping=mapping[i * per_engine:(i + 1) * per_engine])
            for i in range(count)}


class RolloutRLVRPipeline(Pipeline):
    config_cls = RolloutRLVRConfig

    def __init__(self, config: RolloutRLVRConfig):
        config = config.with_run_schedules()
        super().__init__(config, config.trainer)
        system, algo = config.rollout_system, config.algorithm
        roles = {"actor": (ActorWorker, config.actor, (config.actor.strategy,))}
        if (reference := reference_role(config)) is not None:
            roles["reference"] = reference
        if config.critic is not None:
            roles["critic"] = (CriticWorker, config.critic, (config.critic.strategy,))
        if config.reward_model is not None:
            roles["reward_model"] = reward_model_role(config)
        colocated = config.colocate_actor_rollout
        if system.load_rollouts is not None:  # train-only: no engines
            engines = {}
        elif colocated:  # an engine in each actor rank's process
            engines = {"rollout": config.rollout}
        else:
            engines = engine_roles(config.rollout)
        roles.update({name: (EngineWorker, role, (role.strategy, system.max_num_seqs_per_engine))
                      for name, role in engines.items()})
        clusters = self.create_clusters(roles, {"policy": ["actor", "rollout"]} if colocated else None)
        self.actor, self.critic = clusters["actor"], clusters.get("critic")
        self.reference = reference_for(config, clusters)
        self.reward_model = clusters.get("reward_model")
        self.checkpoint_clusters = ["actor"] + (["critic"] if self.critic else [])
        self.algorithm = RLAlgorithm(algo, config.reward_fn)
        if system.mode != "sync" and algo.rollout_correction == "none":
            # The old log-probs cost a forward pass: computed where the loss uses them (a correction, several
            # epochs or mini-batches), which also logs rollout/logprob_diff.
            warnings.warn(f"rollout_system.mode {system.mode!r} trains on tokens up to "
                          f"{max(system.max_staleness, 1)} version(s) old and algorithm.rollout_correction is 'none', so "
                          "the loss does not correct for it; set it (e.g. token_tis) to weigh them by the engines' "
                          "log-probs", StaleSamplesWarning, stacklevel=2)
        data = config.data
        source = RolloutDataSource(self.train_data, self.tokenizer, config.sampling.num_samples_per_prompt,
                                   seed=config.trainer.seed, max_prompt_len=data.max_prompt_len,
                                   buffer_filter=system.buffer_filter)
        eval_sets: dict[str, PromptDataset] = {"val": self.val_data} if self.val_data is not None else {}
        routes = RewardRoutes(config.reward_fn, config.reward_kwargs)
        eval_sets.update({name: load_prompt_file(data, path, self.tokenizer, routes)
                          for name, path in config.eval_files.items()})
        overlong = config.overlong_buffer
        rewarder = GroupRewarder(
            config.reward_fn, on_error=config.reward_on_error, num_processes=config.reward.num_processes,
            timeout_s_per_row=config.reward.timeout_s_per_row, timeout_s=system.reward_timeout_s,
            reward_kwargs=config.reward_kwargs,
            custom=load_plugin(system.reward_function, "reward_function"),
            overlong=(config.sampling.max_new_tokens, overlong.len, overlong.penalty_factor) if overlong.len else None)
        # The rollout system: the engines behind their router, the reward, and three parts that use them: the
        # producer makes the steps' groups, the publisher puts weights into the engines, the evaluator scores the
        # held-out sets.
        self.pool = EnginePool(system, [clusters["rollout"].worker_view(rank) for rank in range(self.actor.world_size)]
                               if colocated else [clusters[name] for name in engines])
        self.services = RolloutServices(self.pool, rewarder, self.tokenizer, data.sft_response_key)
        self.producer = RolloutProducer(self.services, source, dataclasses.replace(config.sampling.params(), n=1),
                                        config.trainer.num_prompts_per_step)
        share = colocated and shares_policy_weights(config.actor.strategy, config.rollout.strategy)
        self.publisher = WeightPublisher(self.pool, self.make_probe(), probe_tolerance(config.actor, config.rollout),
                                         share_role="actor" if share else None, engines_on_gpu=on_gpus(self.manager))
        self.evaluator = RolloutEvaluator(self.services, eval_sets, config.val_sampling.params(seed=0),
                                          config.trainer.num_prompts_per_step, data.max_prompt_len)
        # Colocated engines hold the actor's devices with it (sharing its tensors where they can): never offloaded.
        self.time_share = not colocated and self.engines_share_devices(clusters, list(engines))
        if engines:
            self.publisher.publish(self.actor, version=0)
        # The overlapped modes: the next steps' (groups, metrics, batch or None) by step, being generated or taken,
        # and made training data, in the background while this step trains (`lookahead` of them).
        self.ahead: dict[int, concurrent.futures.Future] = {}
        self.maybe_resume()

    def engines_share_devices(self, clusters: dict, engines: list[str]) -> bool:
        """Whether the engines sleep while the training roles compute (`trainer.offload_idle_roles`: "auto" on GPUs,
        true on CPU too, where it frees nothing): where an engine shares a device with them, in sync mode only (the
        overlapped modes generate while training runs)."""
        setting, mode = self.trainer.offload_idle_roles, self.config.rollout_system.mode
        training = {d for name in ("actor", "reference", "critic") if name in clusters
                    for d in cluster_devices(clusters[name])}
        shared = any(cluster_devices(clusters[name]) & training for name in engines)
        wanted = setting is True or (setting == "auto" and on_gpus(self.manager))
        if shared and wanted and mode != "sync":
            warnings.warn(f"rollout_system.mode {mode!r} generates while the actor trains, so engines that share its "
                          "devices cannot sleep meanwhile (trainer.offload_idle_roles is ignored); give the engines "
                          "devices of their own (rollout.device_mapping)", stacklevel=3)
        return shared and wanted and mode == "sync"

    @classmethod
    def load_data(cls, config: RolloutRLVRConfig):
        """With the SFT loss, one row per demonstration (as SFT trains), so each sample has one response."""
        train, val, tokenizer = load_datasets(config.data, config.actor.strategy.tokenizer,
                                              RewardRoutes(config.reward_fn, config.reward_kwargs),
                                              reward_columns=ROLLOUT_REWARD_COLUMNS)
        if config.loss == "sft":
            train = train.one_response_per_row(config.data.sft_response_key)
        return train, val, tokenizer

    def make_probe(self):
        data = self.val_data if self.val_data is not None and len(self.val_data) else self.train_data
        examples = [data[i] for i in range(min(4, len(data)))]
        return probe_batch(self.tokenizer, [str(e[data.prompt_key]) + str(e[data.answer_key]) for e in examples], 1)

    # --- state ------------------------------------------------------------------------------------

    @property
    def lookahead(self) -> int:
        """How many steps' rollouts are prepared ahead of the one training (`RolloutSystemConfig.lookahead`)."""
        return self.config.rollout_system.lookahead

    def pipeline_state(self) -> dict:
        """Besides the loop's (and the algorithm's): the data source (its buffer and the partial samples in it) and,
        in the overlapped modes, the next steps' groups, generated or taken ahead (waited for first, so that the
        samples they put back are in the buffer saved)."""
        ahead = []
        for step in sorted(self.ahead):
            groups, metrics, _ = self.wait_rollout(self.ahead[step])
            ahead.append({"step": step, "groups": [[s.to_dict() for s in g] for g in groups], "metrics": metrics})
        return {**super().pipeline_state(), **self.algorithm.state_dict(), "rollouts": self.producer.state_dict(),
                "ahead": ahead}

    def load_pipeline_state(self, state: dict) -> None:
        super().load_pipeline_state(state)
        self.algorithm.load_state_dict(state)
        self.producer.load_state_dict(state["rollouts"])
        legacy = state.get("next_rollout")  # a checkpoint written before `ahead`: the next step's only
        for saved in state.get("ahead", []) + ([{**legacy, "step": self.global_step + 1}] if legacy else []):
            groups = [[Sample.from_dict(d) for d in g] for g in saved["groups"]]
            for group in groups:  # made training data before the save, and made again in their step
                self.services.ledger.trained.discard(group[0].group_index)
            self.ahead[saved["step"]] = concurrent.futures.Future()
            self.ahead[saved["step"]].set_result((groups, saved["metrics"], None))  # made training data in its step

    def maybe_resume(self) -> None:
        super().maybe_resume()
        if self.resumed_from_step is not None and self.pool.engines:
            self.publisher.publish(self.actor, version=self.global_step)

    def do_checkpoint(self, step: int) -> str:
        """In async mode the producer stops first (what runs is aborted into the buffer, what is ready goes back to
        its front), so the checkpoint holds every sample; it starts again after. The next step's take, running
        meanwhile, is waited for first: its groups are saved as the next step's."""
        continuous = self.producer.producing
        if continuous:
            for pending in self.ahead.values():
                self.wait_rollout(pending)
            self.producer.stop_continuous()
        path = super().do_checkpoint(step)
        if continuous and step < self.trainer.num_steps:
            self.producer.start_continuous()
        return path

    # --- the loop ---------------------------------------------------------------------------------

    def next_batch(self, step: int) -> tuple[DataProto, dict[str, float]]:
        """The step's training batch and its metrics. In the overlapped modes it was prepared in the background
        during an earlier step (or saved with it), and the next steps' up to `lookahead` are started now, one after
        another: their groups are generated (one_step_off, deterministic async) or taken from the producer (async)
        and made training data while this step trains, so that only what training did not hide is waited for.
        Step t's are started once the engines hold the weights of version t - 1 - lookahead (this step's start:
        version step - 1), and in deterministic mode no newer weights go in before they are done (`run`)."""
        pending = self.ahead.pop(step, None)
        groups, metrics, made = self.wait_rollout(pending) if pending is not None else self.prepare(step)
        for later in range(step + 1, min(step + self.lookahead, self.trainer.num_steps) + 1):
            if later not in self.ahead:
                self.ahead[later] = self.producer.run_in_background(self.prepare, later)
        batch, data_metrics = made if made is not None else self.training_data(groups, step)  # None: from a checkpoint
        return batch, {**metrics, **data_metrics}

    def wait_rollout(self, pending: concurrent.futures.Future) -> tuple:
        """A later step's prepared (groups, metrics, batch or None). Its generate or take is bounded by
        rollout_timeout_s or watchdog_s; this wait by both together, past which a RolloutStalledError names the stall."""
        system = self.config.rollout_system
        timeout_s = system.rollout_timeout_s + system.watchdog_s
        try:
            return pending.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if pending.done():  # the preparation's own timeout
                raise
            raise RolloutStalledError(self.pool.describe_stall(
                f"the next step's batch was not ready within {timeout_s:g} s (rollout_system.rollout_timeout_s + "
                "watchdog_s)")) from None

    def prepare(self, step: int) -> tuple[list[list[Sample]], dict[str, float], tuple[DataProto, dict]]:
        """Step `step`'s groups (generated, or taken from the free-running async producer), their metrics, and their
        training batch."""
        system = self.config.rollout_system
        groups, metrics = self.producer.take() if system.mode == "async" and not system.deterministic else \
            self.producer.generate(step)
        return groups, metrics, self.training_data(groups, step)

    def training_data(self, groups: list[list[Sample]], step: int) -> tuple[DataProto, dict[str, float]]:
        """Step `step` trains the weights of version step - 1: the groups are checked against the bound for it. For
        ReMax, each row's `reward_baselines`: the reward of a greedy response to its prompt, generated now."""
        batch, metrics = self.producer.to_training_data(groups, trained_version=step - 1,
                                                        temperature=self.config.sampling.temperature)
        if self.algorithm.needs.baseline_rollout and self.config.loss == "policy":
            by_group = self.evaluator.greedy_baselines(groups, self.config.sampling.max_new_tokens)
            batch.batch["reward_baselines"] = per_row(by_group, batch)
        return batch, metrics

    def run(self) -> dict:
        trainer, system = self.config.trainer, self.config.rollout_system
        engines = self.pool.engines
        tracker = self.make_tracker()
        start = time.perf_counter()
        first_val = self.first_validation()
        if system.mode == "async" and not system.deterministic and self.global_step < trainer.num_steps:
            self.producer.start_continuous()
        metrics: dict[str, float] = {}
        for step in self.training_steps("rlvr"):
            with self.timer("step"):
                with self.timer("gen"):  # the wait for the step's batch (what generation did not overlap)
                    batch, rollout_metrics = self.next_batch(step)
                batch, train_metrics, sync_metrics = batch, {}, {}
                if not system.rollout_only:
                    if (current := trace.tracer()) is not None:
                        current.train_started(step, trained_version=step - 1)
                    if self.time_share:  # the engines sleep while the training roles use their devices
                        with self.timer("offload"):
                            self.publisher.offload()
                    batch, train_metrics = self.train(batch)
                    if self.time_share:
                        with self.timer("reload"):
                            self.publisher.onload()
                    if system.deterministic and step + self.lookahead in self.ahead:
                        with self.timer("gen"):  # the rollouts ahead sample with the weights this step changes:
                            self.wait_rollout(self.ahead[step + self.lookahead])  # done before they do
                    with self.timer("sync"):
                        sync_metrics = self.publisher.publish(self.actor, version=step) if engines else {}
            metrics = {**self.rollout_metrics(batch), **self.services.rewarder.error_metrics(),
                       **reward_extra_metrics(batch), **rollout_metrics, **train_metrics, **sync_metrics, **self.timings}
            self.algorithm.watch(step, metrics)
            self.log_train_samples(step, batch)
            self.end_step(step, metrics, "reward", "critic/score/mean")
        self.publisher.settle()  # the last sync's probe, when scored in the background
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_reward=metrics.get("critic/score/mean")))

    def rollout_metrics(self, batch: DataProto) -> dict[str, float]:
        """The trained batch's metrics (the algorithm's); a pipeline on this one adds its own (the agentic one's)."""
        return self.algorithm.batch_metrics(batch)

    def train(self, batch) -> tuple:
        """The algorithm's training (`RLAlgorithm.train_on`), the reward model's score added first where there is
        one; or with loss "sft" one update on the responses' negative log-likelihood."""
        if self.config.loss == "policy":
            model_metrics = {}
            if self.reward_model is not None:
                with self.timer("reward_model"):
                    batch, model_metrics = add_model_scores(batch, self.reward_model.score(batch),
                                                            self.config.reward_model_settings.weight)
            batch, metrics = self.algorithm.train_on(batch, TrainingRoles(self.actor, self.reference, self.critic),
                                                     self.timer)
            return batch, {**model_metrics, **metrics}
        with self.timer("update_actor"):
            per_rank = self.actor.train_step(batch, SFTLoss(), "token")
        return batch, {f"actor/{key}": float(np.mean([m[key] for m in per_rank])) for key in per_rank[0]}

    def validate(self) -> dict[str, float]:
        """The val set's metrics as `val/...`, the loop's metric set; the further eval sets' as `eval/{name}/...`;
        the val set's first prompts' sample rows in `val_samples`."""
        result = self.evaluator.eval(self.global_step, self.trainer.log_samples)
        self.val_samples = result.samples
        return result.metrics

    def shutdown(self) -> None:
        services = getattr(self, "services", None)
        parts = (getattr(self, "producer", None), getattr(self, "publisher", None),  # the producer first: it stops
                 services and services.rewarder, getattr(self, "pool", None))  # generating, the pool last
        for part in filter(None, parts):
            part.close()
        super().shutdown()


__all__ = ["RolloutRLVRConfig", "RolloutRLVRPipeline", "engine_roles"]
