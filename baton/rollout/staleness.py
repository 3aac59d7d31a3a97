"""`StalenessLedger`: the rollout system's one definition of a token's staleness and the one place its bound is
enforced, in every mode (sync, one_step_off, async, deterministic) and every pipeline on the rollout system (RLVR,
agentic).

Definition. Step t trains the weights of version t - 1: its trained version T. A token's staleness is T less the
version of the weights that sampled it, which the engine records per token as it samples (an in-place update in the
middle of a response gives one response tokens of two versions). When its request was submitted, queued or finished
does not enter, only which weights wrote the token and which weights it trains. Tokens the model did not write
(environment tokens, version -1) and tokens out of the loss (loss mask 0) are not trained and have no staleness. A
group's staleness is that of its stalest trained token (0 if it has none).

The bound: no trained token's staleness exceeds `max_staleness`. `policy` says what becomes of a group that would
break it:
- "drop": the group goes back to the buffer as a fresh prompt (`rollout/num_dropped/stale`). The groups that go
  stale are the slow ones, long responses mostly, so dropping skews training toward short responses.
- "withhold": the group trains with its over-bound tokens out of the loss (`rollout/staleness/withheld_tokens`); its
  rewards still count in the group's baseline. No prompt is skewed out, only stale tokens.
- "pace": generation never runs further ahead than the bound allows. The async producer hands groups to steps in
  the order it admitted them (a step waits for its own groups instead of taking later ones that finished first),
  so each group trains at the version planned when it was admitted, and a buffered partial sample whose kept tokens
  would be over the bound then restarts from its prompt (`rollout/staleness/restarted_samples`). A group over the
  bound all the same (a custom generate function's tokens) is dropped.

The ledger also knows which groups have trained (by `group_index`): `check`, the gate every training batch passes,
refuses a trained token over the bound and a group handed to training twice.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Iterable

from baton.rollout.config import STALE_POLICIES
from baton.rollout.functions import reset_sample
from baton.rollout.sample import Sample, Status


class StalenessLedger:
    """See the module docstring. `max_staleness` >= 0; `policy` one of `STALE_POLICIES`."""

    def __init__(self, max_staleness: int, policy: str = "drop"):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if policy not in STALE_POLICIES:
            raise ValueError(f"rollout_system.stale_policy {policy!r} is not one of {STALE_POLICIES}")
        self.max_staleness, self.policy = max_staleness, policy
        self.trained = GroupSet()
        self.counts: Counter = Counter()  # whole-run: dropped groups, withheld tokens, restarted samples

    # --- the definition ------------------------------------------------------------------------------

    @staticmethod
    def token_staleness(sample: Sample, trained_version: int) -> list[int | None]:
        """Each response token's staleness when trained at `trained_version`; None on a token that is not trained."""
        return [trained_version - version if version >= 0 and mask else None
                for version, mask in zip(sample.weight_versions, sample.effective_loss_mask())]

    def staleness(self, group: list[Sample], trained_version: int) -> int:
        """The group's stalest trained token's staleness; 0 when it has no trained token."""
        oldest = [v for v in (sample.oldest_version() for sample in group) if v is not None]
        return trained_version - min(oldest) if oldest else 0

    def over(self, group: list[Sample], trained_version: int) -> bool:
        return self.staleness(group, trained_version) > self.max_staleness

    # --- admission ---------------------------------------------------------------------------------

    def admits(self, trained_version: int, engine_version: int) -> bool:
        """Whether a group started now, on engines holding `engine_version` (so every token it samples is of that
        version or newer), is within the bound when trained at `trained_version`."""
        return trained_version - engine_version <= self.max_staleness

    def prepare(self, group: list[Sample], trained_version: int) -> int:
        """("pace") Before a group from the buffer generates for training at `trained_version`: each partial sample
        whose kept tokens would be over the bound then restarts from its prompt. The number restarted."""
        if self.policy != "pace":
            return 0
        restarted = 0
        for sample in group:
            if sample.status == Status.PENDING and self.over([sample], trained_version):
                reset_sample(sample, keep_tokens=False)
                restarted += 1
        self.counts["restarted_samples"] += restarted
        return restarted

    # --- which groups a step takes ---------------------------------------------------------------------

    def order(self, ready: list[list[Sample]], admitted: dict[int, int]) -> list[list[Sample]]:
        """The ready groups in the order steps take them: with "pace" the order they were admitted in (`admitted`:
        group_index -> admission number, of every group started and not yet taken or given up), else the oldest
        tokens first, so the fewest go stale (admission order on ties)."""
        if self.policy == "pace":
            return sorted(ready, key=lambda group: admitted[group[0].group_index])
        return sorted(ready, key=lambda group: (min(s.oldest_version() or 0 for s in group),
                                                admitted[group[0].group_index]))

    def has_turn(self, ordered: list[list[Sample]], admitted: dict[int, int], needed: int) -> bool:
        """Whether a step can take the first `needed` of the `ordered` ready groups: enough are ready, and with
        "pace" they are the first `needed` groups admitted (the step waits for its own)."""
        if len(ordered) < needed:
            return False
        first = sorted(admitted.values())[:needed]
        return self.policy != "pace" or [admitted[group[0].group_index] for group in ordered[:needed]] == first

    # --- settling finished groups --------------------------------------------------------------------

    def settle(self, groups: Iterable[list[Sample]],
               trained_version: int) -> tuple[list[list[Sample]], list[list[Sample]]]:
        """The policy applied to finished groups about to train at `trained_version`: (the groups that train, the
        groups sent back). "withhold" masks the over-bound tokens out of the loss and sends none back; "drop" and
        "pace" send an over-bound group back restarted (its prompt only), for the buffer."""
        trains, back = [], []
        for group in groups:
            if not self.over(group, trained_version):
                trains.append(group)
            elif self.policy == "withhold":
                self.counts["withheld_tokens"] += sum(withhold(sample, trained_version, self.max_staleness)
                                                      for sample in group)
                trains.append(group)
            else:
                for sample in group:
                    reset_sample(sample, keep_tokens=False)
                self.counts["dropped_groups"] += 1
                back.append(group)
        return trains, back

    def check(self, groups: list[list[Sample]], trained_version: int) -> None:
        """The gate every training batch passes: ValueError if a trained token is over the bound or a group trained
        before; else the groups are recorded as trained."""
        indices = [group[0].group_index for group in groups]
        for group in groups:
            if self.over(group, trained_version):
                raise ValueError(f"{group[0].where()}'s group holds trained tokens "
                                 f"{self.staleness(group, trained_version)} versions older than the weights they would "
                                 f"train (max_staleness={self.max_staleness}); a rollout function must settle its "
                                 "groups with args.ledger.settle (or leave them out)")
        again = [index for index in indices if index in self.trained]
        if again or len(set(indices)) != len(indices):
            twice = again or sorted(i for i, n in Counter(indices).items() if n > 1)
            raise ValueError(f"group(s) {twice} handed to training twice; a rollout function must hand each group over "
                             "once (a surplus group goes back to the buffer with data_source.add_samples)")
        for index in indices:
            self.trained.add(index)

    # --- metrics and state -------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Whole-run counters: `rollout/staleness/withheld_tokens`, `.../restarted_samples`, `.../dropped_groups`."""
        return {f"rollout/staleness/{name}": float(count) for name, count in sorted(self.counts.items())}

    def state_dict(self) -> dict:
        return {"trained": self.trained.intervals, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.trained = GroupSet(state["trained"])
        self.counts = Counter(state["counts"])


def withhold(sample: Sample, trained_version: int, max_staleness: int) -> int:
    """Mask the sample's trained tokens over the bound out of the loss; the number masked."""
    mask = sample.effective_loss_mask()
    over = [i for i, s in enumerate(StalenessLedger.token_staleness(sample, trained_version))
            if s is not None and s > max_staleness]
    for i in over:
        mask[i] = 0
    if over:
        sample.loss_mask = mask
    return len(over)


class GroupSet:
    """A set of group indices kept as sorted, disjoint, half-open intervals [start, end): groups train nearly in
    index order, so a whole run's trained groups take a few intervals (and a few numbers in a checkpoint)."""

    def __init__(self, intervals: Iterable[Iterable[int]] = ()):
        self.intervals: list[list[int]] = [[int(start), int(end)] for start, end in intervals]

    def __contains__(self, index: int) -> bool:
        at = bisect.bisect_right(self.intervals, [index, float("inf")]) - 1
        return at >= 0 and self.intervals[at][0] <= index < self.intervals[at][1]

    def __len__(self) -> int:
        return sum(end - start for start, end in self.intervals)

    def discard(self, index: int) -> None:
        if index not in self:
            return
        at = bisect.bisect_right(self.intervals, [index, float("inf")]) - 1
        start, end = self.intervals.pop(at)
        self.intervals[at:at] = [[a, b] for a, b in ((start, index), (index + 1, end)) if a < b]

    def add(self, index: int) -> None:
        if index in self:
            return
        at = bisect.bisect_right(self.intervals, [index, float("inf")])
        joins_left = at > 0 and self.intervals[at - 1][1] == index
        joins_right = at < len(self.intervals) and self.intervals[at][0] == index + 1
        if joins_left and joins_right:
            self.intervals[at - 1][1] = self.intervals.pop(at)[1]
        elif joins_left:
            self.intervals[at - 1][1] = index + 1
        elif joins_right:
            self.intervals[at][0] = index
        else:
            self.intervals.insert(at, [index, index + 1])


__all__ = ["GroupSet", "StalenessLedger", "withhold"]
