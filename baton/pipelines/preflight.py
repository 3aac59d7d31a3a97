"""Checks that need no worker, run before Ray starts (and by `baton config`): every role's strategy and model, the
strategy/world-size and strategy/devices combinations, whether the machine has the CPUs and devices the roles
ask for, and the trackers' packages.

A mistake found here costs a second; found in a worker's start-up it cost half a minute or more.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from baton.config import ConfigError, import_object
from baton.distributed.worker import usable_cpu_count
from baton.pipelines.config import RoleConfig, TrainerConfig, WorkerSettings, strategy_capabilities
from baton.pipelines.role_layout import describe_roles, devices_needed, model_roles
from baton.strategy import ParallelConfig, StrategyConfig
from baton.strategy.capabilities import backends_that, capabilities, check_parallel_layout, strategy_class
from baton.tracking.tracker import missing_package

TRAINING_ROLES = ("actor", "critic")  # roles whose model an optimizer steps
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_roles(config, trainer: TrainerConfig) -> None:
    """Raise ConfigError for a role whose strategy or model cannot load, or a layout the machine cannot hold."""
    roles = model_roles(config)
    for name, role in roles.items():  # before the strategies load: a role given an engine is a mistake either way
        can = strategy_capabilities(f"{name}.strategy", role.strategy)
        if not can.trains and name != "rollout":
            raise ConfigError(
                f"{name}.strategy.name is {role.strategy.name!r}, an inference engine: it generates and takes the "
                f"actor's weights, but trains nothing, exports no weights and saves no checkpoints, so it serves the "
                f"rollout role only; use {name}.strategy.name={' / '.join(backends_that('trains'))} and keep "
                f"{role.strategy.name!r} for rollout.strategy.name")
        if role.strategy.lora is not None and (name != "actor" or not can.trains_lora):
            raise ConfigError(
                f"{name}.strategy.lora: LoRA trains the actor's adapter on {' / '.join(backends_that('trains_lora'))}"
                + (f", not on {role.strategy.name!r}; set {name}.strategy.name: hf or remove lora" if name == "actor"
                   else f"; the {name} role holds no adapter (a rollout takes the actor's merged weights), remove it"))
        if role.strategy.engine_kwargs and not can.takes_engine_kwargs:
            raise ConfigError(
                f"{name}.strategy.engine_kwargs {sorted(role.strategy.engine_kwargs)} are an inference engine's settings, "
                f"but {name}.strategy.name is {role.strategy.name!r}, which takes none; remove them, or use "
                f"{' / '.join(backends_that('takes_engine_kwargs'))} for the rollout")
    for name, role in roles.items():
        check_strategy(f"{name}.strategy", role.strategy)
        workers = role.num_workers(name)
        if name in TRAINING_ROLES and not capabilities(role.strategy.name).trains_over_workers and workers > 1:
            raise ConfigError(
                f"{name}.strategy.name is {role.strategy.name!r} with {workers} {name} workers: that strategy keeps an "
                f"independent model per worker, so they would drift apart; use {name}.strategy.name="
                f"{' / '.join(backends_that('trains_over_workers'))} to train one model over {workers} workers, or "
                f"{name}.world_size=1")
        check_parallel(f"{name}.strategy", role.strategy, workers)
    check_sequence_lengths(config, roles)
    check_machine(config, trainer)


def check_parallel(key: str, strategy: StrategyConfig, workers: int) -> None:
    """A parallel layout (`strategy.parallel`) is one the backend takes, the role's worker count divides into and the
    model's heads, MLP and layers split by."""
    if strategy.parallel == ParallelConfig():
        return
    from baton.strategy.context_parallel import check_context_parallel
    from baton.strategy.pipeline_parallel import check_pipeline_parallel
    from baton.strategy.tensor_parallel import check_tensor_parallel

    try:
        check_parallel_layout(strategy)
        strategy.parallel.dp_shard(workers)
        model = hf_config(strategy.model)
        if strategy.parallel.tp > 1:
            check_tensor_parallel(model, strategy.parallel.tp)
        if strategy.parallel.cp > 1:
            check_context_parallel(model, strategy.parallel.cp)
            if strategy.packing:
                raise ValueError("packing: true with cp > 1: a context-parallel pass splits padded rows by position "
                                 "and does not pack them; set packing: null (or false), or cp: 1")
        if strategy.parallel.pp > 1:
            check_pipeline_parallel(model, strategy)
    except ValueError as e:
        raise ConfigError(f"{key}.parallel: {e}") from None


def hf_config(model: str | dict):
    """The transformers config of a model name, dict or local directory."""
    from baton.models import model_config

    if isinstance(model, str) and os.path.isdir(model):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, local_files_only=True)
    return model_config(model)


def check_sequence_lengths(config, roles: dict[str, RoleConfig]) -> None:
    """A prompt of `data.max_prompt_len` tokens and a response of each sampling section's `max_new_tokens` fit every
    model role's `max_position_embeddings` (a registry name, a dict, or a directory's config.json that states it)."""
    from baton.models import max_position_embeddings

    data = getattr(config, "data", None)
    sections = [(key, getattr(config, key)) for key in ("sampling", "val_sampling") if getattr(config, key, None)]
    if not hasattr(data, "max_prompt_len") or not sections:
        return
    key, longest = max(sections, key=lambda section: section[1].max_new_tokens)
    length = data.max_prompt_len + longest.max_new_tokens
    for name, role in roles.items():
        positions = max_position_embeddings(role.strategy.model)
        if positions is not None and length > positions:
            raise ConfigError(f"data.max_prompt_len={data.max_prompt_len} + {key}.max_new_tokens="
                              f"{longest.max_new_tokens} makes sequences of {length} tokens, more than {name}.strategy."
                              f"model's max_position_embeddings={positions}; lower them")


def check_devices_per_worker(roles: dict[str, RoleConfig], has_gpus: bool) -> None:
    """On GPUs, a worker of several devices sees them all, but only a strategy that drives several GPUs from one
    process (`Capabilities.devices_per_worker`) uses more than the first; refuse the others. On CPU slots several
    devices per worker are more CPUs (threads) for it, for any strategy. `has_gpus`: whether the slots are GPUs (the
    local Ray instance's, or a `ResourceManager.device_kind` once reserved)."""
    if not has_gpus:
        return
    for name, role in roles.items():
        if role.num_devices_per_worker > 1 and not capabilities(role.strategy.name).devices_per_worker:
            raise ConfigError(
                f"{name}.num_devices_per_worker={role.num_devices_per_worker} on GPUs with {name}.strategy.name="
                f"{role.strategy.name!r}: that strategy runs its model on one GPU per worker process, so the other "
                f"{role.num_devices_per_worker - 1} would sit idle. Use one worker per GPU: "
                f"{name}.num_devices_per_worker=1 with {name}.world_size set to the GPU count "
                f"({' / '.join(backends_that('trains_over_workers'))} shards one model over its workers); several GPUs per worker are for "
                f"{', '.join(backends_that('devices_per_worker'))} (tensor parallel) rollouts")


def check_strategy(key: str, strategy: StrategyConfig) -> None:
    """The strategy class imports, and `model` is a registry name, a valid dict, or a readable HF model directory."""
    from baton.models import MODEL_CONFIGS, model_config

    try:
        strategy_class(strategy.name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}.name: {e}") from e
    check_installed = strategy_capabilities(key, strategy).check_installed
    if check_installed is not None:  # its module imports without the packages it needs once built
        try:
            import_object(check_installed)()
        except ImportError as e:
            raise ConfigError(f"{key}.name: {e}") from e
    model = strategy.model
    if isinstance(model, dict):
        try:
            model_config(model)
        except ValueError as e:
            raise ConfigError(f"{key}.model: {e}") from e
    elif model not in MODEL_CONFIGS:
        check_model_dir(f"{key}.model", model, sorted(MODEL_CONFIGS))
    if strategy.tokenizer is not None and not os.path.isdir(strategy.tokenizer):
        raise ConfigError(f"{key}.tokenizer: {strategy.tokenizer} is not a directory (looked in the working directory "
                          f"{os.getcwd()} and beside the config file); give a local tokenizer directory, or null for "
                          "baton's character tokenizer")


def check_model_dir(key: str, path: str, names: list[str]) -> None:
    """`path` is a directory with a readable HF config.json and weights."""
    if not os.path.exists(path):
        raise ConfigError(f"{key}: {path!r} is neither a model name ({', '.join(names)}) nor an existing directory "
                          f"(looked in the working directory {os.getcwd()} and beside the config file); give a local "
                          "HF model directory (config.json + safetensors) or a model name")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path} is a file; give the directory that holds config.json and the weights")
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file) as f:
            hf_config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path} has no config.json; is it an HF model directory? (a baton run's model is in "
                          "its checkpoints/step_N/actor)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {config_file}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{key}: {config_file} nests too deeply to be a model config") from None
    if not isinstance(hf_config, dict) or "model_type" not in hf_config:
        raise ConfigError(f"{key}: {config_file} has no model_type; it is not an HF model config")
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES) and not any(
            name.endswith(".safetensors") for name in os.listdir(path)):
        raise ConfigError(f"{key}: {path} has a config.json but no weights (model.safetensors); copy the whole model "
                          "directory")


def check_machine(config, trainer: TrainerConfig) -> None:
    """On a local Ray instance (the one the pipeline starts, or one already running): the roles' devices per worker
    suit their strategies (`check_devices_per_worker`), and their device slots and CPU-only workers fit. A cluster
    joined by address is checked by the pipeline once the resource manager has reserved on it."""
    machine = local_machine(trainer)
    if machine is None:
        return
    cpus, gpus, where = machine
    check_devices_per_worker(model_roles(config), has_gpus=gpus > 0)
    num_nodes = trainer.num_nodes or 1
    slots = (trainer.num_devices_per_node or devices_needed(config, num_nodes)) * num_nodes
    cpu_only = {name: role for name, role in vars(config).items()
                if isinstance(role, WorkerSettings) and role.num_devices_per_worker == 0}
    cpu_only_cpus = sum(role.num_workers(name) * role.num_cpus_per_worker for name, role in cpu_only.items())
    if gpus and slots > gpus:
        raise ConfigError(f"the roles need {slots} GPU(s) ({describe_roles(config)}) but {where} has {gpus:g}; "
                          "lower their world_size / device_mapping")
    needed = cpu_only_cpus + slots  # a slot is a CPU, or a GPU whose worker takes one CPU beside it
    if needed > cpus:
        workers = ", ".join(f"{name}: {role.num_workers(name)} × {role.num_cpus_per_worker:g}" for name, role in cpu_only.items())
        raise ConfigError(
            f"the roles need {needed:g} CPU(s): {slots} device slot(s) ({describe_roles(config)}) and {cpu_only_cpus:g} "
            f"for CPU-only workers ({workers}), but {where} has {cpus:g}. Lower their world_size, or set "
            "trainer.num_cpus to start Ray with more logical CPUs (slower: the workers then share cores)")


def check_trackers(trainer: TrainerConfig) -> None:
    """Each of `trainer.tracker`'s sinks has its package (looked up, not imported). The mlflow sink's store: with
    MLFLOW_TRACKING_URI unset MLflow opens sqlite:///mlflow.db, which needs SQLAlchemy (full mlflow, not
    mlflow-skinny)."""
    for sink in trainer.tracker:
        if problem := missing_package(sink):
            raise ConfigError(f"trainer.tracker has {sink!r}, but {problem}")
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in trainer.tracker and (not uri or uri.startswith("sqlite:")) and not importlib.util.find_spec("sqlalchemy"):
        store = uri or "sqlite:///mlflow.db (MLflow's default, MLFLOW_TRACKING_URI being unset)"
        raise ConfigError(f"trainer.tracker has 'mlflow', whose tracking store is {store}, which needs SQLAlchemy: "
                          "set MLFLOW_TRACKING_URI to your tracking server (http://host:5000), or pip install mlflow")


def local_machine(trainer: TrainerConfig) -> tuple[float, float, str] | None:
    """(CPUs, GPUs, its description) of the local Ray instance the run will use: the running one, or the one the
    pipeline starts. None where the run uses no Ray (the local backend's slots are CPUs) or joins a cluster by address
    (unknown until it connects; the resource manager checks the layout when it reserves)."""
    if trainer.backend != "ray" or trainer.ray_address:
        return None
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        resources = ray.cluster_resources()
        return resources.get("CPU", 0.0), resources.get("GPU", 0.0), "the running Ray instance"
    if (trainer.num_nodes or 1) > 1:
        raise ConfigError(f"trainer.num_nodes={trainer.num_nodes}, but a local Ray instance has one node; join a "
                          "cluster with --ray-address (trainer.ray_address), or set trainer.num_nodes=null")
    cpus = trainer.num_cpus or usable_cpu_count()
    where = (f"a local Ray instance with trainer.num_cpus={trainer.num_cpus}" if trainer.num_cpus else
             f"a local Ray instance on the {cpus} core(s) this process may use")
    return cpus, _local_gpu_count(), where


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
