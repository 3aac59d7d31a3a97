"""Workflow graphs: typed nodes with dependencies and column contracts, checked before anything runs.

A `TaskGraph` is a DAG of `Node`s. Data flows along the edges as one batch: a node receives the columns of
everything upstream of it (its dependencies' outputs, joined) and adds the columns it `writes`. So a graph is
checked statically: every column a node `reads` must be written upstream of it, and two nodes that run in
parallel must not write the same column into a node that merges them. Build one with `Workflow` in Python or
load siiRL's YAML schema with `baton.dag.load_workflow`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence


class WorkflowError(ValueError):
    """A workflow that cannot run: the message names the node and the fix."""


class NodeType(enum.StrEnum):
    COMPUTE = "compute"  # a function of the batch, run where the data is (no model)
    DATA_LOAD = "data_load"  # an entry: makes the step's first batch
    MODEL_INFERENCE = "model_inference"  # generation or a forward pass of a model role
    MODEL_TRAIN = "model_train"  # an update of a model role
    ENV_INTERACT = "env_interact"
    PUT_TO_BUFFER = "put_to_buffer"
    GET_FROM_BUFFER = "get_from_buffer"
    BARRIER_SYNC = "barrier_sync"  # waits for its dependencies on every rank of its subgraph; no executable
    CUSTOM = "custom"  # a controller-side function with the node context


class NodeRole(enum.StrEnum):
    DEFAULT = "default"
    ACTOR = "actor"
    ROLLOUT = "rollout"
    REFERENCE = "reference"
    CRITIC = "critic"
    REWARD = "reward"
    ADVANTAGE = "advantage"
    DYNAMIC_SAMPLING = "dynamic_sampling"


class NodeStatus(enum.StrEnum):
    PENDING = "pending"  # not all dependencies have completed
    READY = "ready"  # every dependency completed; waiting for its turn
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"  # a node upstream failed


# Which roles each node type may have (DEFAULT: a node that is not a model's).
MODEL_ROLES = (NodeRole.ACTOR, NodeRole.ROLLOUT, NodeRole.REFERENCE, NodeRole.CRITIC, NodeRole.REWARD)
ALLOWED_ROLES: dict[NodeType, tuple[NodeRole, ...]] = {
    NodeType.MODEL_TRAIN: (NodeRole.ACTOR, NodeRole.CRITIC),
    NodeType.MODEL_INFERENCE: MODEL_ROLES,
    NodeType.COMPUTE: (NodeRole.DEFAULT, NodeRole.REWARD, NodeRole.ADVANTAGE, NodeRole.DYNAMIC_SAMPLING),
    NodeType.DATA_LOAD: (NodeRole.DEFAULT,),
    NodeType.ENV_INTERACT: (NodeRole.DEFAULT, NodeRole.ROLLOUT),
    NodeType.PUT_TO_BUFFER: (NodeRole.DEFAULT,),
    NodeType.GET_FROM_BUFFER: (NodeRole.DEFAULT,),
    NodeType.BARRIER_SYNC: (NodeRole.DEFAULT,),
    NodeType.CUSTOM: tuple(NodeRole),
}
# Node types the executors implement themselves: an executable is not needed (BARRIER_SYNC takes none).
BUILTIN_TYPES = (NodeType.BARRIER_SYNC, NodeType.PUT_TO_BUFFER, NodeType.GET_FROM_BUFFER)

Columns = Sequence[str] | Callable[[dict], Sequence[str]]


OUTPUT_MODES = ("add", "replace", "filter", "meta")


def node_function(*, reads: Columns = (), writes: Columns = (), output: str = "add",
                  roles: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Declares the columns a node executable reads and writes (a list, or a function of the node's config that
    returns one), so a node that names it needs no `reads`/`writes` of its own; the roles it computes on besides
    its node's `node_role` (`roles`, e.g. the weight sync's rollout: roles that take turns on shared devices are
    given their devices before the node runs); and what its output is:

    "add": the columns it writes, added to its input's for the nodes downstream (same rows);
    "replace": the whole batch downstream, with only the columns it writes (e.g. generation: n rows per prompt);
    "filter": the whole batch downstream, its input's columns (and any it writes) on other rows (a filter);
    "meta": no rows and no columns, only `meta_info` (e.g. one number per prompt, keyed by uid), which joins any
    batch downstream (ReMax's greedy baselines)."""
    if output not in OUTPUT_MODES:
        raise ValueError(f"node_function(output={output!r}): use one of {', '.join(OUTPUT_MODES)}")

    def mark(fn: Callable) -> Callable:
        fn.dag_reads, fn.dag_writes, fn.dag_output, fn.dag_roles = reads, writes, output, tuple(roles)
        return fn

    return mark


@dataclass
class Node:
    """One step of a workflow.

    executable: the function the node runs: an import path ("package.module:function") or a callable. COMPUTE
        nodes are called as `fn(batch: DataProto, config: dict) -> DataProto | (DataProto, metrics)` where their
        data is; every other type as `fn(ctx: NodeContext, batch) -> NodeOutput` by the controller (see
        `baton.dag.executor`). BARRIER_SYNC, PUT_TO_BUFFER and GET_FROM_BUFFER have built-in behaviour.
    reads / writes: the columns it needs from upstream and the columns it adds; None takes them from the
        executable's `@node_function` declaration (none declared: nothing).
    only_forward_compute: a model node that runs the model forward only (e.g. the actor's old log-probs).
    agent_group: which copy of the models the node uses (multi-agent workflows); 0 for one set.
    """

    node_id: str
    node_type: NodeType
    node_role: NodeRole = NodeRole.DEFAULT
    dependencies: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    executable: str | Callable | None = None
    reads: list[str] | None = None
    writes: list[str] | None = None
    only_forward_compute: bool = False
    agent_group: int = 0
    status: NodeStatus = NodeStatus.PENDING
    error: str | None = None

    def __post_init__(self) -> None:
        where = f"node {self.node_id!r}"
        if not isinstance(self.node_id, str) or not self.node_id:
            raise WorkflowError(f"a node id must be a non-empty string, got {self.node_id!r}")
        self.node_type = _enum(NodeType, self.node_type, f"{where}: node_type")
        self.node_role = _enum(NodeRole, self.node_role, f"{where}: node_role")
        if isinstance(self.dependencies, str):
            self.dependencies = [self.dependencies]
        self.dependencies = list(self.dependencies or [])
        self.config = dict(self.config or {})
        if self.executable is not None and not (isinstance(self.executable, str) or callable(self.executable)):
            raise WorkflowError(f"{self.where}: executable {self.executable!r} must be an import path "
                                "'package.module:function' or a function")
        if not isinstance(self.only_forward_compute, bool):
            raise WorkflowError(f"{where}: only_forward_compute={self.only_forward_compute!r} must be true or false")
        if not isinstance(self.agent_group, int) or self.agent_group < 0:
            raise WorkflowError(f"{where}: agent_group={self.agent_group!r} must be an int >= 0")
        self._resolved: Callable | None = self.executable if callable(self.executable) else None

    @property
    def where(self) -> str:
        return f"node {self.node_id!r} ({self.node_type}, {self.node_role})"

    def resolve(self) -> Callable | None:
        """The executable as a callable (imported once); None for a node without one."""
        if self._resolved is None and isinstance(self.executable, str):
            from baton.config.loader import ConfigError, import_object

            try:
                self._resolved = import_object(self.executable)
            except (ConfigError, ImportError) as error:
                raise WorkflowError(f"{self.where}: executable {self.executable!r} does not import: {error}; give an "
                                    "import path 'package.module:function' of a module on sys.path") from error
            if not callable(self._resolved):
                raise WorkflowError(f"{self.where}: executable {self.executable!r} is a "
                                    f"{type(self._resolved).__name__}, not a function")
        return self._resolved

    def columns(self) -> tuple[list[str], list[str]]:
        """(reads, writes): the node's own, or its executable's declaration for its config."""
        fn = self.resolve()

        def pick(own, declared) -> list[str]:
            if own is not None:
                return list(own)
            if declared is None:
                return []
            try:
                return list(declared(self.config) if callable(declared) else declared)
            except KeyError as missing:
                raise WorkflowError(f"{self.where}: its executable's columns depend on config key {missing}, which "
                                    "the node's config does not set; add it under config:") from None

        return (pick(self.reads, getattr(fn, "dag_reads", None)), pick(self.writes, getattr(fn, "dag_writes", None)))

    def roles(self) -> list[str]:
        """The model roles the node computes on: its `node_role` where that is a model's, and the roles its
        executable declares (`node_function(roles=...)`)."""
        own = [str(self.node_role)] if self.node_role in MODEL_ROLES else []
        return list(dict.fromkeys([*own, *getattr(self.resolve(), "dag_roles", ())]))

    @property
    def output_mode(self) -> str:
        """"add", "replace", "filter" or "meta": what the node's output is (see `node_function`)."""
        return getattr(self.resolve(), "dag_output", "add")

    def set_status(self, status: NodeStatus, error: str | None = None) -> None:
        self.status, self.error = status, error


class TaskGraph:
    """A checked workflow: nodes by id (in the order given), with parents, children and a topological order.

    `TaskGraph(graph_id, nodes)` runs `validate()`: every error a workflow can have, each naming the node and
    the fix, raised as `WorkflowError` before any worker starts.
    """

    def __init__(self, graph_id: str, nodes: Iterable[Node]):
        self.graph_id = graph_id
        self.nodes: dict[str, Node] = {}
        self._columns_out: dict[str, dict[str, str]] = {}
        for node in nodes:
            if node.node_id in self.nodes:
                raise WorkflowError(f"workflow {graph_id!r}: two nodes have the id {node.node_id!r}; node ids must "
                                    "be unique: rename one")
            self.nodes[node.node_id] = node
        self.validate()

    # --- structure -------------------------------------------------------------------------------------------

    def parents(self, node_id: str) -> list[str]:
        return list(self.nodes[node_id].dependencies)

    def children(self, node_id: str) -> list[str]:
        return [n.node_id for n in self.nodes.values() if node_id in n.dependencies]

    def entries(self) -> list[str]:
        return [n.node_id for n in self.nodes.values() if not n.dependencies]

    def exits(self) -> list[str]:
        return [i for i in self.nodes if not self.children(i)]

    def ancestors(self, node_id: str) -> set[str]:
        seen, stack = set(), list(self.nodes[node_id].dependencies)
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(self.nodes[current].dependencies)
        return seen

    def descendants(self, node_id: str) -> set[str]:
        seen, stack = set(), self.children(node_id)
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(self.children(current))
        return seen

    def topological_order(self) -> list[str]:
        """Every node after its dependencies; ties in the order the nodes were given (deterministic)."""
        indegree = {i: len(n.dependencies) for i, n in self.nodes.items()}
        order, ready = [], [i for i, d in indegree.items() if d == 0]
        while ready:
            current = ready.pop(0)
            order.append(current)
            for child in self.children(current):
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
        return order

    def reset(self) -> None:
        """Every node PENDING again (the start of a step)."""
        for node in self.nodes.values():
            node.set_status(NodeStatus.PENDING)

    def columns_into(self, node_id: str) -> dict[str, str]:
        """column → the node that wrote it, for the batch `node_id` receives (its dependencies' outputs joined)."""
        into: dict[str, str] = {}
        for dep in self.nodes[node_id].dependencies:
            into.update(self.columns_out(dep))
        return into

    def columns_out(self, node_id: str) -> dict[str, str]:
        """column → writer for the batch `node_id` passes on: its input's plus its writes, or for a "replace"
        node its writes only."""
        if node_id not in self._columns_out:
            node = self.nodes[node_id]
            out = {} if node.output_mode in ("replace", "meta") else self.columns_into(node_id)
            out.update({column: node_id for column in node.columns()[1]})
            self._columns_out[node_id] = out
        return dict(self._columns_out[node_id])

    def rows_from(self, node_id: str) -> str:
        """What made the rows of `node_id`'s output: the nearest "replace" or "filter" node upstream, or the
        data_load nodes (a step's data loads give the same rows: the executor checks their counts)."""
        node = self.nodes[node_id]
        if node.node_type == NodeType.DATA_LOAD:
            return "the data_load nodes"
        if node.output_mode != "add":
            return node_id
        rowed = [dep for dep in node.dependencies if self.nodes[dep].output_mode != "meta"] or node.dependencies
        return self.rows_from(rowed[0])

    # --- checks ------------------------------------------------------------------------------------------------

    def validate(self) -> None:
        if not self.nodes:
            raise WorkflowError(f"workflow {self.graph_id!r} has no nodes; add at least a data_load node")
        for node in self.nodes.values():
            for dep in node.dependencies:
                if dep not in self.nodes:
                    raise WorkflowError(f"{node.where} depends on {dep!r}, which is not a node of workflow "
                                        f"{self.graph_id!r}{_close(dep, self.nodes)}; fix the dependency or add the node")
                if dep == node.node_id:
                    raise WorkflowError(f"{node.where} depends on itself; remove {dep!r} from its dependencies")
            if len(set(node.dependencies)) != len(node.dependencies):
                raise WorkflowError(f"{node.where} lists a dependency twice ({node.dependencies}); list each once")
        cycle = self._find_cycle()
        if cycle:
            raise WorkflowError(f"workflow {self.graph_id!r} has a cycle: {' -> '.join(cycle)}; a workflow must be "
                                "acyclic: remove one of these dependencies")
        for node in self.nodes.values():
            self._check_type_and_role(node)
            node.resolve()  # an executable that does not import fails here, naming the node
        self._check_columns()

    def _find_cycle(self) -> list[str] | None:
        state: dict[str, int] = {}  # 1: on the current path, 2: done
        path: list[str] = []

        def visit(node_id: str) -> list[str] | None:
            state[node_id] = 1
            path.append(node_id)
            for dep in self.nodes[node_id].dependencies:
                if state.get(dep) == 1:
                    # path runs from a node to its dependency; the cycle reads dependency -> dependant
                    loop = path[path.index(dep):] + [dep]
                    return list(reversed(loop))
                if dep not in state and (found := visit(dep)):
                    return found
            path.pop()
            state[node_id] = 2
            return None

        for node_id in self.nodes:
            if node_id not in state and (found := visit(node_id)):
                return found
        return None

    def _check_type_and_role(self, node: Node) -> None:
        allowed = ALLOWED_ROLES[node.node_type]
        if node.node_role not in allowed:
            raise WorkflowError(f"{node.where}: a {node.node_type} node cannot have role {node.node_role}; use one of "
                                f"{', '.join(allowed)}, or node_type custom")
        if node.node_type == NodeType.DATA_LOAD and node.dependencies:
            raise WorkflowError(f"{node.where}: a data_load node makes the step's first batch and has no "
                                f"dependencies (it has {node.dependencies}); remove them or change its type")
        if not node.dependencies and node.node_type != NodeType.DATA_LOAD:
            raise WorkflowError(f"{node.where} has no dependencies, so no data reaches it (it is unreachable from the "
                                "workflow's data_load nodes); add its dependencies, or make it a data_load node")
        if node.only_forward_compute and node.node_type != NodeType.MODEL_INFERENCE:
            raise WorkflowError(f"{node.where}: only_forward_compute applies to model_inference nodes; remove it or "
                                "make the node model_inference")
        if node.node_type == NodeType.BARRIER_SYNC and node.executable is not None:
            raise WorkflowError(f"{node.where}: a barrier_sync node has built-in behaviour and takes no executable; "
                                "remove executable_ref (use node_type custom for a function)")
        if node.node_type not in BUILTIN_TYPES and node.executable is None:
            raise WorkflowError(f"{node.where} has no executable; set executable_ref to 'package.module:function' "
                                "(the shipped ones are in baton.dag.nodes)")

    def _check_columns(self) -> None:
        for node_id in self.topological_order():
            node = self.nodes[node_id]
            reads, writes = node.columns()
            # Two dependencies bring the same column from different writers: the versions would meet here.
            seen: dict[str, tuple[str, str]] = {}  # column -> (writer, dependency it came through)
            for dep in node.dependencies:
                for column, writer in self.columns_out(dep).items():
                    if column in seen and seen[column][0] != writer:
                        first, through = seen[column]
                        raise WorkflowError(
                            f"{node.where} receives column {column!r} from two writers: {first!r} (through "
                            f"{through!r}) and {writer!r} (through {dep!r}); have one of them write another column "
                            "(a node-specific name) and combine them in a node of their own")
                    seen.setdefault(column, (writer, dep))
            origins = {dep: self.rows_from(dep) for dep in node.dependencies if self.nodes[dep].output_mode != "meta"}
            if len(set(origins.values())) > 1:
                raise WorkflowError(
                    f"{node.where} joins batches with different rows: " + ", ".join(
                        f"{dep!r} has the rows of {origin if origin.startswith('the ') else repr(origin)}"
                        for dep, origin in origins.items()) + "; a node that "
                    "changes the rows (replace, filter) must come before the fan-out, or after the merge")
            available = self.columns_into(node_id)
            missing = [c for c in reads if c not in available]
            if missing:
                upstream = ", ".join(sorted(available)) or "nothing"
                raise WorkflowError(
                    f"{node.where} reads {missing}, which no node upstream of it writes (its input has: {upstream}); "
                    "add a dependency on the node that writes it, or a node that does")
            if node.output_mode == "add":
                again = [c for c in writes if c in available]
                if again:
                    raise WorkflowError(
                        f"{node.where} writes {again}, which its input already has (from "
                        f"{', '.join(sorted({available[c] for c in again}))}); write new columns, or declare the "
                        "executable with node_function(output='replace') or 'filter' if it returns the whole batch")

    def __repr__(self) -> str:
        return f"TaskGraph({self.graph_id!r}, {len(self.nodes)} nodes)"


class Workflow:
    """Builds a `TaskGraph` in Python: `Workflow("grpo").add_node("data", "data_load", executable=...)...build()`."""

    def __init__(self, graph_id: str):
        self.graph_id = graph_id
        self._nodes: list[Node] = []

    def add_node(self, node_id: str, node_type: NodeType | str, *, role: NodeRole | str = NodeRole.DEFAULT,
                 dependencies: Sequence[str] = (), executable: str | Callable | None = None,
                 config: dict | None = None, reads: Sequence[str] | None = None, writes: Sequence[str] | None = None,
                 only_forward_compute: bool = False, agent_group: int = 0) -> "Workflow":
        self._nodes.append(Node(node_id, node_type, role, list(dependencies), dict(config or {}), executable,
                                None if reads is None else list(reads), None if writes is None else list(writes),
                                only_forward_compute, agent_group))
        return self

    def build(self) -> TaskGraph:
        return TaskGraph(self.graph_id, self._nodes)


def _enum(cls: type[enum.StrEnum], value: Any, where: str):
    try:
        return cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise WorkflowError(f"{where} {value!r} is not one of {', '.join(m.value for m in cls)}"
                            f"{_close(str(value).lower(), [m.value for m in cls])}") from None


def _close(name: str, names: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
