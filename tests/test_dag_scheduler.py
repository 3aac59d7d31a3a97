"""baton.dag.scheduler: splitting workflows into subgraphs, apportioning workers, placement, groups, the plan."""

import pytest

from baton.dag.graph import Workflow, WorkflowError
from baton.dag.scheduler import (ClusterLayout, Subgraph, apportion, compact, cross_edges, model_size, place,
                                 process_groups, schedule, split_subgraphs)


def step(*args):  # the executable of every test node; never called here
    return args


def grpo(actor_size=None):
    """data -> gen -> reward -> advantage -> old_log_prob -> train (a linear chain)."""
    size = {} if actor_size is None else {"model_size": actor_size}
    return (Workflow("grpo")
            .add_node("data", "data_load", executable=step)
            .add_node("gen", "model_inference", role="rollout", dependencies=["data"], executable=step)
            .add_node("reward", "compute", role="reward", dependencies=["gen"], executable=step)
            .add_node("advantage", "compute", role="advantage", dependencies=["reward"], executable=step)
            .add_node("old_log_prob", "model_inference", role="actor", dependencies=["advantage"],
                      only_forward_compute=True, executable=step, config=size)
            .add_node("train", "model_train", role="actor", dependencies=["old_log_prob"], executable=step,
                      config=size)
            .build())


def diamond():
    """data -> gen -> {reward_a, reward_b} -> merge -> train: the branches meet again."""
    return (Workflow("diamond")
            .add_node("data", "data_load", executable=step)
            .add_node("gen", "model_inference", role="rollout", dependencies=["data"], executable=step)
            .add_node("reward_a", "compute", role="reward", dependencies=["gen"], executable=step)
            .add_node("reward_b", "compute", role="reward", dependencies=["gen"], executable=step)
            .add_node("merge", "compute", dependencies=["reward_a", "reward_b"], executable=step)
            .add_node("train", "model_train", role="actor", dependencies=["merge"], executable=step)
            .build())


def branches(b_first=False, a2_size=None):
    """data -> gen -> {a1 -> a2, b1 -> b2}: two branches to disjoint exits (agent groups 0 and 1)."""
    a = [("a1", "model_inference", "actor", ["gen"], 0, None), ("a2", "model_train", "actor", ["a1"], 0, a2_size)]
    b = [("b1", "model_inference", "actor", ["gen"], 1, None), ("b2", "model_train", "actor", ["b1"], 1, None)]
    flow = (Workflow("two_agents").add_node("data", "data_load", executable=step)
            .add_node("gen", "model_inference", role="rollout", dependencies=["data"], executable=step))
    for node_id, kind, role, deps, group, size in (b + a if b_first else a + b):
        flow.add_node(node_id, kind, role=role, dependencies=deps, agent_group=group, executable=step,
                      config={} if size is None else {"model_size": size})
    return flow.build()


def node_sets(subgraphs):
    return {frozenset(s.node_ids) for s in subgraphs}


# --- splitting ---------------------------------------------------------------------------------------------------


def test_linear_chain_is_one_subgraph_in_topological_order():
    [only] = split_subgraphs(grpo())
    assert only.subgraph_id == "sg0"
    assert only.node_ids == ("data", "gen", "reward", "advantage", "old_log_prob", "train")
    assert only.weight == 2.0  # rollout + actor (train and old_log_prob are one model)
    assert cross_edges(grpo(), [only]) == []


def test_reconverging_diamond_is_not_cut():
    graph = diamond()
    [only] = split_subgraphs(graph)
    assert only.node_ids == ("data", "gen", "reward_a", "reward_b", "merge", "train")
    assert cross_edges(graph, [only]) == []


def test_disjoint_branches_are_three_subgraphs_without_duplicates():
    graph = branches()
    subgraphs = split_subgraphs(graph)
    assert [(s.subgraph_id, s.node_ids) for s in subgraphs] == [
        ("sg0", ("data", "gen")), ("sg1", ("a1", "a2")), ("sg2", ("b1", "b2"))]
    every = [n for s in subgraphs for n in s.node_ids]
    assert sorted(every) == sorted(graph.nodes)  # each node once
    assert [s.weight for s in subgraphs] == [1.0, 1.0, 1.0]
    assert cross_edges(graph, subgraphs) == [("gen", "a1"), ("gen", "b1")]


def test_branch_that_meets_the_prefix_again_stays_with_it():
    # gen fans out to two model branches with disjoint descendants, but data also feeds b2, so b's branch is cut
    # off only from gen and stays connected to the prefix through data -> b2.
    graph = (Workflow("w").add_node("data", "data_load", executable=step)
             .add_node("gen", "model_inference", role="rollout", dependencies=["data"], executable=step)
             .add_node("a", "model_train", role="actor", dependencies=["gen"], executable=step)
             .add_node("b", "model_train", role="critic", dependencies=["gen"], executable=step)
             .add_node("b2", "compute", dependencies=["b", "data"], executable=step).build())
    subgraphs = split_subgraphs(graph)
    assert node_sets(subgraphs) == {frozenset({"data", "gen", "b", "b2"}), frozenset({"a"})}
    assert cross_edges(graph, subgraphs) == [("gen", "a")]


def test_a_branch_without_a_model_stays_where_its_input_is():
    # GRPO's advantage fans out to the batch metrics (an exit, no model) and the update: one subgraph, not three.
    graph = (Workflow("w").add_node("data", "data_load", executable=step)
             .add_node("gen", "model_inference", role="rollout", dependencies=["data"], executable=step)
             .add_node("advantage", "compute", role="advantage", dependencies=["gen"], executable=step)
             .add_node("metrics", "compute", dependencies=["advantage"], executable=step)
             .add_node("train", "model_train", role="actor", dependencies=["advantage"], executable=step)
             .add_node("sync", "custom", role="actor", dependencies=["train"], executable=step).build())
    [only] = split_subgraphs(graph)
    assert only.node_ids == ("data", "gen", "advantage", "metrics", "train", "sync")


def test_split_is_deterministic_and_independent_of_node_order():
    first, again = split_subgraphs(branches()), split_subgraphs(branches())
    assert first == again
    swapped = split_subgraphs(branches(b_first=True))
    assert node_sets(swapped) == node_sets(first)
    assert swapped[1].node_ids == ("b1", "b2")  # ids follow the topological position of the first node


# --- weights -----------------------------------------------------------------------------------------------------


def test_model_size_parsing():
    graph = grpo(actor_size="7B")
    assert model_size(graph, "train") == 7e9
    assert model_size(graph, "gen") == 1.0 and model_size(graph, "reward") == 0.0
    assert split_subgraphs(graph)[0].weight == 7e9 + 1.0  # one actor model (max of its nodes) + rollout
    for value, expected in (("0.5B", 5e8), ("350M", 3.5e8), ("1.5k", 1500.0), (1_000_000, 1e6), ("42", 42.0)):
        assert model_size(grpo(actor_size=value), "train") == expected
    for bad in ("7 bytes", "B7", "-1B", True, [7]):
        with pytest.raises(WorkflowError, match="node 'old_log_prob'.*model_size"):
            model_size(grpo(actor_size=bad), "old_log_prob")


# --- apportioning ------------------------------------------------------------------------------------------------


def subs(*weights):
    return [Subgraph(f"sg{i}", (f"n{i}",), float(w)) for i, w in enumerate(weights)]


def test_apportion_even_gives_the_extra_workers_to_heavier_subgraphs():
    assert apportion(subs(1, 1, 2), 8) == {"sg0": 3, "sg1": 2, "sg2": 3}
    assert apportion(subs(1, 1, 1), 7) == {"sg0": 3, "sg1": 2, "sg2": 2}
    assert apportion(subs(1, 1, 1), 3) == {"sg0": 1, "sg1": 1, "sg2": 1}


def test_apportion_by_model_size_is_proportional_with_at_least_one_each():
    assert apportion(subs(1, 1, 2), 8, by="model_size") == {"sg0": 2, "sg1": 2, "sg2": 4}
    assert apportion(subs(1, 1, 1), 7, by="model_size") == {"sg0": 3, "sg1": 2, "sg2": 2}
    # 0.5B and 7B on 8: the small one's share (0.53) is under one worker: it gets 1, the big one 7.
    assert apportion(subs(5e8, 7e9), 8, by="model_size") == {"sg0": 1, "sg1": 7}
    assert apportion(subs(1, 1, 6), 8, by="model_size") == {"sg0": 1, "sg1": 1, "sg2": 6}
    assert apportion(subs(1, 1, 100), 4, by="model_size") == {"sg0": 1, "sg1": 1, "sg2": 2}
    counts = apportion(subs(3, 1, 1, 7), 10, by="model_size")
    assert sum(counts.values()) == 10 and min(counts.values()) >= 1


def test_apportion_errors():
    with pytest.raises(WorkflowError, match="3 subgraphs need at least 3 workers"):
        apportion(subs(1, 1, 1), 2)
    with pytest.raises(WorkflowError, match="even, model_size"):
        apportion(subs(1), 2, by="flops")


# --- placement ---------------------------------------------------------------------------------------------------


def test_place_keeps_each_subgraph_on_one_machine_node():
    placement = place(subs(1, 1, 1), {"sg0": 2, "sg1": 4, "sg2": 2}, ClusterLayout.uniform(2, 4))
    assert placement == {"sg0": [4, 5], "sg1": [0, 1, 2, 3], "sg2": [6, 7]}


def test_place_best_fit_on_an_uneven_layout():
    layout = ClusterLayout((3, 5))
    assert layout.total_slots == 8 and layout.ranks_of(1) == [3, 4, 5, 6, 7] and layout.node_of(3) == 1
    # The 3 goes into the 3-slot node (best fit), leaving the 5-slot node whole for the 2, 2 and 1.
    placement = place(subs(1, 1, 1, 1), {"sg0": 3, "sg1": 2, "sg2": 2, "sg3": 1}, layout)
    assert placement == {"sg0": [0, 1, 2], "sg1": [3, 4], "sg2": [5, 6], "sg3": [7]}
    assert place(subs(1, 1), {"sg0": 3, "sg1": 5}, layout) == {"sg0": [0, 1, 2], "sg1": [3, 4, 5, 6, 7]}


def test_place_spreads_when_no_node_has_room():
    layout = ClusterLayout.uniform(2, 4)
    assert place(subs(1, 1), {"sg0": 6, "sg1": 2}, layout) == {"sg0": [0, 1, 2, 3, 4, 5], "sg1": [6, 7]}
    # 3 and 3 take a node each; the 2 is left with one slot on each node.
    assert place(subs(1, 1, 1), {"sg0": 3, "sg1": 3, "sg2": 2}, layout) == {
        "sg0": [0, 1, 2], "sg1": [4, 5, 6], "sg2": [3, 7]}


def test_place_errors():
    layout = ClusterLayout.uniform(2, 4)
    with pytest.raises(WorkflowError, match="sum to 7 workers but the layout.*8 slots"):
        place(subs(1, 1), {"sg0": 4, "sg1": 3}, layout)
    with pytest.raises(WorkflowError, match="every subgraph"):
        place(subs(1, 1), {"sg0": 8}, layout)
    with pytest.raises(WorkflowError, match="slots each"):
        ClusterLayout((4, 0))


# --- groups and the plan -----------------------------------------------------------------------------------------


def test_process_groups():
    plan = schedule(branches(), ClusterLayout.uniform(2, 4))
    assert plan.counts == {"sg0": 3, "sg1": 3, "sg2": 2}  # all weigh 1: the extra two go to sg0 and sg1
    assert plan.placement == {"sg0": [0, 1, 2], "sg1": [4, 5, 6], "sg2": [3, 7]}
    assert plan.groups == {
        "world": (0, 1, 2, 3, 4, 5, 6, 7), "subgraph:sg0": (0, 1, 2), "subgraph:sg1": (4, 5, 6),
        "subgraph:sg2": (3, 7), "rollout:0": (0, 1, 2), "actor:0": (4, 5, 6), "actor:1": (3, 7)}
    single = schedule(grpo(), ClusterLayout.uniform(1, 4))
    assert single.groups["actor:0"] == single.groups["world"] == (0, 1, 2, 3)
    assert "reward:0" not in single.groups  # a compute reward without a model_size runs no model


def test_schedule_by_model_size_and_determinism():
    layout = ClusterLayout.uniform(2, 4)
    plan = schedule(branches(a2_size="2"), layout, apportion_by="model_size")
    assert [s.weight for s in plan.subgraphs] == [1.0, 2.0, 1.0]
    assert plan.counts == {"sg0": 2, "sg1": 4, "sg2": 2}
    assert plan.placement == {"sg0": [4, 5], "sg1": [0, 1, 2, 3], "sg2": [6, 7]}
    again = schedule(branches(a2_size="2"), layout, apportion_by="model_size")
    assert (again.subgraphs, again.counts, again.placement, again.groups, again.cross_edges) == (
        plan.subgraphs, plan.counts, plan.placement, plan.groups, plan.cross_edges)
    assert again.table() == plan.table()


def test_colocated_schedule_puts_every_subgraph_on_every_rank():
    """As the multi-controller runs a graph that splits: same subgraphs and cross edges, every model's group the
    world, and the table says the edges stay in the ranks' local caches."""
    layout = ClusterLayout.uniform(2, 4)
    plan, disjoint = schedule(branches(), layout, colocate=True), schedule(branches(), layout)
    assert plan.subgraphs == disjoint.subgraphs and plan.cross_edges == disjoint.cross_edges
    assert plan.counts == {"sg0": 8, "sg1": 8, "sg2": 8}
    assert plan.placement == {s: list(range(8)) for s in ("sg0", "sg1", "sg2")}
    assert set(plan.groups.values()) == {tuple(range(8))}
    assert "cross-subgraph edges (colocated: every subgraph on every rank; each edge stays in the rank's local " \
           "cache):" in plan.table().splitlines()


def test_table_lists_rows_groups_and_cross_edges():
    table = schedule(branches(), ClusterLayout.uniform(2, 4)).table()
    lines = table.splitlines()
    assert lines[0].split(" | ")[0].strip() == "subgraph"
    assert [cell.strip() for cell in lines[2].split(" | ")] == ["sg0", "0-2", "0", "data -> gen"]
    assert [cell.strip() for cell in lines[4].split(" | ")] == ["sg2", "3,7", "0-1", "b1 -> b2"]
    assert "  actor:1: 3,7" in lines and "  world: 0-7" in lines
    assert "  gen -> a1 (sg0 -> sg1)" in lines
    assert "(none)" in schedule(grpo(), ClusterLayout.uniform(1, 2)).table()
    assert compact([0, 1, 2, 3, 6]) == "0-3,6" and compact([5, 0, 2]) == "0,2,5"


def test_draw_writes_a_png_and_refuses_to_overwrite(tmp_path):
    plan = schedule(branches(), ClusterLayout.uniform(2, 4))
    path = tmp_path / "plan.png"
    assert plan.draw(str(path)) == str(path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileExistsError, match="plan.png"):
        plan.draw(str(path))
    path.write_bytes(b"old")
    plan.draw(str(path), overwrite=True)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.png"]  # no temp file left behind
