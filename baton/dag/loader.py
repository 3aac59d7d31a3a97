"""Workflows from YAML, in siiRL's schema:

    dag_id: grpo
    description: ...            # optional
    nodes:
      - node_id: rollout
        node_type: MODEL_INFERENCE
        node_role: ROLLOUT
        dependencies: [data]
        executable_ref: baton.dag.nodes:generate
        config: {}              # optional; given to the executable
        only_forward_compute: false
        agent_group: 0
        reads: [...]            # optional: baton's column contracts (else the executable's declaration)
        writes: [...]

Types and roles are case-insensitive. Every key is checked: an unknown one is an error with the close match.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Mapping

import yaml

from baton.dag.graph import Node, TaskGraph, WorkflowError

TOP_KEYS = ("dag_id", "description", "nodes")
NODE_KEYS = ("node_id", "node_type", "node_role", "dependencies", "config", "executable_ref", "only_forward_compute",
             "agent_group", "reads", "writes")


def load_workflow(source: str | os.PathLike | Mapping[str, Any]) -> TaskGraph:
    """A checked `TaskGraph` from a YAML file path or an already-parsed mapping (e.g. a config's `workflow:`)."""
    where = "workflow"
    if isinstance(source, (str, os.PathLike)):
        where = f"workflow file {os.fspath(source)!r}"
        if not os.path.isfile(source):
            raise WorkflowError(f"{where} does not exist; give the path of a YAML file with dag_id and nodes")
        with open(source) as f:
            try:
                source = yaml.safe_load(f)
            except yaml.YAMLError as error:
                raise WorkflowError(f"{where} is not valid YAML: {error}") from error
    if not isinstance(source, Mapping):
        raise WorkflowError(f"{where} must be a mapping with dag_id and nodes, got {type(source).__name__}")
    _check_keys(source, TOP_KEYS, where)
    graph_id = source.get("dag_id")
    if not isinstance(graph_id, str) or not graph_id:
        raise WorkflowError(f"{where} needs a dag_id (a non-empty string)")
    raw_nodes = source.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise WorkflowError(f"{where} ({graph_id!r}) needs `nodes`: a non-empty list of node mappings")
    nodes = []
    for i, raw in enumerate(raw_nodes):
        at = f"{where}, node {i}" + (f" ({raw.get('node_id')!r})" if isinstance(raw, Mapping) else "")
        if not isinstance(raw, Mapping):
            raise WorkflowError(f"{at} must be a mapping with node_id and node_type, got {type(raw).__name__}")
        _check_keys(raw, NODE_KEYS, at)
        for key in ("node_id", "node_type"):
            if key not in raw:
                raise WorkflowError(f"{at} has no {key}; every node needs node_id and node_type")
        for key in ("reads", "writes", "dependencies"):
            value = raw.get(key)
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise WorkflowError(f"{at}: {key} must be a list of strings, got {value!r}")
        if raw.get("config") is not None and not isinstance(raw["config"], Mapping):
            raise WorkflowError(f"{at}: config must be a mapping, got {raw['config']!r}")
        nodes.append(Node(
            node_id=raw["node_id"], node_type=raw["node_type"], node_role=raw.get("node_role") or "default",
            dependencies=list(raw.get("dependencies") or []), config=dict(raw.get("config") or {}),
            executable=raw.get("executable_ref"), reads=raw.get("reads"), writes=raw.get("writes"),
            only_forward_compute=raw.get("only_forward_compute", False), agent_group=raw.get("agent_group", 0)))
    return TaskGraph(graph_id, nodes)


def _check_keys(raw: Mapping, allowed: tuple[str, ...], where: str) -> None:
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(allowed)}"
            raise WorkflowError(f"{where}: unknown key {key!r}{hint}")
