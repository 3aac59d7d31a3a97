"""Every extension point takes the user's own object by import path ("package.module:attr"), checked with the config
before anything starts and used in a real run: an advantage estimator (with the needs it declared where it registered
itself), a policy loss, a KL estimator, a rollout correction, a reward, an environment, the rollout system's
functions, a dispatch mode, a distillation loss."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from baton.algorithms import ADV_ESTIMATORS, estimator_needs
from baton.config import ConfigError
from baton.distributed import Cluster, ResourceManager, Worker, WorkerConfig, register
from baton.distributed.dispatch import DispatchMode
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import AlgorithmConfig
from baton.pipelines.rlvr import RLVRPipeline
from test_pipeline_paths import metrics_of, tiny_rlvr

# The user's module: each object is named below by its import path only. The estimator registers itself, with what
# it needs, under a name of its own; the other objects are plain functions.
USER_MODULE = "userplugins"
USER_SOURCE = '''
import torch

from baton.algorithms import EstimatorNeeds, agg_loss, grpo, register_adv_estimator


@register_adv_estimator("userplugins.half", EstimatorNeeds(groups=True))
def half_advantages(token_level_rewards, response_mask, index):
    """GRPO's returns, and an advantage of 0.5 on every token: a value the run's metrics show."""
    _, returns = grpo(token_level_rewards, response_mask, index)
    return 0.5 * response_mask.float(), returns


def marked_loss(log_probs, old_log_probs, advantages, response_mask, loss_agg_mode="token-mean",
                loss_scale_factor=None, token_weights=None):
    weights = 1.0 if token_weights is None else token_weights
    return agg_loss(-advantages * log_probs * weights, response_mask, loss_agg_mode), {"user_loss_marker": 3.0}


def constant_kl(log_probs, ref_log_probs):
    return torch.zeros_like(log_probs) + 0.25


def unit_correction(old_log_probs, rollout_log_probs, response_mask):
    tokens = float(response_mask.sum())
    return response_mask.float(), {"rollout_corr/user_marker": (4.0 * tokens, tokens)}


def marked_reward(response, ground_truth, **fields):
    return {"score": float(len(response.strip()) % 3 == 0), "user_marker": 2.0}
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    directory = tmp_path_factory.mktemp("user")
    (directory / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_SOURCE))
    sys.path.insert(0, str(directory))
    yield USER_MODULE
    sys.path.remove(str(directory))
    sys.modules.pop(USER_MODULE, None)
    ADV_ESTIMATORS.pop("userplugins.half")


def user_algorithm(**changes) -> AlgorithmConfig:
    settings = dict(adv_estimator=f"{USER_MODULE}:half_advantages", policy_loss=f"{USER_MODULE}:marked_loss",
                    use_kl_loss=True, kl_loss_coef=0.1, kl_loss_estimator=f"{USER_MODULE}:constant_kl",
                    rollout_correction=f"{USER_MODULE}:unit_correction")
    return AlgorithmConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def user_run(user_module, tmp_path_factory):
    """One RLVR step on the local backend whose estimator, policy loss, KL estimator, rollout correction and reward
    are all the user module's, each named by import path: its metrics."""
    run_dir = tmp_path_factory.mktemp("run")
    run_pipeline(RLVRPipeline, tiny_rlvr(run_dir, num_steps=1, algorithm=user_algorithm(),
                                         reward_fn=f"{user_module}:marked_reward"))
    [record] = metrics_of(run_dir)
    return record


# ---- the algorithm's plug-ins and the reward, in a run ---------------------------------------------------------


def test_an_estimator_by_import_path_trains_and_its_registered_needs_are_checked(user_module, user_run, tmp_path):
    assert user_run["critic/advantages/mean"] == pytest.approx(0.5)
    path = f"{user_module}:half_advantages"
    assert estimator_needs(path).groups and estimator_needs("userplugins.half") is estimator_needs(path)
    config = tiny_rlvr(tmp_path, algorithm=user_algorithm())
    config.sampling.num_samples_per_prompt = 1
    with pytest.raises(ConfigError, match=f"algorithm.adv_estimator '{path}' compares each prompt's samples"):
        RLVRPipeline.dry_run(config)  # the needs its registration declared, found from the path


def test_a_policy_loss_by_import_path_trains(user_run):
    assert user_run["actor/user_loss_marker"] == pytest.approx(3.0)


def test_a_kl_estimator_by_import_path_is_the_kl_loss(user_run):
    assert user_run["actor/kl"] == pytest.approx(0.25)


def test_a_rollout_correction_by_import_path_weighs_the_loss(user_run):
    assert user_run["rollout_corr/user_marker"] == pytest.approx(4.0)


def test_a_reward_by_import_path_scores_the_run(user_run):
    assert user_run["reward/user_marker/mean"] == pytest.approx(2.0)


@pytest.mark.parametrize("key, value, message", [
    ("adv_estimator", "grop", r"algorithm.adv_estimator 'grop' is not one of \[.*\] or an import path "
                              r"'package.module:attr'; did you mean 'grpo'\?"),
    ("policy_loss", "gsop", r"algorithm.policy_loss 'gsop' is not one of .*; did you mean 'gspo'\?"),
    ("kl_loss_estimator", "k33", r"algorithm.kl_loss_estimator 'k33' is not one of .*; did you mean 'k3'\?"),
    ("rollout_correction", "token_tsi", r"algorithm.rollout_correction 'token_tsi' is not one of .*; did you mean "
                                        r"'token_tis'\?"),
    ("adv_estimator", "userplugins:nope", r"algorithm.adv_estimator: advantage estimator 'userplugins:nope' cannot "
                                          r"be imported: 'userplugins' has no attribute 'nope'"),
    ("policy_loss", "no_such_module:loss", r"algorithm.policy_loss: policy loss 'no_such_module:loss' cannot be "
                                           r"imported: no module named 'no_such_module'"),
])
def test_a_wrong_name_or_path_fails_the_check_before_anything_starts(user_module, tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message):
        RLVRPipeline.dry_run(tiny_rlvr(tmp_path, algorithm=user_algorithm(**{key: value})))


def test_a_wrong_reward_fails_the_check_with_the_nearest_name(tmp_path):
    with pytest.raises(ConfigError, match=r"reward_fn: unknown reward 'exact_mach'; .*did you mean 'exact_match'\?"):
        RLVRPipeline.dry_run(tiny_rlvr(tmp_path, reward_fn="exact_mach"))


# ---- environments ---------------------------------------------------------------------------------------------


def test_an_environment_by_name_or_import_path_runs_in_its_process():
    from baton.agentic import AgenticSettings, EnvPool

    async def first_answer(pool: EnvPool, seed: int) -> tuple[str, str]:
        observation = await pool.reset("a", seed)
        answer, *_ = await pool.step("a", "answer 0")
        await pool.close("a")
        return observation, answer

    for env in ("calculator", "baton.agentic.env:CalculatorEnv", "agentic_envs:FlakyEnv"):
        pool = EnvPool(env, num_processes=1)
        try:
            observation, answer = asyncio.run(first_answer(pool, 0))
        finally:
            pool.close_pool()
        assert observation.startswith("what is" if "alc" in env else "guess 1-") and answer
    assert AgenticSettings(env="agentic_envs:FlakyEnv").env == "agentic_envs:FlakyEnv"
    with pytest.raises(ConfigError, match=r"agentic.env 'calculater' is not one of \['calculator', 'guess_number'\] "
                                          r"or an import path 'package.module:attr'; did you mean 'calculator'\?"):
        AgenticSettings(env="calculater")


def test_an_environment_a_fresh_process_cannot_import_is_refused():
    from baton.agentic import ENVIRONMENTS, EnvPool, GuessNumberEnv

    class Local(GuessNumberEnv):
        pass

    ENVIRONMENTS["test_registry_paths.local"] = Local
    try:
        with pytest.raises(ValueError, match="which an environment process cannot import; define it at the top level"):
            EnvPool("test_registry_paths.local")
    finally:
        ENVIRONMENTS.pop("test_registry_paths.local")


# ---- the rollout system's functions ---------------------------------------------------------------------------


def test_the_rollout_functions_are_names_or_import_paths_checked_when_the_config_is_built():
    from baton.rollout.config import PLUGINS, RolloutSystemConfig

    config = RolloutSystemConfig(rollout_function="sft_rollout", generate_function="generate_sample",
                                 dynamic_filter="baton.rollout.functions:nonzero_reward_std",
                                 buffer_filter="take_first")
    assert PLUGINS["rollout_function"].get(config.rollout_function).__name__ == "sft_rollout"
    with pytest.raises(ConfigError, match=r"rollout_system.rollout_function 'sft_rolout' is not one of "
                                          r"\['generate_rollout', 'sft_rollout'\] .*; did you mean 'sft_rollout'\?"):
        RolloutSystemConfig(rollout_function="sft_rolout")
    with pytest.raises(ConfigError, match=r"rollout_system.dynamic_filter: dynamic filter "
                                          r"'baton.rollout.functions:nonzero_std' cannot be imported"):
        RolloutSystemConfig(dynamic_filter="baton.rollout.functions:nonzero_std")


def test_a_buffer_filter_by_name_picks_the_groups():
    from baton.datasets import arithmetic_splits
    from baton.models import load_tokenizer
    from baton.rollout import RolloutDataSource

    source = RolloutDataSource(arithmetic_splits(max_operand=3, num_val=4)[0], load_tokenizer(None),
                               num_samples_per_prompt=2, buffer_filter="take_first")
    first = source.get_samples(2)
    source.add_samples(first)
    assert source.get_samples(1) == first[:1]  # the oldest buffered group, as take_first takes them


# ---- dispatch modes and the other losses ----------------------------------------------------------------------

def _to_every_rank(layout, args, kwargs):
    return [(args, kwargs)] * layout.world_size


SUM_MODE = DispatchMode("test_registry_paths.sum", _to_every_rank, lambda layout, outputs: sum(outputs))  # unregistered
A_NAME = "one_to_all"


class Ranks(Worker):
    @register(dispatch_mode=f"{__name__}:SUM_MODE")
    def times(self, k):
        return self.rank * k


def test_a_dispatch_mode_by_import_path_splits_the_call():
    manager = ResourceManager(1, 3, backend="local")
    try:
        with Cluster(Ranks, WorkerConfig("ranks", world_size=3), manager) as cluster:
            assert cluster.times(2) == (0 + 1 + 2) * 2
    finally:
        manager.shutdown()
    with pytest.raises(ValueError, match=f"dispatch mode '{__name__}:A_NAME' is a str, not a DispatchMode"):
        register(dispatch_mode=f"{__name__}:A_NAME")


def test_a_distillation_loss_by_import_path_passes_the_check(tmp_path):
    from test_distill import tiny_distill

    config = tiny_distill(tmp_path)
    config.algorithm.loss_type = "baton.algorithms.distill:forward_kl"
    config.check()
    config.algorithm.loss_type = "reverse_kll"
    with pytest.raises(ConfigError, match=r"algorithm.loss_type 'reverse_kll' is not one of .*; did you mean "
                                          r"'reverse_kl'\?"):
        config.check()
