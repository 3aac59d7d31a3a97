"""Rollout dumps: one rollout's groups of samples as a JSON-lines file (one `Sample.to_dict()` a line, groups in
order, a group's samples consecutive), to inspect, replay or debug a run."""

from __future__ import annotations

import glob
import json
import os
import re
import string

from baton.data.atomic import atomic_file
from baton.rollout.sample import Sample


def rollout_path(path_template: str, rollout_id: int) -> str:
    """`path_template` with its `{rollout_id}` field filled in, e.g. "dumps/rollout_{rollout_id:04d}.jsonl"."""
    fields = {name for _, name, _, _ in string.Formatter().parse(path_template) if name is not None}
    if fields != {"rollout_id"}:
        raise ValueError(f"rollout path template {path_template!r} has the fields {sorted(fields)}; it needs "
                         "exactly one, {rollout_id}, such as 'dumps/rollout_{rollout_id}.jsonl'")
    return path_template.format(rollout_id=rollout_id)


def save_rollout(path_template: str, rollout_id: int, groups: list[list[Sample]], overwrite: bool = False) -> str:
    """Write `groups` to the template's path for `rollout_id` atomically (a temp file in the same directory, then a
    rename), creating parent directories; an existing file is refused unless `overwrite`. Returns the path."""
    path = rollout_path(path_template, rollout_id)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} already exists (the dump of rollout {rollout_id}); pass overwrite=True to "
                              "replace it, or dump to another path template")
    indices = [group[0].group_index for group in groups if group]
    if any(not group or any(s.group_index != group[0].group_index for s in group) for group in groups):
        raise ValueError("save_rollout: every group must be a non-empty list of samples of one group_index")
    if len(set(indices)) != len(indices):
        raise ValueError("save_rollout: two groups share a group_index; each prompt group must be one list")
    lines = [json.dumps(sample.to_dict()) + "\n" for group in groups for sample in group]
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with atomic_file(path) as f:
        f.writelines(lines)
    return path


def load_rollout(path_template: str, rollout_id: int) -> list[list[Sample]]:
    """The groups `save_rollout` wrote for `rollout_id`, in their saved order."""
    path = rollout_path(path_template, rollout_id)
    if not os.path.exists(path):
        saved = saved_rollout_ids(path_template)
        found = f"the template has dumps of rollouts {saved}" if saved else "the template matches no dumps"
        raise FileNotFoundError(f"no rollout dump {path} for rollout {rollout_id}: {found}")
    groups: list[list[Sample]] = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"a line holds a JSON object, got {type(record).__name__}")
                sample = Sample.from_dict(record)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{number}: not a sample: {e}") from None
            if groups and groups[-1][0].group_index == sample.group_index:
                groups[-1].append(sample)
            else:
                groups.append([sample])
    return groups


def saved_rollout_ids(path_template: str) -> list[int]:
    """The rollout ids with a dump at `path_template`, in increasing order."""
    pattern, regex = "", ""
    for literal, name, _, _ in string.Formatter().parse(path_template):
        pattern, regex = pattern + glob.escape(literal), regex + re.escape(literal)
        if name is not None:
            pattern, regex = pattern + "*", regex + r"(-?\d+)"
    ids = []
    for path in glob.glob(pattern):
        match = re.fullmatch(regex, path)
        if match:
            ids.append(int(match.group(1)))
    return sorted(ids)


__all__ = ["load_rollout", "rollout_path", "save_rollout", "saved_rollout_ids"]
