"""Evaluate and sample a saved checkpoint in this process (no Ray): `baton eval` and `baton generate`.

A checkpoint is scored the way its run validated it: the run's tokenizer, held-out data, reward
and validation sampling (`val_sampling`), read from the `config.yaml` the pipeline wrote in its
run directory, through the pipelines' own `validate`.
"""

from __future__ import annotations

import dataclasses
import os

from baton.checkpoint import PIPELINE_STATE, has_state
from baton.config import import_object, load_config, load_yaml
from baton.pipelines.run_dir import list_checkpoints
from baton.pipelines.config import DataConfig, SamplingConfig


def resolve_checkpoint(path: str) -> str:
    """The HF model directory that `path` names: a role directory (config.json), a step directory (its
    `actor`), a run directory (its latest step), or a directory of runs (the one written last, e.g. the
    demo's `runs/demo` -> its rlvr stage)."""
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


def run_config(model_dir: str):
    """The resolved config of the run that saved `model_dir` (its run directory's config.yaml), or None."""
    checkpoints_dir = os.path.dirname(os.path.dirname(model_dir))  # <run_dir>/checkpoints/step_<N>/<role>
    path = os.path.join(os.path.dirname(checkpoints_dir), "config.yaml")
    if os.path.basename(checkpoints_dir) != "checkpoints" or not os.path.isfile(path):
        return None
    pipeline_cls = import_object(load_yaml(path)["pipeline_cls"])
    return load_config(pipeline_cls.config_cls, path)


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


def load_policy(path: str, *, temperature: float | None = None, max_new_tokens: int | None = None,
                num_samples: int | None = None) -> LoadedPolicy:
    """Build the checkpoint's model with the run's rollout settings; overrides replace `val_sampling`'s fields."""
    from baton.strategy import StrategyConfig
    from baton.strategy.hf import HFStrategy

    model_dir = resolve_checkpoint(path)
    config = run_config(model_dir)
    if config is None:  # a bare HF directory: its own tokenizer (else baton's), the default task, greedy decoding
        has_tokenizer = any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer_path = model_dir if has_tokenizer else None
        strategy_config = StrategyConfig(model=model_dir, tokenizer=tokenizer_path)
        data, sampling, reward_fn = DataConfig(), SamplingConfig(temperature=0.0, num_samples_per_prompt=1), "exact_match"
    else:
        role = getattr(config, "rollout", None) or config.actor  # what generated during the run's validation
        tokenizer_path = role.strategy.tokenizer
        strategy_config = dataclasses.replace(role.strategy, name="hf", kind="causal_lm", model=model_dir)
        data = getattr(config, "data", None) or DataConfig()
        sampling = getattr(config, "val_sampling", None) or SamplingConfig(temperature=0.0, num_samples_per_prompt=1)
        reward_fn = getattr(config, "reward_fn", "exact_match")
    overrides = {"temperature": temperature, "max_new_tokens": max_new_tokens, "num_samples_per_prompt": num_samples}
    sampling = dataclasses.replace(sampling, **{k: v for k, v in overrides.items() if v is not None})
    return LoadedPolicy(model_dir, HFStrategy(strategy_config), tokenizer_path, data, sampling, reward_fn,
                        config is not None)


def evaluate(policy: LoadedPolicy, data_path: str | None = None, reward_fn: str | None = None) -> dict:
    """Accuracy, pass@k (with several samples per prompt: `pass@2`, `pass@4`, … `pass@{n}`) and mean reward of
    `policy` on the run's held-out data (or the prompt file `data_path`), and verl's val-core metrics of each data
    source ("val-core": {"<data_source>/reward/mean@{n}": ..., ...}), as the run logged them."""
    from baton.datasets.load import load_datasets, load_prompt_file
    from baton.pipelines.policy import validate
    from baton.workers import RewardWorker

    if data_path is not None:
        val = load_prompt_file(policy.data, data_path, policy.strategy.tokenizer)
    else:
        _, val, _ = load_datasets(policy.data, policy.tokenizer_path)
        if val is None:
            raise ValueError(f"the run of {policy.model_dir} has no held-out data (data.val_path is unset); "
                             "pass --data PATH.jsonl")
    reward_fn = reward_fn or policy.reward_fn
    metrics = validate(policy.strategy, RewardWorker(reward_fn, policy.tokenizer_path), val, policy.strategy.tokenizer,
                       policy.sampling, policy.data.max_prompt_len)
    pass_at_k = {key.removeprefix("val/"): value for key, value in metrics.items() if key.startswith("val/pass@")}
    return {"checkpoint": policy.model_dir, "accuracy": metrics["val/accuracy"], **pass_at_k,
            "mean_reward": metrics["val/reward/mean"], "mean_response_length": metrics["val/response_length/mean"],
            "n": len(val), "num_samples_per_prompt": policy.sampling.num_samples_per_prompt,
            "temperature": policy.sampling.temperature, "max_new_tokens": policy.sampling.max_new_tokens,
            "reward_fn": reward_fn,
            "data": data_path or ("held-out split" if policy.data.task == "arithmetic" else policy.data.val_path),
            "val-core": {key.removeprefix("val-core/"): value for key, value in metrics.items()
                         if key.startswith("val-core/")}}


def generate(policy: LoadedPolicy, prompts: list[str], seed: int = 0) -> list[dict]:
    """{"prompt", "completion"} for each prompt and sample, `num_samples_per_prompt` per prompt in a row."""
    from baton.datasets import PromptDataset, collate_prompts

    dataset = PromptDataset([{"prompt": p, "answer": ""} for p in prompts])
    batch = collate_prompts(dataset, range(len(dataset)), policy.strategy.tokenizer)
    out = policy.strategy.generate(batch, policy.sampling.params(seed=seed))
    texts = policy.strategy.tokenizer.batch_decode(out.batch["responses"], skip_special_tokens=True)
    return [{"prompt": str(prompt), "completion": text} for prompt, text in zip(out.non_tensor_batch["prompt"], texts)]
