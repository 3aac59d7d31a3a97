"""Roles that take turns on shared devices, in a workflow: which nodes may run at the same time, and handing the
devices to the roles of the nodes about to run."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence


class DeviceTurns:
    """The turns of the roles that share devices and `on_device(*roles)`, which gives `roles` their devices (the
    others that share them offloaded first; the pipeline's `TimeSharing.on_device`).

    turns: groups of roles that compute together (the loop's phases: the rollout; the actor, reference and critic),
        each role in one turn, and only roles that share a device with another turn's (offloaded themselves or not:
        a colocated actor and rollout never are, yet the reference makes way for them).

    A node computes inside `hold(node.roles())`. A node on the roles of one turn holds that whole turn, so nodes of
    one turn run together; a node whose roles span turns (the weight sync: actor and rollout) holds just those
    roles. A node that needs other roles than those held waits until the nodes holding them are done, so roles that
    take turns never compute on their devices at the same time. The first node of a hold hands the devices over;
    nodes on no role of a turn pass at once.
    """

    def __init__(self, turns: Sequence[Sequence[str]], on_device: Callable[..., None]):
        self.turns = [tuple(turn) for turn in turns if turn]
        names = [name for turn in self.turns for name in turn]
        assert len(names) == len(set(names)), f"a role in two turns: {self.turns}"
        self.on_device = on_device
        self._changed = threading.Condition()
        self._held: tuple[str, ...] | None = None  # the roles on their devices for the nodes running now
        self._num_holding = 0

    def roles_to_hold(self, roles: Sequence[str]) -> tuple[str, ...]:
        """What a node on `roles` holds: the whole turn of one, its own roles that take turns where they span
        several, none where none takes turns."""
        touched = [turn for turn in self.turns if set(turn) & set(roles)]
        if len(touched) == 1:
            return touched[0]
        return tuple(name for turn in touched for name in turn if name in roles)

    @contextmanager
    def hold(self, roles: Sequence[str]) -> Iterator[None]:
        """Wait until no node holds other roles, give these theirs (the first to hold them), and keep them while
        the block runs."""
        wanted = self.roles_to_hold(roles)
        if not wanted:
            yield
            return
        with self._changed:
            self._changed.wait_for(lambda: self._held in (None, wanted))
            if self._held is None:
                self.on_device(*wanted)
                self._held = wanted
            self._num_holding += 1
        try:
            yield
        finally:
            with self._changed:
                self._num_holding -= 1
                if not self._num_holding:
                    self._held = None
                    self._changed.notify_all()
