"""The staleness ledger (`baton.rollout.staleness`): its definition, its gate, and property tests over random
schedules of an async producer driven through it, as `RolloutProducer` drives it: groups admitted, tokens sampled
while the weights move on, groups finished, filtered out, aborted (partial rollouts kept or not), steps taking their
groups, weight syncs, and checkpoint round trips. Whatever the order, no trained token exceeds the bound and every
group is in exactly one place (trained once, in the buffer, running, ready, or filtered out)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.checkpoint import PIPELINE_STATE, load_state
from baton.pipelines.base import run_pipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRPipeline
from baton.rollout.config import RolloutSystemConfig, STALE_POLICIES
from baton.rollout.functions import generate_sample, reset_sample
from baton.rollout.sample import Sample, Status
from baton.rollout.staleness import GroupSet, StalenessLedger
from baton.strategy import SamplingParams
from baton.tracking import read_metrics, run_metrics
from conftest import wait_until

MANY = settings(max_examples=100, deadline=None)


def sample(group_index=0, versions=(), mask=None, sample_index=0) -> Sample:
    n = len(versions)
    return Sample(group_index=group_index, sample_index=sample_index, prompt="p", prompt_ids=[1],
                  response_ids=[5] * n, rollout_log_probs=[-1.0] * n, weight_versions=list(versions),
                  loss_mask=mask, status=Status.COMPLETED, reward=1.0)


def test_staleness_counts_trained_tokens_only():
    ledger = StalenessLedger(max_staleness=1)
    mixed = sample(versions=[2, -1, 4], mask=[1, 0, 1])  # an environment token between two of the model's
    assert ledger.token_staleness(mixed, 5) == [3, None, 1]
    masked = sample(versions=[0, 4], mask=[0, 1])  # a stale prefix already out of the loss
    assert ledger.staleness([masked], 5) == 1 and not ledger.over([masked], 5)
    assert ledger.staleness([sample(versions=[-1]), sample(versions=[])], 5) == 0
    assert ledger.over([mixed], 5) and ledger.admits(trained_version=5, engine_version=4)
    assert not ledger.admits(trained_version=5, engine_version=3)


@pytest.mark.parametrize("policy", STALE_POLICIES)
def test_each_policy_settles_a_stale_group(policy):
    ledger = StalenessLedger(max_staleness=1, policy=policy)
    fresh, stale = [sample(0, [3, 3])], [sample(1, [1, 2, 3], sample_index=0), sample(1, [3], sample_index=1)]
    trains, back = ledger.settle([fresh, stale], trained_version=3)
    if policy == "withhold":  # the group trains, its token two versions old out of the loss
        assert trains == [fresh, stale] and back == []
        assert stale[0].loss_mask == [0, 1, 1] and stale[1].loss_mask is None
        assert ledger.metrics() == {"rollout/staleness/withheld_tokens": 1.0}
    else:  # back to the buffer as fresh prompts
        assert trains == [fresh] and back == [stale]
        assert all(s.status == Status.PENDING and s.response_ids == [] and s.reward is None for s in stale)
        assert ledger.metrics() == {"rollout/staleness/dropped_groups": 1.0}
    ledger.check(trains, trained_version=3)


def test_pace_restarts_a_partial_sample_too_old_for_its_planned_step():
    ledger = StalenessLedger(max_staleness=1, policy="pace")
    old, recent = sample(0, [0, 0], sample_index=0), sample(0, [2], sample_index=1)
    old.status = recent.status = Status.PENDING  # partial rollouts back in the buffer
    assert ledger.prepare([old, recent], trained_version=3) == 1
    assert old.response_ids == [] and recent.weight_versions == [2]
    assert StalenessLedger(1, "drop").prepare([recent], trained_version=9) == 0  # only "pace" restarts early


def test_pace_hands_each_step_the_groups_admitted_for_it():
    ledger = StalenessLedger(max_staleness=1, policy="pace")
    first, second, third = [sample(7, [2])], [sample(3, [1])], [sample(5, [2])]
    admitted = {7: 0, 3: 1, 5: 2}  # admitted in this order; group 3's tokens are the oldest
    assert ledger.order([third, second, first], admitted) == [first, second, third]
    assert not ledger.has_turn([second, third], admitted, needed=2)  # group 7 still runs: the step waits for it
    assert ledger.has_turn([first, second], admitted, needed=2)
    drop = StalenessLedger(max_staleness=1)  # the other policies take the oldest tokens first, whatever is ready
    assert drop.order([third, second, first], admitted) == [second, first, third]
    assert drop.has_turn([second, third], admitted, needed=2)


def test_the_gate_refuses_stale_tokens_and_a_group_trained_twice():
    ledger = StalenessLedger(max_staleness=1)
    with pytest.raises(ValueError, match=r"group 0 sample 0's group holds trained tokens 3 versions older.*"
                                         r"max_staleness=1.*args.ledger.settle"):
        ledger.check([[sample(0, [0])]], trained_version=3)
    ledger.check([[sample(4, [3])]], trained_version=3)
    with pytest.raises(ValueError, match=r"group\(s\) \[4\] handed to training twice"):
        ledger.check([[sample(4, [3])]], trained_version=4)
    with pytest.raises(ValueError, match=r"group\(s\) \[5\] handed to training twice"):
        ledger.check([[sample(5, [3])], [sample(5, [3])]], trained_version=4)


def test_a_stale_policy_outside_the_three_is_refused():
    with pytest.raises(ValueError, match="stale_policy 'discard' is not one of"):
        RolloutSystemConfig(stale_policy="discard")
    with pytest.raises(ValueError, match="one_step_off' with max_staleness 0 cannot overlap"):
        RolloutSystemConfig(mode="one_step_off", max_staleness=0)


@MANY
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=200))
def test_the_trained_group_set_matches_a_set(operations):
    groups, expected = GroupSet(), set()
    for add, index in operations:
        (groups.add if add else groups.discard)(index)
        (expected.add if add else expected.discard)(index)
    assert sorted(i for i in range(61) if i in groups) == sorted(expected) and len(groups) == len(expected)
    assert all(a[1] < b[0] for a, b in zip(groups.intervals, groups.intervals[1:]))  # disjoint, not touching
    assert GroupSet(json.loads(json.dumps(groups.intervals))).intervals == groups.intervals


class AsyncSchedule:
    """An async producer and trainer reduced to the ledger's decisions, as `RolloutProducer` makes them: admit a
    group while `admits` its planned version (`prepare` first), settle/order/has_turn at a step's take, `check` the
    batch, and on a checkpoint abort what runs into the buffer and restore the ledger from its saved state. The engines
    hold version `engine`; a sync moves them one version on, never past the last trained step."""

    def __init__(self, policy: str, bound: int, groups_per_step: int, group_size: int, partial: bool):
        self.ledger = StalenessLedger(bound, policy)
        self.bound, self.per_step, self.group_size, self.partial = bound, groups_per_step, group_size, partial
        self.engine = self.consumed = 0
        self.num_groups = self.num_admitted = 0
        self.buffer: list[list[Sample]] = []
        self.running: list[list[Sample]] = []
        self.ready: list[list[Sample]] = []
        self.admitted: dict[int, int] = {}
        self.trained: list[int] = []
        self.filtered: list[int] = []

    def admit(self, _: int) -> None:
        planned = self.consumed + (len(self.ready) + len(self.running)) // self.per_step
        if not self.ledger.admits(planned, self.engine):
            return
        group = self.buffer.pop(0) if self.buffer else self.fresh()
        self.ledger.prepare(group, planned)
        self.admitted[group[0].group_index] = self.num_admitted
        self.num_admitted += 1
        self.running.append(group)

    def fresh(self) -> list[Sample]:
        self.num_groups += 1
        return [Sample(group_index=self.num_groups - 1, sample_index=i, prompt="p", prompt_ids=[1])
                for i in range(self.group_size)]

    def token(self, pick: int) -> None:
        """One token of a running sample, by the engines' weights now (an environment's token every fifth)."""
        if self.running:
            group = self.running[pick % len(self.running)]
            target = group[pick // 7 % len(group)]
            env = pick % 5 == 4
            mask = target.effective_loss_mask()
            target.response_ids.append(5)
            target.rollout_log_probs.append(0.0 if env else -1.0)
            target.weight_versions.append(-1 if env else self.engine)
            target.loss_mask = mask + [0 if env else 1]

    def finish(self, pick: int) -> None:
        """A running group finishes and is rewarded; every sixth fails or is filtered out."""
        if self.running:
            group = self.running.pop(pick % len(self.running))
            for s in group:
                s.status, s.reward = Status.COMPLETED, 1.0
            if pick % 6 == 5:
                del self.admitted[group[0].group_index]
                self.filtered.append(group[0].group_index)
            else:
                self.ready.append(group)

    def abort(self, pick: int) -> None:
        if self.running:
            self.abort_group(self.running.pop(pick % len(self.running)))

    def abort_group(self, group: list[Sample]) -> None:
        del self.admitted[group[0].group_index]
        for s in group:
            reset_sample(s, keep_tokens=self.partial)
        self.buffer.append(group)

    def take(self, _: int) -> None:
        """A step takes its groups, at most one take ahead of the weights in the engines (the next step's take runs
        while this one trains, before it syncs)."""
        if self.engine < self.consumed - 1:
            return
        self.ready, back = self.ledger.settle(self.ready, self.consumed)
        for group in back:
            del self.admitted[group[0].group_index]
        self.buffer += back
        self.ready = self.ledger.order(self.ready, self.admitted)
        if not self.ledger.has_turn(self.ready, self.admitted, self.per_step):
            return
        groups, self.ready = self.ready[:self.per_step], self.ready[self.per_step:]
        for group in groups:
            del self.admitted[group[0].group_index]
        self.ledger.check(groups, self.consumed)
        for group in groups:  # the bound, recomputed from the tokens themselves
            for s in group:
                for version, mask in zip(s.weight_versions, s.effective_loss_mask()):
                    assert not (mask and version >= 0 and self.consumed - version > self.bound)
        self.trained += [group[0].group_index for group in groups]
        self.consumed += 1

    def sync(self, _: int) -> None:
        self.engine = min(self.engine + 1, self.consumed)

    def checkpoint(self, _: int) -> None:
        """Stop the producer (running groups aborted into the buffer, ready ones back at its front), save, load."""
        for group in self.running:
            self.abort_group(group)
        self.buffer[:0] = self.ready
        self.running, self.ready = [], []
        self.admitted.clear()
        saved = json.loads(json.dumps({"ledger": self.ledger.state_dict(),
                                       "buffer": [[s.to_dict() for s in g] for g in self.buffer]}))
        self.ledger = StalenessLedger(self.bound, self.ledger.policy)
        self.ledger.load_state_dict(saved["ledger"])
        self.buffer = [[Sample.from_dict(d) for d in g] for g in saved["buffer"]]

    def check_counts(self) -> None:
        """Every group made is in exactly one place, and only the groups started are admitted."""
        held = [g[0].group_index for g in self.buffer + self.running + self.ready]
        places = Counter(self.trained + self.filtered + held)
        assert places == Counter(range(self.num_groups)), places
        assert sorted(self.admitted) == sorted(g[0].group_index for g in self.running + self.ready)
        assert len(self.ledger.trained) == len(self.trained)


# Weighted so that groups queue up, finish out of order and see the weights move on: every policy has work to do.
EVENTS = 2 * ("admit", "admit", "admit", "token", "token", "token", "finish", "abort", "take", "take", "sync",
              "sync") + ("checkpoint",)


@MANY
@given(policy=st.sampled_from(STALE_POLICIES), bound=st.integers(1, 3), groups_per_step=st.integers(1, 3),
       group_size=st.integers(1, 2), partial=st.booleans(),
       events=st.lists(st.tuples(st.sampled_from(EVENTS), st.integers(0, 10_000)), min_size=100, max_size=500))
def test_no_schedule_trains_a_token_over_the_bound_or_loses_a_group(policy, bound, groups_per_step, group_size,
                                                                    partial, events):
    schedule = AsyncSchedule(policy, bound, groups_per_step, group_size, partial)
    for event, pick in events:
        getattr(schedule, event)(pick)
        schedule.check_counts()
    if policy in ("withhold", "pace"):  # withhold trains every group; pace lets none go stale
        assert schedule.ledger.counts["dropped_groups"] == 0
    if policy != "withhold":
        assert schedule.ledger.counts["withheld_tokens"] == 0


@pytest.mark.parametrize("policy", STALE_POLICIES)
def test_a_run_settles_a_buffered_partial_group_too_old_to_train_by_its_policy(tmp_path, policy):
    from test_rollout_pipeline import tiny  # a tiny sync run: max_staleness 1

    pipeline = RolloutRLVRPipeline(tiny(tmp_path, num_steps=1, engines=1, partial_rollout=True, stale_policy=policy))
    try:
        producer = pipeline.producer
        [group] = producer.data_source.get_samples(1)
        ctx = producer.context()
        two_tokens = SamplingParams(temperature=1.0, max_new_tokens=2, n=1, stop_token_ids=())
        for s in group:  # aborted after two tokens of version 0, back in the buffer
            ctx.run(generate_sample(ctx, s, two_tokens))
            reset_sample(s, keep_tokens=True)
        producer.data_source.add_samples([group])
        pipeline.publisher.publish(pipeline.actor, version=2)
        groups, metrics = producer.generate(rollout_id=3)  # trains version 2: the prefix would be 2 versions old
        batch, data_metrics = producer.to_training_data(groups, trained_version=2, temperature=1.0)
    finally:
        pipeline.shutdown()
    [trained] = [g for g in groups if g[0].group_index == group[0].group_index]  # trained, once, whatever the policy
    assert data_metrics["rollout/num_groups"] == 4 and data_metrics["rollout/staleness/max"] <= 1
    if policy == "withhold":  # kept, its old tokens out of the loss
        assert all(s.weight_versions[:2] == [0, 0] and s.loss_mask[:2] == [0, 0] for s in trained)
        assert data_metrics["rollout/staleness/withheld_tokens"] == 2 * len(group)
    else:  # generated again from its prompt: after it finished ("drop") or before it started ("pace")
        assert all(set(s.weight_versions) == {2} for s in trained)
        name, count = ("dropped_groups", 1) if policy == "drop" else ("restarted_samples", len(group))
        assert data_metrics[f"rollout/staleness/{name}"] == count
        assert metrics.get("rollout/num_dropped/stale", 0) == (policy == "drop")


@pytest.mark.parametrize("policy", ["withhold", "pace"])
def test_async_runs_keep_the_bound_under_each_policy(tmp_path, policy):
    from test_rollout_pipeline import steps, tiny

    run_pipeline(RolloutRLVRPipeline, tiny(tmp_path, mode="async", max_staleness=1, stale_policy=policy))
    by_step = steps(tmp_path)
    assert sorted(by_step) == [1, 2, 3, 4]
    for record in by_step.values():
        assert record["rollout/staleness/max"] <= 1 and record["rollout/num_groups"] == 4
        assert "rollout/num_dropped/stale" not in record  # neither policy sends a group back


KILLABLE_RUN = """
import sys
sys.path.insert(0, sys.argv[2])
from test_rollout_pipeline import tiny
from baton.checkpoint import PIPELINE_STATE, load_state
from baton.pipelines.base import run_pipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRPipeline
config = tiny(sys.argv[1], num_steps=6, mode="async", max_staleness=1, partial_rollout=True)
config.trainer.save_every_steps, config.trainer.resume = 1, "latest"
run_pipeline(RolloutRLVRPipeline, config)
"""


def trained_steps(run_dir) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [record["step"] for record in read_metrics(path) if "actor/pg_loss" in record]


def test_async_runs_killed_between_and_during_steps_resume_within_the_bound(tmp_path):
    """SIGKILL of the driver as step 2 is logged (its checkpoint being written) and at a random moment after step 4
    is (step 5 running, groups in flight with partial rollouts); each time the run resumes from its newest intact
    checkpoint. Every step trains 4 groups within the bound, and the last checkpoint accounts for every group once."""
    run_dir, tests_dir = str(tmp_path / "run"), os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-c", KILLABLE_RUN, run_dir, tests_dir]
    for kill_after_step, delay_s in ((2, 0.0), (4, random.Random(4).uniform(0.05, 0.5))):
        driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: kill_after_step in trained_steps(run_dir) or driver.poll() is not None,
                       f"step {kill_after_step} logged", timeout_s=240)
            assert driver.poll() is None, driver.stderr.read().decode()[-2000:]
            time.sleep(delay_s)
            driver.send_signal(signal.SIGKILL)
        finally:
            driver.kill()
            driver.wait(30)
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    by_step = run_metrics(run_dir)
    assert sorted(step for step in by_step if step > 0) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert by_step[step]["rollout/staleness/max"] <= 1 and by_step[step]["rollout/num_groups"] == 4
    state = load_state(os.path.join(run_dir, "checkpoints", "step_6", PIPELINE_STATE))["rollouts"]
    trained = GroupSet(state["ledger"]["trained"])
    buffered = [group[0]["group_index"] for group in state["data_source"]["buffer"]]
    assert len(trained) == 6 * 4  # each step's groups, once: the killed steps' groups trained again, not twice
    assert sorted([i for i in range(state["data_source"]["next_group_index"]) if i in trained] + buffered) == \
        list(range(state["data_source"]["next_group_index"]))  # every group made is trained or in the buffer
