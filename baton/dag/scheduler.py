"""Task scheduling of DAG workflows: split a graph into subgraphs, size them, place them on ranks (siiRL-style).

`schedule(graph, layout)` turns a checked `TaskGraph` into a `Plan` in four pure, deterministic steps:

1. `split_subgraphs`: cut the graph where it fans out into branches that never meet again, so each branch can
   run on workers of its own. Unlike siiRL, which copies a shared prefix into every branch's replica, no node
   is duplicated: the prefix is a subgraph of its own and `cross_edges` are moved through a data buffer.
2. `apportion`: how many workers each subgraph gets ("even", or in proportion to its models' sizes).
3. `place`: which global ranks they are, keeping a subgraph on one machine node when one has room (or, with
   `colocate`, every subgraph on every rank: how the multi-controller executor runs a graph).
4. `process_groups`: the communication groups: the world, one per subgraph, one per model (gradient
   all-reduce and weight sync).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction

from baton.dag.graph import NodeType, TaskGraph, WorkflowError
from baton.data.atomic import atomic_file

MODEL_TYPES = (NodeType.MODEL_INFERENCE, NodeType.MODEL_TRAIN)
APPORTION_OPTIONS = ("even", "model_size")
_SIZE_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMBGT]?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Subgraph:
    """Nodes that run together on one set of workers: `node_ids` in the graph's topological order; `weight`
    the estimated size of its models (>= 1.0, see `subgraph_weight`)."""

    subgraph_id: str
    node_ids: tuple[str, ...]
    weight: float


# --- splitting ---------------------------------------------------------------------------------------------------


def split_subgraphs(graph: TaskGraph) -> list[Subgraph]:
    """The graph's irreducible subgraphs; every node in exactly one.

    At a fan-out node F, F's children are grouped by whether their descendant sets (child included) intersect.
    One group (the branches meet again downstream): nothing is cut. Two or more groups that each hold a model
    node (model_inference / model_train): every edge F -> child of those groups is cut; a group without a model
    (metrics, a filter, a log) stays with F, where its input is. The subgraphs are the undirected connected
    components of what remains, named "sg0", "sg1", ... in the topological position of their first node.
    """
    order = graph.topological_order()
    position = {node_id: i for i, node_id in enumerate(order)}
    closure = {node_id: graph.descendants(node_id) | {node_id} for node_id in order}
    cut: set[tuple[str, str]] = set()
    for node_id in order:
        children = graph.children(node_id)
        if len(children) < 2:
            continue
        heavy = [group for group in _groups(children, closure).values()
                 if any(graph.nodes[n].node_type in MODEL_TYPES for c in group for n in closure[c])]
        if len(heavy) > 1:
            cut.update((node_id, child) for group in heavy for child in group)
    component = _UnionFind(order)
    for node_id in order:
        for parent in graph.parents(node_id):
            if (parent, node_id) not in cut:
                component.union(parent, node_id)
    members: dict[str, list[str]] = {}
    for node_id in order:  # topological order: each component's list is ordered and keyed by its first node
        members.setdefault(component.find(node_id), []).append(node_id)
    firsts = sorted(members, key=lambda root: position[members[root][0]])
    return [Subgraph(f"sg{i}", tuple(members[root]), subgraph_weight(graph, members[root]))
            for i, root in enumerate(firsts)]


def cross_edges(graph: TaskGraph, subgraphs: list[Subgraph]) -> list[tuple[str, str]]:
    """(producer, consumer) edges whose ends lie in different subgraphs, in the consumer's topological order."""
    owner = _owner(subgraphs)
    return [(parent, node_id) for node_id in graph.topological_order() for parent in graph.parents(node_id)
            if owner[parent] != owner[node_id]]


# --- weights -----------------------------------------------------------------------------------------------------


def model_size(graph: TaskGraph, node_id: str) -> float:
    """A node's estimated model size: its config's `model_size` (parameters, or "0.5B", "7B", "350M"), else
    1.0 for a model_inference / model_train node and 0.0 for any other."""
    node = graph.nodes[node_id]
    value = node.config.get("model_size")
    if value is None:
        return 1.0 if node.node_type in MODEL_TYPES else 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = float(value)
    elif isinstance(value, str) and (match := _SIZE_PATTERN.match(value)):
        size = float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    else:
        size = math.nan
    if not math.isfinite(size) or size < 0:
        raise WorkflowError(f"{node.where}: model_size={value!r} is not a model size; give a number of parameters "
                            "(e.g. 7e9) or a string like '350M', '0.5B', '7B'")
    return size


def _model_key(graph: TaskGraph, node_id: str) -> str | None:
    """"role:agent_group" of the model a node runs (None for a node without a model)."""
    node = graph.nodes[node_id]
    if node.node_type in MODEL_TYPES or node.config.get("model_size") is not None:
        return f"{node.node_role}:{node.agent_group}"
    return None


def subgraph_weight(graph: TaskGraph, node_ids) -> float:
    """Sum over the distinct models among `node_ids` (one per role and agent group: the actor's train and
    old-log-prob nodes are one model, sized by the larger), at least 1.0 so a model-free subgraph gets a worker."""
    sizes: dict[str, float] = {}
    for node_id in node_ids:
        if (key := _model_key(graph, node_id)) is not None:
            sizes[key] = max(sizes.get(key, 0.0), model_size(graph, node_id))
    return max(1.0, sum(sizes.values()))


# --- apportioning ------------------------------------------------------------------------------------------------


def apportion(subgraphs: list[Subgraph], num_workers: int, by: str = "even") -> dict[str, int]:
    """Workers per subgraph id: each >= 1, summing to `num_workers`.

    "even": as equal as possible, the extra workers to the heavier subgraphs first (ties by id).
    "model_size": in proportion to weight by the largest-remainder method; a subgraph whose share is under one
    worker gets one and the rest is shared again among the others.
    """
    if by not in APPORTION_OPTIONS:
        raise WorkflowError(f"apportion by {by!r} is unknown; use one of {', '.join(APPORTION_OPTIONS)}")
    if not subgraphs:
        raise WorkflowError("there are no subgraphs to apportion workers to; split a non-empty graph first")
    if not isinstance(num_workers, int) or num_workers < len(subgraphs):
        raise WorkflowError(f"{len(subgraphs)} subgraphs need at least {len(subgraphs)} workers (one each), got "
                            f"{num_workers!r}; add device slots or merge branches of the workflow")
    ranked = sorted(subgraphs, key=lambda s: (-s.weight, _natural(s.subgraph_id)))
    if by == "even":
        base, extra = divmod(num_workers, len(subgraphs))
        counts = {s.subgraph_id: base + (1 if i < extra else 0) for i, s in enumerate(ranked)}
    else:
        counts, left, workers = {}, list(ranked), num_workers
        while True:  # give a sub-one share its one worker, then share the rest again
            total = sum(Fraction(s.weight) for s in left)
            small = [s for s in left if Fraction(s.weight) * workers < total]
            if not small:
                break
            for s in small:
                counts[s.subgraph_id] = 1
            workers -= len(small)
            left = [s for s in left if s not in small]
        quotas = {s.subgraph_id: Fraction(s.weight) * workers / total for s in left}
        counts.update({i: int(q) for i, q in quotas.items()})  # floor; each >= 1 here
        by_remainder = sorted(left, key=lambda s: -(quotas[s.subgraph_id] - int(quotas[s.subgraph_id])))
        for s in by_remainder[:workers - sum(int(q) for q in quotas.values())]:  # stable: ties keep weight, id
            counts[s.subgraph_id] += 1
    return {s.subgraph_id: counts[s.subgraph_id] for s in subgraphs}


# --- placement ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterLayout:
    """Device slots per machine node; global rank = the slots of earlier nodes + the local slot."""

    slots_per_node: tuple[int, ...]

    def __post_init__(self) -> None:
        slots = tuple(self.slots_per_node)
        if not slots or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in slots):
            raise WorkflowError(f"a cluster layout needs one or more machine nodes of >= 1 slots each, got "
                                f"{self.slots_per_node!r}; give e.g. (4, 4) for two nodes of 4 devices")
        object.__setattr__(self, "slots_per_node", slots)

    @classmethod
    def uniform(cls, num_nodes: int, slots_per_node: int) -> "ClusterLayout":
        return cls((slots_per_node,) * num_nodes)

    @property
    def total_slots(self) -> int:
        return sum(self.slots_per_node)

    def ranks_of(self, node_index: int) -> list[int]:
        start = sum(self.slots_per_node[:node_index])
        return list(range(start, start + self.slots_per_node[node_index]))

    def node_of(self, rank: int) -> int:
        for index in range(len(self.slots_per_node)):
            if rank in self.ranks_of(index):
                return index
        raise WorkflowError(f"rank {rank} is outside the layout's {self.total_slots} slots")


def place(subgraphs: list[Subgraph], counts: dict[str, int], layout: ClusterLayout) -> dict[str, list[int]]:
    """Global ranks (ascending) per subgraph id; every slot of `layout` used exactly once.

    Greedy in order of (count desc, weight desc, id). A subgraph goes wholly on one machine node when one has
    room: the one with the fewest free slots that fits (best fit, ties by lower index), keeping big holes for
    big subgraphs; else it is spread over the nodes with the most free slots first. Within a node it takes the
    lowest free ranks.
    """
    ids = [s.subgraph_id for s in subgraphs]
    if sorted(counts) != sorted(ids) or any(not isinstance(c, int) or c < 1 for c in counts.values()):
        raise WorkflowError(f"counts {counts} must give every subgraph of {ids} (and no other) >= 1 workers; "
                            "compute them with apportion()")
    if sum(counts.values()) != layout.total_slots:
        raise WorkflowError(f"counts {counts} sum to {sum(counts.values())} workers but the layout "
                            f"{layout.slots_per_node} has {layout.total_slots} slots; apportion exactly "
                            f"{layout.total_slots} workers")
    free = [layout.ranks_of(i) for i in range(len(layout.slots_per_node))]
    placement: dict[str, list[int]] = {}
    for s in sorted(subgraphs, key=lambda s: (-counts[s.subgraph_id], -s.weight, _natural(s.subgraph_id))):
        need = counts[s.subgraph_id]
        fits = [i for i in range(len(free)) if len(free[i]) >= need]
        if fits:
            nodes = [min(fits, key=lambda i: (len(free[i]), i))]
        else:
            nodes = sorted(range(len(free)), key=lambda i: (-len(free[i]), i))
        ranks: list[int] = []
        for i in nodes:
            take = min(need - len(ranks), len(free[i]))
            ranks += free[i][:take]
            free[i] = free[i][take:]
        placement[s.subgraph_id] = sorted(ranks)
    return {i: placement[i] for i in ids}


def process_groups(graph: TaskGraph, subgraphs: list[Subgraph],
                   placement: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    """Communication groups, name -> sorted ranks: "world"; "subgraph:<id>" each; and "<role>:<agent_group>"
    per model (e.g. "actor:0"): the ranks of every subgraph holding a node of that model."""
    groups = {"world": tuple(sorted({r for ranks in placement.values() for r in ranks}))}  # colocated: shared
    groups.update({f"subgraph:{s.subgraph_id}": tuple(sorted(placement[s.subgraph_id])) for s in subgraphs})
    owner = _owner(subgraphs)
    models: dict[str, set[int]] = {}
    for node_id in graph.topological_order():
        if (key := _model_key(graph, node_id)) is not None:
            models.setdefault(key, set()).update(placement[owner[node_id]])
    groups.update({key: tuple(sorted(ranks)) for key, ranks in models.items()})
    return groups


# --- the plan ----------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Where every node of `graph` runs: its subgraphs, their worker counts and ranks, the process groups and
    the edges that cross subgraphs (through a data buffer between disjoint workers; in the rank's local cache
    when `colocated`)."""

    graph: TaskGraph
    subgraphs: list[Subgraph]
    counts: dict[str, int]
    placement: dict[str, list[int]]
    groups: dict[str, tuple[int, ...]]
    cross_edges: list[tuple[str, str]]
    layout: ClusterLayout
    colocated: bool = False

    def table(self) -> str:
        """Plain text: one row per subgraph (id | ranks | machine nodes | graph nodes), then the process groups
        and the cross-subgraph edges."""
        rows = [("subgraph", "ranks", "machine nodes", "graph nodes")]
        for s in self.subgraphs:
            ranks = self.placement[s.subgraph_id]
            machines = sorted({self.layout.node_of(r) for r in ranks})
            rows.append((s.subgraph_id, compact(ranks), compact(machines), " -> ".join(s.node_ids)))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [" | ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + " | " + row[3] for row in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * len(rows[0][3]))
        lines += ["", "process groups:"] + [f"  {name}: {compact(ranks)}" for name, ranks in self.groups.items()]
        owner = _owner(self.subgraphs)
        via = " (colocated: every subgraph on every rank; each edge stays in the rank's local cache)" \
            if self.colocated else ""
        lines += ["", f"cross-subgraph edges{via}:"]
        lines += [f"  {a} -> {b} ({owner[a]} -> {owner[b]})" for a, b in self.cross_edges] or ["  (none)"]
        return "\n".join(lines)

    def draw(self, path: str, overwrite: bool = False) -> str:
        """Write a PNG of the graph to `path` (atomically): nodes by topological depth (x) and index within the
        depth (y), boxes coloured by subgraph, arrows for dependencies, dashed where they cross subgraphs.
        An existing `path` raises FileExistsError unless `overwrite`. Returns `path`."""
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"{path} exists; choose another path or pass overwrite=True")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        order = self.graph.topological_order()
        depth: dict[str, int] = {}
        for node_id in order:
            depth[node_id] = 1 + max((depth[p] for p in self.graph.parents(node_id)), default=-1)
        at: dict[str, tuple[float, float]] = {}
        per_depth: dict[int, int] = {}
        for node_id in order:
            row = per_depth[depth[node_id]] = per_depth.get(depth[node_id], -1) + 1
            at[node_id] = (depth[node_id] * 3.0, -row * 1.5)
        owner = _owner(self.subgraphs)
        palette = [f"C{i}" for i in range(10)]
        colour = {s.subgraph_id: palette[i % 10] for i, s in enumerate(self.subgraphs)}
        figure = Figure(figsize=(2.2 + 2.2 * (max(depth.values()) + 1), 1.5 + 1.0 * max(per_depth.values()) + 1))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        crossing = set(self.cross_edges)
        for node_id in order:
            for parent in self.graph.parents(node_id):
                axes.annotate("", xy=at[node_id], xytext=at[parent], arrowprops=dict(
                    arrowstyle="-|>", shrinkA=22, shrinkB=22, color="0.3",
                    linestyle="--" if (parent, node_id) in crossing else "-"))
        for node_id, (x, y) in at.items():
            axes.text(x, y, node_id, ha="center", va="center", fontsize=9,
                      bbox=dict(boxstyle="round,pad=0.4", facecolor=colour[owner[node_id]], alpha=0.6))
        xs, ys = [x for x, _ in at.values()], [y for _, y in at.values()]
        axes.set_xlim(min(xs) - 1.5, max(xs) + 1.5)
        axes.set_ylim(min(ys) - 1.0, max(ys) + 1.0)
        axes.axis("off")
        axes.legend(handles=[Patch(color=colour[s.subgraph_id], alpha=0.6,
                                   label=f"{s.subgraph_id}: ranks {compact(self.placement[s.subgraph_id])}")
                             for s in self.subgraphs], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        axes.set_title(f"{self.graph.graph_id}: {len(self.subgraphs)} subgraphs on {self.layout.total_slots} ranks")
        with atomic_file(path, binary=True) as f:
            figure.savefig(f, format="png", dpi=100, bbox_inches="tight")
        return path


def schedule(graph: TaskGraph, layout: ClusterLayout, apportion_by: str = "even", colocate: bool = False) -> Plan:
    """Split `graph`, apportion every slot of `layout` to its subgraphs, place them and derive the groups.

    colocate: every subgraph on every slot (each slot's process holds every model, as the multi-controller
    executor runs): the subgraphs take turns on the ranks, every model's group is the world, and an edge between
    subgraphs joins a producer and a consumer of one data-parallel layout, so it stays in the rank's local cache."""
    subgraphs = split_subgraphs(graph)
    if colocate:
        counts = {s.subgraph_id: layout.total_slots for s in subgraphs}
        placement = {s.subgraph_id: list(range(layout.total_slots)) for s in subgraphs}
    else:
        counts = apportion(subgraphs, layout.total_slots, apportion_by)
        placement = place(subgraphs, counts, layout)
    return Plan(graph, subgraphs, counts, placement, process_groups(graph, subgraphs, placement),
                cross_edges(graph, subgraphs), layout, colocate)


# --- helpers -----------------------------------------------------------------------------------------------------


def compact(numbers) -> str:
    """Sorted integers as runs: [0, 1, 2, 3, 6] -> "0-3,6"; [0, 2, 5] -> "0,2,5"."""
    numbers, parts = sorted(numbers), []
    start = 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            first, last = numbers[start], numbers[i - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(parts)


def _groups(children: list[str], closure: dict[str, set[str]]) -> dict[str, list[str]]:
    """`children` grouped (union-find root -> members) by whether their closures intersect."""
    groups = _UnionFind(children)
    for i, a in enumerate(children):
        for b in children[i + 1:]:
            if closure[a] & closure[b]:
                groups.union(a, b)
    out: dict[str, list[str]] = {}
    for child in children:
        out.setdefault(groups.find(child), []).append(child)
    return out


def _owner(subgraphs: list[Subgraph]) -> dict[str, str]:
    return {node_id: s.subgraph_id for s in subgraphs for node_id in s.node_ids}


def _natural(text: str) -> list:
    """Sort key with digit runs compared as numbers: "sg2" before "sg10"."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part]


class _UnionFind:
    def __init__(self, items):
        self.parent = {item: item for item in items}

    def find(self, item: str) -> str:
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)
