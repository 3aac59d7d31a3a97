"""The model backends, declared once: `BACKENDS` holds each name's strategy class (by import path) and what it can do.

Preflight, pipelines and workers ask this registry (`capabilities`, `backends_that`, `can_share_weights`), never a
backend's name. A strategy named by import path ("package.module:Class") declares its own with a class attribute
`capabilities` (a `Capabilities`); one that declares none is taken to train and generate in one process, as the `hf`
strategy does, but without sharing tensors or serving requests. (An import path may also name a `Backend`, and
`BACKENDS["name"] = Backend(...)` registers one by name.)
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.config import Registry, import_object
from baton.strategy.base import ParallelConfig, StrategyConfig


@dataclass(frozen=True)
class Capabilities:
    """trains: holds a model of its own: steps an optimizer, exports weights and saves checkpoints (actor, critic,
        reference, reward model, teacher); without it a backend only takes weights (the rollout role's).
    generates: samples responses to a batch of prompts (`generate(DataProto)`).
    shares_weights: two roles of this backend fused into one process can share tensors instead of copying them
        (`share_weights_from`).
    top_k_log_probs: computes the top-k log-probs of every response token (a distillation teacher).
    trains_over_workers: one model trained over several workers (sharded); without it each worker would keep a
        model of its own and they would drift apart.
    trains_lora: trains a LoRA adapter on its frozen model (`StrategyConfig.lora`).
    devices_per_worker: drives several devices from one worker process (tensor-parallel inference).
    parallel_layouts: splits one model over workers by tensor, context, pipeline-stage and replicated-shard dimensions
        (`StrategyConfig.parallel`), and says each worker's place in that layout (`rank_info`).
    filtered_log_probs: reports the log-probs of the top-k / top-p filtered distribution, which the actor does not
        recompute (so sampling filters are refused).
    takes_engine_kwargs: passes `StrategyConfig.engine_kwargs` to the inference engine it runs on.
    serves_lora_adapters: serves a LoRA actor's adapter on its own base weights (`import_adapter`) when its engine is
        built for adapters (`engine_kwargs: {enable_lora: true, max_lora_rank: R}`), so the sync sends the adapter.
    engine: import path of `fn(config: StrategyConfig, max_num_seqs: int) -> baton.engines.protocol.ServedEngine`,
        the request-level engine that a rollout-system `EngineWorker` serves; None: it serves no requests.
    check_installed: import path of `fn()` that raises ImportError, with the install command, where a package the
        backend needs once built is missing (its module imports without it, so that preflight can say so first).
    """

    trains: bool = True
    generates: bool = True
    shares_weights: bool = False
    top_k_log_probs: bool = False
    trains_over_workers: bool = False
    trains_lora: bool = False
    devices_per_worker: bool = False
    parallel_layouts: bool = False
    filtered_log_probs: bool = False
    takes_engine_kwargs: bool = False
    serves_lora_adapters: bool = False
    engine: str | None = None
    check_installed: str | None = None

    @property
    def serves_requests(self) -> bool:
        """Runs as a request-level engine of the rollout system (`EngineWorker`)."""
        return self.engine is not None


@dataclass(frozen=True)
class Backend:
    """A registered backend: `strategy`, the import path "package.module:Class" of the class a role's worker builds
    (imported on first use, so that e.g. the mock strategy does not import FSDP), and what it can do."""

    strategy: str
    capabilities: Capabilities


BACKENDS: Registry[Backend] = Registry("strategy", {
    "hf": Backend("baton.strategy.hf:HFStrategy", Capabilities(
        shares_weights=True, top_k_log_probs=True, trains_lora=True, engine="baton.engines.hf:serve")),
    "fsdp2": Backend("baton.strategy.fsdp2:Fsdp2Strategy", Capabilities(
        generates=False, top_k_log_probs=True, trains_over_workers=True, parallel_layouts=True)),
    "mock": Backend("baton.strategy.mock:MockStrategy", Capabilities()),
    # A rollout only, on the vllm engine, so it lives in baton.engines (this layer imports no engine); needs vLLM
    # (scripts/setup.sh --vllm).
    "vllm": Backend("baton.engines.vllm_rollout:VLLMRollout", Capabilities(
        trains=False, devices_per_worker=True, filtered_log_probs=True, takes_engine_kwargs=True,
        serves_lora_adapters=True, engine="baton.engines.vllm_rollout:serve",
        check_installed="baton.engines.vllm_rollout:require_vllm")),
})


def strategy_class(name: str) -> type:
    """The class for a registered name, or for an import path "package.module:Class" (ConfigError, a ValueError, for
    anything else, with the valid names)."""
    entry = BACKENDS.get(name)
    return import_object(entry.strategy) if isinstance(entry, Backend) else entry


def capabilities(name: str) -> Capabilities:
    """What the backend `name` can do: a registered name's entry, or the `capabilities` its class declares."""
    entry = BACKENDS.get(name)
    if isinstance(entry, Backend):
        return entry.capabilities
    declared = getattr(entry, "capabilities", Capabilities())
    if not isinstance(declared, Capabilities):
        raise ValueError(f"strategy {name!r}: its class attribute `capabilities` is a {type(declared).__name__}; "
                         "declare a baton.strategy.capabilities.Capabilities")
    return declared


def backends_that(what: str) -> list[str]:
    """The registered backends with capability `what` (for messages that list the choices)."""
    return [name for name in BACKENDS if getattr(BACKENDS.get(name).capabilities, what)]


def can_share_weights(first: str, second: str) -> bool:
    """Whether roles on backends `first` and `second`, fused into one process, share tensors instead of copying
    weights: the same backend, one that can."""
    return first == second and capabilities(first).shares_weights


def shares_policy_weights(actor: StrategyConfig, rollout: StrategyConfig) -> bool:
    """Whether a fused actor and rollout share tensors (`can_share_weights`): never with a LoRA actor, whose served
    weights are merged (W + scale · B A), tensors it does not hold; those are copied."""
    return actor.lora is None and can_share_weights(actor.name, rollout.name)


def syncs_policy_adapter(actor: StrategyConfig, rollout: StrategyConfig) -> bool:
    """Whether the actor → rollout sync sends only a LoRA actor's adapter: the rollout's backend serves adapters and
    its engine is built for them (`engine_kwargs` enable_lora); otherwise a LoRA actor sends merged weights."""
    return (actor.lora is not None and capabilities(rollout.name).serves_lora_adapters
            and bool(rollout.engine_kwargs.get("enable_lora", False)))


def check_parallel_layout(config: StrategyConfig) -> None:
    """ValueError where `config.parallel` asks a backend that holds a whole model per worker for a layout."""
    if config.parallel != ParallelConfig() and not capabilities(config.name).parallel_layouts:
        raise ValueError(f"strategy {config.name!r} holds a whole model on each worker, so it takes no parallel layout "
                         f"({config.parallel}); use a strategy that splits one model over workers "
                         f"({backends_that('parallel_layouts')}), or drop strategy.parallel")
