"""The rollout system's shipped dynamic filter, `nonzero_reward_std` (examples/dapo_dynamic.yaml): its verdict on
groups, and a step on the rollout system that over-samples, keeps the groups whose rewards differ and drops the
rest, each counted."""

from __future__ import annotations

import threading

import pytest

from baton.pipelines.base import run_pipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRPipeline
from baton.rollout import Sample
from baton.rollout.functions import nonzero_reward_std
from baton.tracking import run_metrics
from test_rollout_pipeline import tiny

THIS = "test_rollout_filters"  # tests/ is on sys.path: functions here are importable by path


def group_of(*rewards) -> list[Sample]:
    group = [Sample(0, i, "1+1=", [5], label="2") for i in range(len(rewards))]
    for sample, reward in zip(group, rewards):
        sample.reward = reward
    return group


@pytest.mark.parametrize("rewards, kept", [
    ((0.0, 1.0), True), ((1.0, 1.0, 0.5), True), ((1.0, 1.0), False), ((0.0, 0.0, 0.0), False),
    ((1.0,), False),  # one sample: no spread to learn from
    (({"score": 0.0, "len": 1.0}, {"score": 1.0, "len": 1.0}), True),  # a dict reward: its score decides
    (({"score": 1.0, "len": 0.0}, {"score": 1.0, "len": 1.0}), False),
])
def test_nonzero_reward_std_keeps_a_group_whose_rewards_differ(rewards, kept):
    assert nonzero_reward_std(None, group_of(*rewards)) == (kept, "zero_std")


REWARDED: dict[int, list[float]] = {}  # group_index -> the rewards given its samples in training
LOCK = threading.Lock()  # groups are rewarded from threads


def rewards_differ_every_fourth_group(args, sample) -> float:
    """Rewards that differ within groups 0, 4, 8, ... (the sample's place) and are all 1 in every other group."""
    reward = float(sample.sample_index) if sample.group_index % 4 == 0 else 1.0
    with LOCK:
        if not args.evaluation:
            REWARDED.setdefault(sample.group_index, []).append(reward)
    return reward


def test_the_rollout_system_keeps_the_groups_nonzero_reward_std_passes_and_counts_the_rest(tmp_path):
    REWARDED.clear()
    # Over-sampling starts 2 × the 4 groups the step needs, and no more (the limit): of those 8, the two whose
    # rewards differ pass, the 6 others are dropped, and the step trains on the two.
    config = tiny(tmp_path, num_steps=1, engines=1, reward_function=f"{THIS}:rewards_differ_every_fourth_group",
                  dynamic_filter="baton.rollout.functions:nonzero_reward_std", over_sampling_factor=2.0,
                  max_groups_started_factor=2.0)
    config.trainer.val_before_train, config.trainer.val_every_steps = False, 100
    run_pipeline(RolloutRLVRPipeline, config)
    record = run_metrics(str(tmp_path))[1]
    assert sorted(REWARDED) == list(range(8)) and all(len(rewards) == 2 for rewards in REWARDED.values())
    passing = sorted(g for g, rewards in REWARDED.items() if rewards[0] != rewards[1])
    assert passing == [0, 4]
    assert record["rollout/num_groups_started"] == 8
    assert record["rollout/num_groups"] == len(passing)
    assert record["rollout/num_dropped/zero_std"] == 8 - len(passing)
    # The trained batch is the kept groups only: each scored 0 and 1.
    assert record["critic/score/mean"] == 0.5 and record["critic/frac_reward_zero_std"] == 0.0
