"""Evaluate and sample a saved checkpoint in this process (no Ray): `baton eval` and `baton generate`.

A checkpoint is scored the way its run validated it: the run's tokenizer, held-out data, reward
and validation sampling (`val_sampling`), read from the `config.yaml` the pipeline wrote in its
run directory, through the pipelines' own `validate`.

A run directory is data unless trusted: without `trust_run_dir`, its config.yaml is read without importing anything
from the run directory or the directories its import_dirs.txt records (they are taken off `sys.path` too), and an
import path in it that nothing installed provides is refused in one line naming the key and the way on
(`--trust-run-dir`, or `--reward` for the reward). The checkpoint itself is safetensors, loaded without pickles.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from typing import Any, Iterator

from baton.checkpoint import PIPELINE_STATE, has_state
from baton.config import ConfigError, import_object, load_config, load_yaml
from baton.config.paths import drop_import_dirs, recorded_import_dirs
from baton.pipelines.run_dir import list_checkpoints
from baton.pipelines.config import DataConfig, SamplingConfig
from baton.strategy.lora import has_adapter


def resolve_checkpoint(path: str) -> str:
    """The HF model directory that `path` names: a role directory (config.json), a step directory (its
    `actor`), a run directory (its latest step), or a directory of runs (the one written last, e.g. the
    demo's `runs/demo` -> its rlvr stage). A LoRA role's directory holds its adapter and its base's config.json
    (`load_policy` puts the adapter on the run's base model)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if has_state(os.path.join(path, PIPELINE_STATE)):  # a step directory
        roles = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "config.json")))
        if "actor" in roles:
            return os.path.join(path, "actor")
        raise FileNotFoundError(f"step directory {path} holds no actor/ model (roles with a model: {roles}); "
                                "pass the role directory itself")
    steps = list_checkpoints(path)
    if not steps:  # a directory of runs: the latest checkpoint of the run written last
        runs = [os.path.join(path, d) for d in sorted(os.listdir(path)) if list_checkpoints(os.path.join(path, d))]
        steps = sorted((list_checkpoints(run)[-1] for run in runs), key=os.path.getmtime)
    if not steps:
        raise FileNotFoundError(f"{path} is not a checkpoint: no config.json (a role directory), {PIPELINE_STATE} "
                                "(a step directory) or checkpoints/ (a run directory) in it or its subdirectories")
    return resolve_checkpoint(steps[-1])


IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.\w+)*:[A-Za-z_][\w.]*$")  # "package.module:attr" in config data


def run_config(model_dir: str, *, trust_run_dir: bool = False, reward: str | None = None):
    """The resolved config of the run that saved `model_dir` (its run directory's config.yaml), or None. Untrusted,
    nothing is imported from the run directory or its recorded directories (`check_untrusted_imports`). reward: a
    reward given on the command line, which replaces the run's `reward_fn` before anything is imported."""
    checkpoints_dir = os.path.dirname(os.path.dirname(model_dir))  # <run_dir>/checkpoints/step_<N>/<role>
    run_dir = os.path.dirname(checkpoints_dir)
    path = os.path.join(run_dir, "config.yaml")
    if os.path.basename(checkpoints_dir) != "checkpoints" or not os.path.isfile(path):
        return None
    data = load_yaml(path)
    if reward is not None and "reward_fn" in data:
        data["reward_fn"] = reward
    if not trust_run_dir:
        drop_import_dirs([run_dir, *recorded_import_dirs(run_dir)])
        check_untrusted_imports(path, data)
    pipeline_path = data.get("pipeline_cls")
    if not isinstance(pipeline_path, str):
        raise ConfigError(f"{path}: pipeline_cls is {pipeline_path!r}, not an import path 'package.module:Class'")
    pipeline_cls = import_object(pipeline_path)
    if not isinstance(getattr(pipeline_cls, "config_cls", None), type):
        raise ConfigError(f"{path}: pipeline_cls {pipeline_path!r} is not a pipeline class (one with a config_cls)")
    overrides = [f"reward_fn={reward}"] if reward is not None and "reward_fn" in data else []
    return load_config(pipeline_cls.config_cls, path, overrides, import_beside=trust_run_dir)


def check_untrusted_imports(path: str, data: dict) -> None:
    """ConfigError for the first import path in a run's config data whose top-level module nothing installed
    provides: it could only come from the run directory, which is not trusted. (Finding a top-level module runs
    none of its code.)"""
    for key, value in _import_paths(data):
        top = value.partition(":")[0].split(".")[0]
        if top in sys.modules or importlib.util.find_spec(top) is not None:
            continue
        way = "pass --trust-run-dir if you trust the run directory's code" + (
            ", or name a reward with --reward" if key.split(".")[0] == "reward_fn" else "")
        raise ConfigError(f"{path}: {key} {value!r} is not installed here; it would be imported from the run "
                          f"directory, and opening a run imports nothing from it: {way}")


def _import_paths(data: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every string in plain config data shaped like an import path."""
    if isinstance(data, dict):
        for name, value in data.items():
            yield from _import_paths(value, f"{key}.{name}" if key else str(name))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _import_paths(value, f"{key}[{i}]")
    elif isinstance(data, str) and IMPORT_PATH.match(data):
        yield key, data


@dataclasses.dataclass
class LoadedPolicy:
    """A checkpoint ready to sample: an in-process `HFStrategy` and the run's settings."""

    model_dir: str
    strategy: object  # HFStrategy
    tokenizer_path: str | None
    data: DataConfig
    sampling: SamplingConfig
    reward_fn: str | dict[str, str]  # a reward, or one per data_source
    from_run_config: bool
    reward_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run's, for its own reward_fn


def load_policy(path: str, *, temperature: float | None = None, max_new_tokens: int | None = None,
                num_samples: int | None = None, reward: str | None = None, trust_run_dir: bool = False) -> LoadedPolicy:
    """Build the checkpoint's model with the run's rollout settings; overrides replace `val_sampling`'s fields.
    reward: replaces the run's reward_fn (and drops its reward_kwargs, which were its reward's); trust_run_dir: import the modules the run's config names from the run
    directory and its recorded directories (`run_config`)."""
    from baton.models import max_position_embeddings
    from baton.strategy import StrategyConfig
    from baton.strategy.hf import HFStrategy

    model_dir = resolve_checkpoint(path)
    config = run_config(model_dir, trust_run_dir=trust_run_dir, reward=reward)
    lora = has_adapter(model_dir)
    if lora and config is None:
        raise ValueError(f"{model_dir} holds a LoRA adapter and no run config.yaml above it names its base model and "
                         "lora settings; open it inside its run directory, or load it with peft on its base model")
    if config is None:  # a bare HF directory: its own tokenizer (else baton's), the default task, greedy decoding
        has_tokenizer = any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer_path = model_dir if has_tokenizer else None
        strategy_config = StrategyConfig(model=model_dir, tokenizer=tokenizer_path)
        data, sampling, reward_fn = DataConfig(), SamplingConfig(temperature=0.0, num_samples_per_prompt=1), "exact_match"
        reward_kwargs = {}
    else:
        role = getattr(config, "rollout", None) or config.actor  # what generated during the run's validation
        tokenizer_path = role.strategy.tokenizer
        strategy_config = dataclasses.replace(role.strategy, name="hf", kind="causal_lm", model=model_dir)
        if lora:  # the actor's base model with its lora settings; the adapter is loaded below
            strategy_config = dataclasses.replace(config.actor.strategy, name="hf")
        data = getattr(config, "data", None) or DataConfig()
        sampling = getattr(config, "val_sampling", None) or SamplingConfig(temperature=0.0, num_samples_per_prompt=1)
        reward_fn = getattr(config, "reward_fn", "exact_match")
        reward_kwargs = dict(getattr(config, "reward_kwargs", None) or {})
    if reward is not None:
        reward_fn, reward_kwargs = reward, {}
    overrides = {"temperature": temperature, "max_new_tokens": max_new_tokens, "num_samples_per_prompt": num_samples}
    sampling = dataclasses.replace(sampling, **{k: v for k, v in overrides.items() if v is not None})
    positions = max_position_embeddings(model_dir)
    if positions is not None and data.max_prompt_len + sampling.max_new_tokens > positions:
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens} after prompts of up to data.max_prompt_len="
                         f"{data.max_prompt_len} tokens passes the model's max_position_embeddings={positions}; "
                         "lower --max-new-tokens")
    strategy = HFStrategy(strategy_config)
    if lora:
        strategy.load_model_weights(model_dir)
    return LoadedPolicy(model_dir, strategy, tokenizer_path, data, sampling, reward_fn, config is not None, reward_kwargs)


def evaluate(policy: LoadedPolicy, data_path: str | None = None, reward_fn: str | None = None) -> dict:
    """Accuracy, pass@k (with several samples per prompt: `pass@2`, `pass@4`, … `pass@{n}`) and mean reward of
    `policy` on the run's held-out data (or the prompt file `data_path`), and verl's val-core metrics of each data
    source ("val-core": {"<data_source>/reward/mean@{n}": ..., ...}), as the run logged them. The run's reward_fn is
    called with its reward_kwargs (a `reward_fn` given here, with none); no data field may set one."""
    from baton.datasets.load import load_datasets, load_prompt_file
    from baton.pipelines.policy import validate
    from baton.rewards import RewardRoutes
    from baton.workers import RewardWorker

    reward_kwargs = policy.reward_kwargs if reward_fn is None else {}
    reward_fn = reward_fn or policy.reward_fn
    routes = RewardRoutes(reward_fn, reward_kwargs)
    if data_path is not None:
        val = load_prompt_file(policy.data, data_path, policy.strategy.tokenizer, routes)
    else:
        _, val, _ = load_datasets(policy.data, policy.tokenizer_path, routes)
        if val is None:
            raise ValueError(f"the run of {policy.model_dir} has no held-out data (data.val_path is unset); "
                             "pass --data PATH.jsonl")
    worker = RewardWorker(reward_fn, policy.tokenizer_path, reward_kwargs=reward_kwargs)
    metrics = validate(policy.strategy, worker, val, policy.strategy.tokenizer, policy.sampling,
                       policy.data.max_prompt_len)
    pass_at_k = {key.removeprefix("val/"): value for key, value in metrics.items() if key.startswith("val/pass@")}
    return {"checkpoint": policy.model_dir, "accuracy": metrics["val/accuracy"], **pass_at_k,
            "mean_reward": metrics["val/reward/mean"], "mean_response_length": metrics["val/response_length/mean"],
            "n": len(val), "num_samples_per_prompt": policy.sampling.num_samples_per_prompt,
            "temperature": policy.sampling.temperature, "max_new_tokens": policy.sampling.max_new_tokens,
            "reward_fn": reward_fn,
            "data": data_path or ("held-out split" if policy.data.task == "arithmetic" else policy.data.val_path),
            "val-core": {key.removeprefix("val-core/"): value for key, value in metrics.items()
                         if key.startswith("val-core/")}}


def export_merged(policy: LoadedPolicy, out_dir: str) -> str:
    """`policy`'s model as a plain HF directory at `out_dir` (a LoRA checkpoint's adapter merged into its base), which
    transformers, vLLM and `baton eval` load without peft; `out_dir` must not exist or be empty."""
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty; choose a new directory for the merged model")
    policy.strategy.save_merged(out_dir)
    return os.path.abspath(out_dir)


def generate(policy: LoadedPolicy, prompts: list[str], seed: int = 0) -> list[dict]:
    """{"prompt", "completion"} for each prompt and sample, `num_samples_per_prompt` per prompt in a row."""
    from baton.datasets import PromptDataset, collate_prompts

    dataset = PromptDataset([{"prompt": p, "answer": ""} for p in prompts])
    batch = collate_prompts(dataset, range(len(dataset)), policy.strategy.tokenizer)
    out = policy.strategy.generate(batch, policy.sampling.params(seed=seed))
    texts = policy.strategy.tokenizer.batch_decode(out.batch["responses"], skip_special_tokens=True)
    return [{"prompt": str(prompt), "completion": text} for prompt, text in zip(out.non_tensor_batch["prompt"], texts)]
