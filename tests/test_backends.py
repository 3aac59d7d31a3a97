"""What a model backend can do is declared once, in `baton/strategy/capabilities.py`, and asked there: no code in
baton/ compares a backend's name or class name, and a strategy given by import path is held to what its class
declares."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from baton.config import ConfigError, import_object
from baton.engines.hf import HFEngine
from baton.engines.hf import serve as serve_hf
from baton.pipelines.config import DataConfig, RoleConfig, SFTConfig, TrainerConfig
from baton.pipelines.preflight import check_roles
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig
from baton.rollout.engine_worker import EngineWorker
from baton.strategy import BACKENDS, Capabilities, StrategyConfig, capabilities, strategy_class
from baton.strategy.capabilities import backends_that, can_share_weights
from baton.strategy.hf import HFStrategy
from baton.strategy.mock import MockStrategy
from baton.workers.weight_sync import probe_batch

PACKAGE = Path(__file__).resolve().parent.parent / "baton"
REGISTRY = PACKAGE / "strategy" / "capabilities.py"


def strategy_class_names() -> set[str]:
    """The registered strategies' classes and the classes they build on (`TorchStrategy`), by name."""
    return {cls.__name__ for backend in BACKENDS for cls in inspect.getmro(strategy_class(backend)) if cls is not object}


BACKEND_NAMES = set(BACKENDS) | strategy_class_names()


def name_tests(source: str, names: set[str] = BACKEND_NAMES) -> list[str]:
    """Where `source` decides by a backend's name or class: a comparison (==, !=, in, is) with one of `names` (alone,
    or in a tuple, list or set), or with a `__name__`; a collection literal of strings that lists one (a name table,
    the comparison's other half); a `case` on one; an `isinstance` / `issubclass` on one of the classes."""
    def is_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def lists_name(node: ast.AST) -> bool:
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in node.elts)

    def class_named(node: ast.AST) -> bool:
        leaves = node.elts if isinstance(node, ast.Tuple) else [node]
        return any(isinstance(leaf, ast.Name) and leaf.id in names or isinstance(leaf, ast.Attribute) and leaf.attr in names
                   for leaf in leaves)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_name(o) or lists_name(o) or isinstance(o, ast.Attribute) and o.attr == "__name__" for o in operands):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and lists_name(node) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.MatchValue) and is_name(node.value):
            found.append(f"{node.lineno}: case {ast.unparse(node.value)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass")
              and len(node.args) == 2 and class_named(node.args[1])):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("source", [
    'if config.name == "vllm": pass',
    'share = a.name == b.name == "hf"',
    'if strategy.name not in ("hf", "fsdp2"): pass',
    'ENGINE_STRATEGIES = ("hf", "vllm")',
    'ok = type(strategy).__name__ == "TorchStrategy"',
    'ok = isinstance(worker.strategy, HFStrategy)',
    'match name:\n    case "mock": pass',
])
def test_the_check_finds_each_way_of_testing_a_backend_by_name(source):
    assert name_tests(source), f"missed: {source}"


def test_the_check_leaves_other_strings_and_the_main_guard_alone():
    assert not name_tests('if __name__ == "__main__": pass\nfor name in ("actor", "rollout"): pass\n'
                          'if sched.name not in ("constant", "linear"): pass\nconfig = replace(s, name="hf")')


def test_no_code_in_baton_decides_by_a_backend_name_outside_the_registry():
    assert len(BACKEND_NAMES) >= 8, "the registry's names and classes were not found"
    found = [f"{path.relative_to(PACKAGE.parent)}:{hit}" for path in sorted(PACKAGE.rglob("*.py")) if path != REGISTRY
             for hit in name_tests(path.read_text())]
    assert not found, ("backends tested by name; ask baton.strategy.capabilities (capabilities(name).<what>, "
                       "backends_that, can_share_weights) instead:\n" + "\n".join(found))


def test_every_registry_path_names_what_it_says():
    for name in BACKENDS:
        assert inspect.isclass(strategy_class(name)), name
        can = capabilities(name)
        for path in (can.engine, can.check_installed):
            if path is not None:
                assert callable(import_object(path)), path
    assert backends_that("serves_requests") == ["hf", "vllm"]
    assert backends_that("trains_over_workers") == ["fsdp2"]
    assert can_share_weights("hf", "hf") and not can_share_weights("fsdp2", "hf") and not can_share_weights("mock", "mock")


# --- a strategy given by import path declares its own ------------------------------------------------------


class ShardedMock(MockStrategy):
    """Declares that it trains one model over several workers (as a sharded backend would)."""

    capabilities = Capabilities(trains_over_workers=True)


SERVED: list[int] = []


def serve_and_record(config: StrategyConfig, max_num_seqs: int):
    SERVED.append(max_num_seqs)
    return serve_hf(dataclasses.replace(config, name="hf"), max_num_seqs)


class ServingMock(MockStrategy):
    """Declares a request-level engine of its own: the hf engine, built through `serve_and_record`."""

    capabilities = Capabilities(engine=f"{__name__}:serve_and_record")


def sft_on(strategy: str, world_size: int) -> SFTConfig:
    return SFTConfig(actor=RoleConfig(strategy=StrategyConfig(name=strategy), world_size=world_size),
                     data=DataConfig(max_operand=9, num_val_examples=4), trainer=TrainerConfig(backend="local"))


def test_a_declared_capability_of_an_import_path_strategy_decides_the_preflight():
    config = sft_on(f"{__name__}:ShardedMock", world_size=2)
    assert capabilities(config.actor.strategy.name).trains_over_workers
    check_roles(config, config.trainer)  # one model over two workers: allowed
    undeclared = sft_on("baton.strategy.mock:MockStrategy", world_size=2)  # the default: a model per worker
    with pytest.raises(ConfigError, match=r"'baton.strategy.mock:MockStrategy' with 2 actor workers.*=fsdp2"):
        check_roles(undeclared, undeclared.trainer)


def test_a_declared_engine_of_an_import_path_strategy_is_what_the_rollout_system_serves():
    served = StrategyConfig(name=f"{__name__}:ServingMock", model="tiny-qwen2", seed=0)
    RolloutRLVRConfig(rollout=RoleConfig(strategy=served)).check()
    with pytest.raises(ConfigError, match=r"serve requests, which hf, vllm do"):
        RolloutRLVRConfig(rollout=RoleConfig(strategy=StrategyConfig(name=f"{__name__}:ShardedMock"))).check()
    with pytest.raises(ValueError, match=r"serves requests \(hf, vllm\), not '.*ShardedMock'"):
        EngineWorker(StrategyConfig(name=f"{__name__}:ShardedMock"))

    SERVED.clear()
    worker = EngineWorker(served, max_num_seqs=8)
    assert SERVED == [8] and isinstance(worker.engine, HFEngine)
    # The sync probe's log-probs come from the engine's own model, no training strategy built around it, and agree
    # with the hf strategy's on the same weights.
    assert not hasattr(worker, "strategy")
    strategy = HFStrategy(dataclasses.replace(served, name="hf"))
    probe = probe_batch(strategy.tokenizer, ["1+2=3", "hello there", "x=1"], 2)
    ours = worker.compute_log_probs(probe).batch["log_probs"]
    want = strategy.forward(probe).batch["log_probs"]
    assert ours.shape == want.shape and torch.allclose(ours, want, atol=1e-5)
    worker.runner.run(worker.engine.close())
