"""The configuration loader: strict typed building, overrides, merging, YAML round trips, import paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
import yaml

from baton.config import (
    ConfigError,
    apply_overrides,
    deep_merge,
    dump_yaml,
    from_dict,
    import_object,
    load_config,
    load_yaml,
    to_dict,
)
from baton.distributed.cluster import WorkerConfig
from baton.strategy.base import OptimizerConfig, SchedulerConfig, StrategyConfig


@dataclass
class RoleConfig:
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    workers: WorkerConfig = field(default_factory=lambda: WorkerConfig("actor", world_size=1))


@dataclass
class DataConfig:
    path: str  # required
    split: Literal["train", "test"] = "train"
    num_prompts_per_step: int = 8

    def __post_init__(self):
        if self.num_prompts_per_step < 1:
            raise ValueError(f"num_prompts_per_step={self.num_prompts_per_step} must be >= 1")


@dataclass
class PipelineConfig:
    data: DataConfig
    actor: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig | None = None
    rollouts: list[WorkerConfig] = field(default_factory=list)
    tags: dict[str, float] = field(default_factory=dict)
    seed: int = 0


def test_strategy_config_from_nested_dict_with_tuple_betas_from_yaml(tmp_path):
    (tmp_path / "s.yaml").write_text(
        "name: fsdp2\n"
        "model: {base: tiny-qwen2, hidden_size: 64}\n"
        "optimizer:\n  lr: 3.0e-6\n  betas: [0.9, 0.95]\n  weight_decay: 0\n"
        "scheduler: {name: cosine, warmup_steps: 10, total_steps: 100}\n"
        "grad_clip: null\n"
    )
    config = from_dict(StrategyConfig, load_yaml(tmp_path / "s.yaml"))
    assert config.name == "fsdp2"
    assert config.model == {"base": "tiny-qwen2", "hidden_size": 64}
    assert config.optimizer == OptimizerConfig(lr=3e-6, betas=(0.9, 0.95), weight_decay=0.0)
    assert isinstance(config.optimizer.betas, tuple) and isinstance(config.optimizer.weight_decay, float)
    assert config.scheduler == SchedulerConfig(name="cosine", warmup_steps=10, total_steps=100)
    assert config.grad_clip is None
    assert config.micro_batch_size_per_worker is None and config.logprob_chunk_size is None  # defaults kept


def test_str_or_dict_union_takes_either():
    assert from_dict(StrategyConfig, {"model": "tiny-qwen2"}).model == "tiny-qwen2"
    with pytest.raises(ConfigError, match=r"'model': expected str \| dict, got int 3"):
        from_dict(StrategyConfig, {"model": 3})


def test_worker_config_required_name_lists_tuples_and_dicts():
    config = from_dict(
        WorkerConfig,
        {"name": "rollout", "device_mapping": [0, 1, 2, 3], "num_devices_per_worker": 2,
         "num_cpus_per_worker": 2, "share_devices_with": ["actor"], "env_vars": {"NCCL_DEBUG": "WARN"}},
    )
    assert config == WorkerConfig(
        "rollout", device_mapping=[0, 1, 2, 3], num_devices_per_worker=2, num_cpus_per_worker=2.0,
        share_devices_with=("actor",), env_vars={"NCCL_DEBUG": "WARN"},
    )
    with pytest.raises(ConfigError, match=r"missing required key 'name' \(str\)"):
        from_dict(WorkerConfig, {"world_size": 2})


def test_nested_pipeline_tree_with_optional_role_and_list_of_dataclasses():
    config = from_dict(PipelineConfig, {
        "data": {"path": "gsm8k"},
        "critic": {"strategy": {"kind": "value"}},
        "rollouts": [{"name": "vllm", "world_size": 2}, {"name": "sglang"}],
        "tags": {"lr_scale": 2},
    })
    assert config.critic.strategy.kind == "value" and config.critic.workers.name == "actor"
    assert config.rollouts == [WorkerConfig("vllm", world_size=2), WorkerConfig("sglang")]
    assert config.tags == {"lr_scale": 2.0}
    assert from_dict(PipelineConfig, {"data": {"path": "x"}}).critic is None


def test_unknown_key_at_depth_names_path_and_nearest_key():
    data = {"data": {"path": "x"}, "actor": {"strategy": {"optimzer": {"lr": 1e-6}}}}
    with pytest.raises(ConfigError, match=r"unknown key 'actor.strategy.optimzer'; did you mean 'actor.strategy.optimizer'\?"):
        from_dict(PipelineConfig, data)
    with pytest.raises(ConfigError, match=r"unknown key 'critic.strategy.optimizer.betass'; did you mean 'critic.strategy.optimizer.betas'\?"):
        from_dict(PipelineConfig, {"data": {"path": "x"}, "critic": {"strategy": {"optimizer": {"betass": [0.9, 0.9]}}}})
    with pytest.raises(ConfigError, match=r"unknown key 'rollouts\[1\].nme'; did you mean 'rollouts\[1\].name'\?"):
        from_dict(PipelineConfig, {"data": {"path": "x"}, "rollouts": [{"name": "a"}, {"nme": "b"}]})


def test_unknown_key_with_nothing_close_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'data.zzz'; valid keys under 'data': path, split, num_prompts_per_step"):
        from_dict(PipelineConfig, {"data": {"path": "x", "zzz": 1}})
    with pytest.raises(ConfigError, match=r"unknown key 'qqq'; valid keys: data, actor, critic, rollouts, tags, seed"):
        from_dict(PipelineConfig, {"data": {"path": "x"}, "qqq": 1})


@pytest.mark.parametrize(
    "data, message",
    [
        ({"seed": "3"}, r"'seed': expected int, got str '3'"),
        ({"seed": True}, r"'seed': expected int, got bool True"),
        ({"seed": 1.5}, r"'seed': expected int, got float 1.5"),
        ({"actor": [1, 2]}, r"'actor': expected RoleConfig, got list \[1, 2\]"),
        ({"actor": {"strategy": {"optimizer": {"lr": "fast"}}}}, r"'actor.strategy.optimizer.lr': expected float, got str 'fast'"),
        ({"actor": {"strategy": {"optimizer": {"betas": [0.9]}}}}, r"'actor.strategy.optimizer.betas': expected tuple\[float, float\], got list \[0.9\]"),
        ({"actor": {"strategy": {"optimizer": {"betas": [0.9, "x"]}}}}, r"'actor.strategy.optimizer.betas\[1\]': expected float, got str 'x'"),
        ({"actor": {"workers": {"name": "a", "device_mapping": [0, "1"]}}}, r"'actor.workers.device_mapping\[1\]': expected int, got str '1'"),
        ({"actor": {"workers": {"name": "a", "world_size": "2"}}}, r"'actor.workers.world_size': expected int \| None, got str '2'"),
        ({"tags": {"a": "b"}}, r"'tags.a': expected float, got str 'b'"),
        ({"tags": [1]}, r"'tags': expected dict\[str, float\], got list \[1\]"),
        ({"actor": {"strategy": {"gradient_checkpointing": 1}}}, r"'actor.strategy.gradient_checkpointing': expected bool, got int 1"),
    ],
)
def test_wrong_types_name_path_expected_type_and_value(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(PipelineConfig, {"data": {"path": "x"}, **data})


def test_missing_required_field_names_path():
    with pytest.raises(ConfigError, match=r"missing required key 'data.path' \(str\)"):
        from_dict(PipelineConfig, {"data": {}})
    with pytest.raises(ConfigError, match=r"missing required key 'data'"):
        from_dict(PipelineConfig, {})


def test_literal_violation():
    with pytest.raises(ConfigError, match=r"'data.split': expected one of 'train', 'test', got str 'validation'"):
        from_dict(PipelineConfig, {"data": {"path": "x", "split": "validation"}})


def test_post_init_error_is_wrapped_with_path():
    with pytest.raises(ConfigError, match=r"^'data': num_prompts_per_step=0 must be >= 1$"):
        from_dict(PipelineConfig, {"data": {"path": "x", "num_prompts_per_step": 0}})
    with pytest.raises(ConfigError, match=r"^'critic.strategy': strategy kind 'policy' is not one of"):
        from_dict(PipelineConfig, {"data": {"path": "x"}, "critic": {"strategy": {"kind": "policy"}}})
    with pytest.raises(ConfigError, match=r"^StrategyConfig: set micro_batch_size_per_worker or max_tokens_per_microbatch, not both"):
        from_dict(StrategyConfig, {"micro_batch_size_per_worker": 2, "max_tokens_per_microbatch": 512})


def test_overrides_nested_numbers_lists_booleans_and_strings():
    data = {"data": {"path": "x"}, "actor": {"strategy": {"optimizer": {"lr": 1e-6}}}}
    out = apply_overrides(data, [
        "actor.strategy.optimizer.lr=1e-5",          # YAML 1.1 reads this as a string
        "actor.strategy.optimizer.betas=[0.9, 1e-2]",
        "actor.strategy.gradient_checkpointing=true",
        "actor.workers.device_mapping=[0,1]",
        "actor.workers.name=hf",
        "actor.workers.env_vars.RANK=0",            # a str field keeps the text
        "critic.strategy.scheduler.total_steps=100",  # through an Optional dataclass that is not in the data
        "tags.warmup=2e-1",
        "seed=7",
    ], PipelineConfig)
    assert data["actor"]["strategy"]["optimizer"] == {"lr": 1e-6}  # input untouched
    config = from_dict(PipelineConfig, out)
    assert config.actor.strategy.optimizer.lr == 1e-5
    assert config.actor.strategy.optimizer.betas == (0.9, 0.01)
    assert config.actor.strategy.gradient_checkpointing is True
    assert config.actor.workers.device_mapping == [0, 1] and config.actor.workers.name == "hf"
    assert config.actor.workers.env_vars == {"RANK": "0"}
    assert config.critic.strategy.scheduler.total_steps == 100
    assert config.tags == {"warmup": 0.2} and config.seed == 7


def test_exponent_numbers_are_floats_in_files_and_overrides_but_quoted_strings_stay_strings(tmp_path):
    # YAML 1.1 (PyYAML's safe_load) reads `1e-5` as the string "1e-5"; configs read it as YAML 1.2 does.
    (tmp_path / "run.yaml").write_text("lr: 1e-5\neps: 1E-8\nweight_decay: '1e-2'\n")
    data = load_yaml(tmp_path / "run.yaml")
    assert data["lr"] == 1e-5 and data["eps"] == 1e-8 and data["weight_decay"] == "1e-2"
    assert yaml.safe_load("lr: 1e-5") == {"lr": "1e-5"}  # the global loader is left alone
    with pytest.raises(ConfigError, match=r"'weight_decay': expected float, got str '1e-2'"):
        from_dict(OptimizerConfig, data)
    out = apply_overrides({}, ["seed=1e3"], PipelineConfig)  # an int field does not take a float
    with pytest.raises(ConfigError, match=r"'seed': expected int, got float 1000.0"):
        from_dict(PipelineConfig, {"data": {"path": "x"}, **out})


def test_override_null_and_dict_values():
    out = apply_overrides({"actor": {"strategy": {"grad_clip": 1.0, "model": "tiny-qwen2"}}},
                          ["actor.strategy.grad_clip=null", "actor.strategy.model={base: tiny-qwen2, hidden_size: 32}"],
                          PipelineConfig)
    assert out["actor"]["strategy"] == {"grad_clip": None, "model": {"base": "tiny-qwen2", "hidden_size": 32}}


def test_unknown_override_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"unknown key 'actor.strategy.optimzer'; did you mean 'actor.strategy.optimizer'\?"):
        apply_overrides({}, ["actor.strategy.optimzer.lr=1e-5"], PipelineConfig)
    with pytest.raises(ConfigError, match=r"unknown key 'critic.stratgy'; did you mean 'critic.strategy'\?"):
        apply_overrides({}, ["critic.stratgy.kind=value"], PipelineConfig)
    with pytest.raises(ConfigError, match=r"'seed' is int, it has no key 'value'"):
        apply_overrides({}, ["seed.value=1"], PipelineConfig)


def test_override_into_a_non_mapping_value_is_an_error():
    with pytest.raises(ConfigError, match=r"'actor.strategy.model' is str 'tiny-qwen2', not a mapping"):
        apply_overrides({"actor": {"strategy": {"model": "tiny-qwen2"}}}, ["actor.strategy.model.hidden_size=8"], PipelineConfig)


@pytest.mark.parametrize("item", ["seed", "=3", "actor..seed=1", "seed:3"])
def test_malformed_override(item):
    with pytest.raises(ConfigError, match=r"is not of the form key.sub=value"):
        apply_overrides({}, [item], PipelineConfig)


def test_deep_merge_does_not_touch_its_inputs():
    base = {"a": {"b": 1, "c": [1]}, "d": 1}
    merged = deep_merge(base, {"a": {"b": 2}, "e": 3})
    assert merged == {"a": {"b": 2, "c": [1]}, "d": 1, "e": 3}
    merged["a"]["c"].append(2)
    assert base == {"a": {"b": 1, "c": [1]}, "d": 1}


def test_load_config_precedence_defaults_then_file_then_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "data: {split: test}\n"
        "actor:\n  strategy:\n    optimizer: {lr: 2.0e-6}\n    dtype: bfloat16\n"
    )
    defaults = {"data": {"path": "gsm8k", "split": "train"}, "seed": 1,
                "actor": {"strategy": {"optimizer": {"lr": 1.0e-6, "eps": 1.0e-6}, "dtype": "float16"}}}
    config = load_config(PipelineConfig, tmp_path / "run.yaml", ["actor.strategy.dtype=float32", "seed=2"], defaults=defaults)
    assert config.data == DataConfig(path="gsm8k", split="test")                      # default + file
    assert config.actor.strategy.optimizer == OptimizerConfig(lr=2e-6, eps=1e-6)     # file over default, default kept
    assert config.actor.strategy.dtype == "float32" and config.seed == 2            # override over file and default
    assert load_config(PipelineConfig, None, ["data.path=x"]).data.path == "x"


def test_load_config_reports_unknown_file_key(tmp_path):
    (tmp_path / "run.yaml").write_text("data: {path: x}\nactr: {}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'actr'; did you mean 'actor'\?"):
        load_config(PipelineConfig, tmp_path / "run.yaml")


def test_dump_yaml_round_trip_equals_original(tmp_path):
    original = PipelineConfig(
        data=DataConfig(path="gsm8k", split="test", num_prompts_per_step=64),
        actor=RoleConfig(
            strategy=StrategyConfig(model={"base": "tiny-qwen2", "hidden_size": 64},
                                    optimizer=OptimizerConfig(lr=1e-5, betas=(0.9, 0.95)),
                                    grad_clip=None, micro_batch_size_per_worker=4),
            workers=WorkerConfig("actor", device_mapping=[0, 1], share_devices_with=("rollout",), env_vars={"A": "1"}),
        ),
        critic=RoleConfig(strategy=StrategyConfig(kind="value")),
        rollouts=[WorkerConfig("rollout", world_size=2)],
        tags={"x": 0.5},
    )
    text = dump_yaml(original)
    assert "betas:\n      - 0.9\n      - 0.95\n" in text and "lr: 1.0e-05" in text
    (tmp_path / "dumped.yaml").write_text(text)
    assert from_dict(PipelineConfig, load_yaml(tmp_path / "dumped.yaml")) == original
    assert to_dict(original)["actor"]["workers"]["share_devices_with"] == ["rollout"]


def test_load_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope.yaml' does not exist"):
        load_yaml(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+:\d+: invalid YAML"):
        load_yaml(tmp_path / "bad.yaml")
    (tmp_path / "tabs.yaml").write_text("a:\n  b: 1\n\tc: 2\n")
    with pytest.raises(ConfigError, match=r"tabs.yaml:3:1: invalid YAML"):
        load_yaml(tmp_path / "tabs.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"the top level must be a mapping"):
        load_yaml(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    assert load_yaml(tmp_path / "empty.yaml") == {}


def test_import_object():
    assert import_object("baton.strategy.base:StrategyConfig") is StrategyConfig
    assert import_object("baton.config.loader:ConfigError.__init__") is ConfigError.__init__
    with pytest.raises(ConfigError, match=r"not of the form 'package.module:Name'"):
        import_object("baton.strategy.base.StrategyConfig")
    with pytest.raises(ConfigError, match=r"no module named 'baton.strategy.nope'"):
        import_object("baton.strategy.nope:X")
    with pytest.raises(ConfigError, match=r"'baton.strategy.base' has no attribute 'StrategyConfg'; did you mean 'StrategyConfig'\?"):
        import_object("baton.strategy.base:StrategyConfg")


def test_override_value_that_is_not_yaml():
    with pytest.raises(ConfigError, match=r"override 'seed=\[1,': the value is not valid YAML"):
        apply_overrides({}, ["seed=[1,"], PipelineConfig)
