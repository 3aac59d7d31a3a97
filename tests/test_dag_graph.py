"""baton.dag.graph and baton.dag.loader: every validation error (naming the node and the fix), column flow through
add / replace / filter nodes, graph structure, siiRL's YAML schema, and the shipped RLVR workflows. Pure Python."""

from __future__ import annotations

import re

import pytest

from baton.dag.graph import (
    Node,
    NodeRole,
    NodeStatus,
    NodeType,
    TaskGraph,
    Workflow,
    WorkflowError,
    node_function,
)
from baton.dag.loader import load_workflow

NODES = "baton.dag.nodes"


# --- small executables with column contracts -----------------------------------------------------------------


@node_function(writes=["prompt", "uid"])
def load(ctx, batch):
    return batch


@node_function(reads=["prompt"], writes=["response", "mask"], output="replace")
def gen(ctx, batch):
    return batch


@node_function(reads=["prompt"], writes=["score"])
def score(batch, config):
    return batch


@node_function(reads=["score"], output="filter")
def keep(batch, config):
    return batch


@node_function(reads=["uid"], writes=["flag"], output="filter")
def keep_and_flag(batch, config):
    return batch


@node_function(writes=lambda cfg: [cfg["column"]])
def configurable(batch, config):
    return batch


@node_function(reads=lambda cfg: cfg.get("needs", []))
def configurable_reader(batch, config):
    return batch


def plain(batch, config):  # no declaration: reads and writes nothing, output "add"
    return batch


@node_function(writes=["x"])
def write_x(batch, config):
    return batch


@node_function(writes=["y"])
def write_y(batch, config):
    return batch


@node_function(writes=["prompt"])
def write_prompt(batch, config):
    return batch


NOT_CALLABLE = 42


def flow(graph_id: str = "wf") -> Workflow:
    return Workflow(graph_id).add_node("data", "data_load", executable=load)


# --- 1. validation errors -------------------------------------------------------------------------------------


def test_duplicate_node_ids():
    with pytest.raises(WorkflowError, match=r"workflow 'wf': two nodes have the id 'data'; node ids must be unique: "
                                            r"rename one"):
        flow().add_node("data", "compute", dependencies=["data"], executable=plain).build()


def test_unknown_dependency_with_close_match():
    with pytest.raises(WorkflowError) as info:
        (flow().add_node("rollout", "model_inference", role="rollout", dependencies=["data"], executable=gen)
         .add_node("reward", "compute", dependencies=["rolout"], executable=score).build())
    msg = str(info.value)
    assert msg.startswith("node 'reward' (compute, default) depends on 'rolout', which is not a node of workflow 'wf'")
    assert "(did you mean 'rollout'?)" in msg
    assert msg.endswith("fix the dependency or add the node")


def test_unknown_dependency_without_close_match_has_no_hint():
    with pytest.raises(WorkflowError, match=r"node 'a' \(compute, default\) depends on 'zzzzzz'") as info:
        flow().add_node("a", "compute", dependencies=["zzzzzz"], executable=plain).build()
    assert "did you mean" not in str(info.value)


def test_depends_on_itself():
    with pytest.raises(WorkflowError, match=r"node 'a' \(compute, default\) depends on itself; remove 'a' from its "
                                            r"dependencies"):
        flow().add_node("a", "compute", dependencies=["data", "a"], executable=plain).build()


def test_dependency_listed_twice():
    with pytest.raises(WorkflowError, match=re.escape("node 'a' (compute, default) lists a dependency twice "
                                                      "(['data', 'data']); list each once")):
        flow().add_node("a", "compute", dependencies=["data", "data"], executable=plain).build()


def test_cycle_names_the_path():
    # a -> b -> c -> a (each arrow: dependency -> dependant), beside a valid entry.
    with pytest.raises(WorkflowError) as info:
        (flow().add_node("a", "compute", dependencies=["data", "c"], executable=plain)
         .add_node("b", "compute", dependencies=["a"], executable=plain)
         .add_node("c", "compute", dependencies=["b"], executable=plain).build())
    msg = str(info.value)
    assert msg.startswith("workflow 'wf' has a cycle: ")
    assert msg.endswith("a workflow must be acyclic: remove one of these dependencies")
    path = msg.split("has a cycle: ")[1].split(";")[0]
    rotations = {"a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c"}
    assert path in rotations, path
    assert path == "a -> b -> c -> a"  # found from 'a', the first node of the cycle given


def test_two_node_cycle():
    with pytest.raises(WorkflowError, match=r"has a cycle: (a -> b -> a|b -> a -> b);"):
        (flow().add_node("a", "compute", dependencies=["b"], executable=plain)
         .add_node("b", "compute", dependencies=["a"], executable=plain).build())


@pytest.mark.parametrize("node_type, role, allowed", [
    ("model_train", "rollout", "actor, critic"),
    ("compute", "actor", "default, reward, advantage, dynamic_sampling"),
    ("data_load", "actor", "default"),
    ("barrier_sync", "critic", "default"),
])
def test_type_role_mismatch(node_type, role, allowed):
    with pytest.raises(WorkflowError, match=re.escape(
            f"node 'n' ({node_type}, {role}): a {node_type} node cannot have role {role}; use one of {allowed}, or "
            "node_type custom")):
        flow().add_node("n", node_type, role=role, dependencies=[] if node_type == "data_load" else ["data"],
                        executable=None if node_type == "barrier_sync" else plain).build()


def test_custom_node_takes_any_role():
    graph = flow().add_node("n", "custom", role="critic", dependencies=["data"], executable=plain).build()
    assert graph.nodes["n"].node_role is NodeRole.CRITIC


def test_data_load_with_dependencies():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'more' (data_load, default): a data_load node makes the step's first batch and has no dependencies "
            "(it has ['data']); remove them or change its type")):
        flow().add_node("more", "data_load", dependencies=["data"], executable=load).build()


def test_non_data_load_without_dependencies_is_unreachable():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'orphan' (compute, default) has no dependencies, so no data reaches it (it is unreachable from the "
            "workflow's data_load nodes); add its dependencies, or make it a data_load node")):
        flow().add_node("orphan", "compute", executable=plain).build()


def test_only_forward_compute_on_non_inference_node():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'train' (model_train, actor): only_forward_compute applies to model_inference nodes; remove it or "
            "make the node model_inference")):
        flow().add_node("train", "model_train", role="actor", dependencies=["data"], executable=plain,
                        only_forward_compute=True).build()


def test_barrier_sync_with_executable():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'wait' (barrier_sync, default): a barrier_sync node has built-in behaviour and takes no executable; "
            "remove executable_ref (use node_type custom for a function)")):
        flow().add_node("wait", "barrier_sync", dependencies=["data"], executable=plain).build()


def test_builtin_types_need_no_executable():
    graph = (flow().add_node("wait", "barrier_sync", dependencies=["data"])
             .add_node("put", "put_to_buffer", dependencies=["wait"])
             .add_node("get", "get_from_buffer", dependencies=["put"]).build())
    assert graph.topological_order() == ["data", "wait", "put", "get"]
    assert graph.columns_out("get") == {"prompt": "data", "uid": "data"}  # pass-through, output "add"


def test_node_without_executable():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'c' (compute, default) has no executable; set executable_ref to 'package.module:function' (the "
            "shipped ones are in baton.dag.nodes)")):
        flow().add_node("c", "compute", dependencies=["data"]).build()


def test_data_load_without_executable():
    with pytest.raises(WorkflowError, match=r"node 'data' \(data_load, default\) has no executable"):
        Workflow("wf").add_node("data", "data_load").build()


def test_executable_module_missing():
    with pytest.raises(WorkflowError) as info:
        flow().add_node("c", "compute", dependencies=["data"], executable="baton.dag.no_such_module:fn").build()
    msg = str(info.value)
    assert msg.startswith("node 'c' (compute, default): executable 'baton.dag.no_such_module:fn' does not import: ")
    assert "no module named 'baton.dag.no_such_module'" in msg
    assert msg.endswith("give an import path 'package.module:function' of a module on sys.path")


def test_executable_attribute_missing_with_close_match():
    with pytest.raises(WorkflowError) as info:
        flow().add_node("c", "compute", dependencies=["data"], executable=f"{NODES}:compute_advantag").build()
    msg = str(info.value)
    assert msg.startswith(f"node 'c' (compute, default): executable '{NODES}:compute_advantag' does not import")
    assert f"'{NODES}' has no attribute 'compute_advantag'; did you mean 'compute_advantage'?" in msg


def test_executable_not_an_import_path():
    with pytest.raises(WorkflowError) as info:
        flow().add_node("c", "compute", dependencies=["data"], executable=f"{NODES}.compute_advantage").build()
    msg = str(info.value)
    assert f"node 'c' (compute, default): executable '{NODES}.compute_advantage' does not import" in msg
    assert "is not of the form 'package.module:Name'" in msg


def test_executable_not_callable():
    with pytest.raises(WorkflowError, match=re.escape(
            f"node 'c' (compute, default): executable '{NODES}:PROMPT_COLUMNS' is a list, not a function")):
        flow().add_node("c", "compute", dependencies=["data"], executable=f"{NODES}:PROMPT_COLUMNS").build()


def test_executable_neither_string_nor_callable():
    with pytest.raises(WorkflowError, match=r"node 'c' \(compute, default\).*executable 42"):
        flow().add_node("c", "compute", dependencies=["data"], executable=NOT_CALLABLE).build()


def test_read_of_a_column_nobody_writes():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'k' (compute, default) reads ['score'], which no node upstream of it writes (its input has: prompt, "
            "uid); add a dependency on the node that writes it, or a node that does")):
        flow().add_node("k", "compute", dependencies=["data"], executable=keep).build()


def test_read_with_nothing_upstream_says_nothing():
    with pytest.raises(WorkflowError, match=re.escape("reads ['prompt'], which no node upstream of it writes (its "
                                                      "input has: nothing)")):
        (Workflow("wf").add_node("data", "data_load", executable=plain)
         .add_node("s", "compute", dependencies=["data"], executable=score).build())


def test_read_not_upstream_though_written_elsewhere():
    # 'score' is written by a sibling, not by anything upstream of 'k'.
    with pytest.raises(WorkflowError, match=r"node 'k' \(compute, default\) reads \['score'\]"):
        (flow().add_node("s", "compute", dependencies=["data"], executable=score)
         .add_node("k", "compute", dependencies=["data"], executable=keep).build())


def test_parallel_writers_of_one_column_meet_at_merge():
    with pytest.raises(WorkflowError) as info:
        (flow().add_node("a", "compute", dependencies=["data"], executable=write_x)
         .add_node("b", "compute", dependencies=["data"], executable=write_x)
         .add_node("m", "compute", dependencies=["a", "b"], executable=plain).build())
    assert str(info.value) == (
        "node 'm' (compute, default) receives column 'x' from two writers: 'a' (through 'a') and 'b' (through 'b'); "
        "have one of them write another column (a node-specific name) and combine them in a node of their own")


def test_parallel_writers_meet_further_down():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'm' (compute, default) receives column 'x' from two writers: 'a' (through 'a2') and 'b' (through "
            "'b2')")):
        (flow().add_node("a", "compute", dependencies=["data"], executable=write_x)
         .add_node("b", "compute", dependencies=["data"], executable=write_x)
         .add_node("a2", "compute", dependencies=["a"], executable=plain)
         .add_node("b2", "compute", dependencies=["b"], executable=plain)
         .add_node("m", "compute", dependencies=["a2", "b2"], executable=plain).build())


def test_parallel_writers_that_never_meet_are_fine_and_shared_columns_merge():
    graph = (flow().add_node("a", "compute", dependencies=["data"], executable=write_x)
             .add_node("b", "compute", dependencies=["data"], executable=write_x)
             .add_node("c", "compute", dependencies=["data"], executable=write_y)
             .add_node("m", "compute", dependencies=["a", "c"], executable=plain).build())
    # 'prompt'/'uid' reach m through a and c from the same writer: no conflict.
    assert graph.columns_into("m") == {"prompt": "data", "uid": "data", "x": "a", "y": "c"}
    assert sorted(graph.exits()) == ["b", "m"]


def test_add_node_rewriting_an_input_column():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'w' (compute, default) writes ['prompt'], which its input already has (from data); write new "
            "columns, or declare the executable with node_function(output='replace') or 'filter' if it returns the "
            "whole batch")):
        flow().add_node("w", "compute", dependencies=["data"], executable=write_prompt).build()


def test_filter_and_replace_may_rewrite_input_columns():
    graph = (flow().add_node("f", "compute", dependencies=["data"], executable=keep_and_flag, writes=["prompt"])
             .add_node("r", "model_inference", role="rollout", dependencies=["f"], executable=gen,
                       writes=["prompt", "response"]).build())
    assert graph.columns_out("f") == {"prompt": "f", "uid": "data"}
    assert graph.columns_out("r") == {"prompt": "r", "response": "r"}


def test_unknown_node_type_with_close_match():
    with pytest.raises(WorkflowError) as info:
        flow().add_node("r", "MODEL_INFERNCE", dependencies=["data"], executable=gen)
    msg = str(info.value)
    assert msg.startswith("node 'r': node_type 'MODEL_INFERNCE' is not one of compute, data_load, model_inference, ")
    assert msg.endswith("(did you mean 'model_inference'?)")


def test_unknown_node_role_with_close_match():
    with pytest.raises(WorkflowError) as info:
        flow().add_node("r", "model_inference", role="rolout", dependencies=["data"], executable=gen)
    msg = str(info.value)
    assert msg.startswith("node 'r': node_role 'rolout' is not one of default, actor, rollout, ")
    assert msg.endswith("(did you mean 'rollout'?)")


def test_unknown_node_type_without_close_match():
    with pytest.raises(WorkflowError, match=r"node 'r': node_type 'qqq' is not one of compute, .*custom$"):
        Node("r", "qqq")


def test_types_and_roles_are_case_insensitive():
    node = Node("r", "MODEL_INFERENCE", "Rollout", dependencies="data", executable=gen)
    assert node.node_type is NodeType.MODEL_INFERENCE and node.node_role is NodeRole.ROLLOUT
    assert node.dependencies == ["data"]  # one dependency as a string
    assert node.where == "node 'r' (model_inference, rollout)"


@pytest.mark.parametrize("node_id", ["", None, 3])
def test_node_id_must_be_a_non_empty_string(node_id):
    with pytest.raises(WorkflowError, match=re.escape(f"a node id must be a non-empty string, got {node_id!r}")):
        Node(node_id, "compute")


@pytest.mark.parametrize("group", [-1, "0", 1.0])
def test_agent_group_must_be_a_non_negative_int(group):
    with pytest.raises(WorkflowError, match=re.escape(f"node 'n': agent_group={group!r} must be an int >= 0")):
        Node("n", "compute", agent_group=group)


def test_empty_workflow():
    with pytest.raises(WorkflowError, match=re.escape("workflow 'empty' has no nodes; add at least a data_load node")):
        Workflow("empty").build()
    with pytest.raises(WorkflowError, match="has no nodes"):
        TaskGraph("empty", [])


def test_node_function_rejects_unknown_output_mode():
    with pytest.raises(ValueError, match=re.escape("node_function(output='append'): use one of add, replace, filter")):
        node_function(output="append")


# --- 2. column flow -------------------------------------------------------------------------------------------


def chain() -> TaskGraph:
    return (flow().add_node("gen", "model_inference", role="rollout", dependencies=["data"], executable=gen)
            .add_node("score", "compute", role="reward", dependencies=["gen"], executable=score, reads=["response"])
            .add_node("keep", "compute", role="dynamic_sampling", dependencies=["score"], executable=keep)
            .add_node("flag", "compute", dependencies=["keep"], executable=keep_and_flag, reads=["response"]).build())


def test_columns_add_replace_filter():
    graph = chain()
    assert graph.columns_into("data") == {}
    assert graph.columns_out("data") == {"prompt": "data", "uid": "data"}
    # replace: only what it writes goes on (the prompts' columns do not).
    assert graph.columns_into("gen") == {"prompt": "data", "uid": "data"}
    assert graph.columns_out("gen") == {"response": "gen", "mask": "gen"}
    # add: its input's plus its writes.
    assert graph.columns_out("score") == {"response": "gen", "mask": "gen", "score": "score"}
    # filter: its input's columns (it writes none).
    assert graph.columns_out("keep") == {"response": "gen", "mask": "gen", "score": "score"}
    # filter that writes: its input's plus its writes.
    assert graph.columns_out("flag") == {"response": "gen", "mask": "gen", "score": "score", "flag": "flag"}
    assert [graph.nodes[i].output_mode for i in graph.topological_order()] == ["add", "replace", "add", "filter",
                                                                              "filter"]


def test_replace_drops_upstream_columns_for_reads():
    # After a replace node, 'uid' (written by data) is gone: a node reading it downstream fails.
    with pytest.raises(WorkflowError, match=re.escape("node 'flag' (compute, default) reads ['uid'], which no node "
                                                      "upstream of it writes (its input has: mask, response)")):
        (flow().add_node("gen", "model_inference", role="rollout", dependencies=["data"], executable=gen)
         .add_node("flag", "compute", dependencies=["gen"], executable=keep_and_flag).build())


def test_contract_as_function_of_config():
    graph = (flow().add_node("c1", "compute", dependencies=["data"], executable=configurable, config={"column": "z"})
             .add_node("c2", "compute", dependencies=["c1"], executable=configurable, config={"column": "w"})
             .add_node("r", "compute", dependencies=["c2"], executable=configurable_reader,
                       config={"needs": ["z", "w"]}).build())
    assert graph.nodes["c1"].columns() == ([], ["z"])
    assert graph.nodes["c2"].columns() == ([], ["w"])
    assert graph.nodes["r"].columns() == (["z", "w"], [])
    assert graph.columns_out("c2") == {"prompt": "data", "uid": "data", "z": "c1", "w": "c2"}
    with pytest.raises(WorkflowError, match=r"node 'r' \(compute, default\) reads \['q'\]"):
        (flow().add_node("r", "compute", dependencies=["data"], executable=configurable_reader,
                         config={"needs": ["q"]}).build())
    # Same function, two configs writing one column: the conflict is found from the config.
    with pytest.raises(WorkflowError, match=r"node 'c2' \(compute, default\) writes \['z'\], which its input already "
                                            r"has \(from c1\)"):
        (flow().add_node("c1", "compute", dependencies=["data"], executable=configurable, config={"column": "z"})
         .add_node("c2", "compute", dependencies=["c1"], executable=configurable, config={"column": "z"}).build())


def test_contract_function_failing_on_config_names_the_node():
    with pytest.raises(WorkflowError, match=re.escape(
            "node 'c1' (compute, default): its executable's columns depend on config key 'column', which the node's "
            "config does not set; add it under config:")):
        flow().add_node("c1", "compute", dependencies=["data"], executable=configurable, config={}).build()


def test_node_level_reads_writes_override_declaration():
    graph = (flow().add_node("s", "compute", dependencies=["data"], executable=score, reads=["uid"],
                             writes=["s1", "s2"])
             .add_node("k", "compute", dependencies=["s"], executable=keep, reads=[]).build())
    assert graph.nodes["s"].columns() == (["uid"], ["s1", "s2"])
    assert graph.nodes["k"].columns() == ([], [])  # an empty list overrides too (None would not)
    assert graph.columns_out("s") == {"prompt": "data", "uid": "data", "s1": "s", "s2": "s"}
    assert graph.nodes["s"].output_mode == "add" and graph.nodes["k"].output_mode == "filter"  # mode stays the fn's
    # An undeclared executable reads and writes nothing unless the node says so.
    plain_graph = flow().add_node("p", "compute", dependencies=["data"], executable=plain, writes=["x"]).build()
    assert plain_graph.nodes["p"].columns() == ([], ["x"])
    assert plain_graph.nodes["p"].output_mode == "add"
    # Node-level reads are checked like declared ones.
    with pytest.raises(WorkflowError, match=r"node 's' \(compute, default\) reads \['nope'\]"):
        flow().add_node("s", "compute", dependencies=["data"], executable=score, reads=["nope"]).build()


def test_string_executable_resolves_declaration():
    graph = (Workflow("wf").add_node("data", "data_load", executable=f"{NODES}:load_prompts")
             .add_node("gen", "model_inference", role="rollout", dependencies=["data"],
                       executable=f"{NODES}:generate").build())
    node = graph.nodes["gen"]
    from baton.dag.nodes import SAMPLE_COLUMNS, generate

    assert node.resolve() is generate
    assert node.columns() == (["input_ids", "attention_mask"], SAMPLE_COLUMNS)
    assert node.output_mode == "replace"


# --- 3. structure ---------------------------------------------------------------------------------------------


def diamond() -> TaskGraph:
    return (flow().add_node("left", "compute", dependencies=["data"], executable=write_x)
            .add_node("right", "compute", dependencies=["data"], executable=write_y)
            .add_node("join", "compute", dependencies=["right", "left"], executable=plain)
            .add_node("tail", "compute", dependencies=["join"], executable=plain).build())


def test_diamond_structure():
    graph = diamond()
    assert graph.entries() == ["data"]
    assert graph.exits() == ["tail"]
    assert graph.children("data") == ["left", "right"]
    assert graph.children("left") == ["join"] and graph.children("tail") == []
    assert graph.parents("join") == ["right", "left"]
    assert graph.ancestors("join") == {"data", "left", "right"}
    assert graph.ancestors("data") == set()
    assert graph.descendants("data") == {"left", "right", "join", "tail"}
    assert graph.descendants("left") == {"join", "tail"}
    assert graph.descendants("tail") == set()
    assert graph.topological_order() == ["data", "left", "right", "join", "tail"]
    assert graph.columns_into("join") == {"prompt": "data", "uid": "data", "x": "left", "y": "right"}
    assert repr(graph) == "TaskGraph('wf', 5 nodes)"


def test_topological_order_ties_in_insertion_order():
    # Siblings come out in the order given, not by name nor by the order a dependant lists them.
    graph = (flow().add_node("zeta", "compute", dependencies=["data"], executable=plain)
             .add_node("alpha", "compute", dependencies=["data"], executable=plain)
             .add_node("mid", "compute", dependencies=["data"], executable=plain)
             .add_node("end", "compute", dependencies=["mid", "alpha", "zeta"], executable=plain).build())
    assert graph.topological_order() == ["data", "zeta", "alpha", "mid", "end"]
    assert graph.topological_order() == graph.topological_order()


def test_topological_order_respects_dependencies_given_out_of_order():
    # 'late' is given before the node it depends on; two entries.
    graph = (Workflow("wf").add_node("late", "compute", dependencies=["early"], executable=plain)
             .add_node("d1", "data_load", executable=plain)
             .add_node("early", "compute", dependencies=["d1", "d2"], executable=plain)
             .add_node("d2", "data_load", executable=plain).build())
    order = graph.topological_order()
    assert order == ["d1", "d2", "early", "late"]
    assert graph.entries() == ["d1", "d2"]
    for node_id, node in graph.nodes.items():
        assert all(order.index(dep) < order.index(node_id) for dep in node.dependencies)
    # Deterministic: the same nodes give the same order every build.
    again = (Workflow("wf").add_node("late", "compute", dependencies=["early"], executable=plain)
             .add_node("d1", "data_load", executable=plain)
             .add_node("early", "compute", dependencies=["d1", "d2"], executable=plain)
             .add_node("d2", "data_load", executable=plain).build())
    assert again.topological_order() == order


def test_reset_sets_every_status_pending():
    graph = diamond()
    statuses = [NodeStatus.COMPLETED, NodeStatus.FAILED, NodeStatus.SKIPPED, NodeStatus.RUNNING, NodeStatus.READY]
    for node, status in zip(graph.nodes.values(), statuses):
        node.set_status(status, error="boom" if status == NodeStatus.FAILED else None)
    assert graph.nodes["left"].status == NodeStatus.FAILED and graph.nodes["left"].error == "boom"
    graph.reset()
    assert {n.status for n in graph.nodes.values()} == {NodeStatus.PENDING}
    assert all(n.error is None for n in graph.nodes.values())


# --- 4. YAML loader -------------------------------------------------------------------------------------------


GRPO_YAML = f"""\
dag_id: grpo_yaml
description: GRPO as a workflow
nodes:
  - node_id: data
    node_type: DATA_LOAD
    executable_ref: {NODES}:load_prompts
  - node_id: rollout
    node_type: MODEL_INFERENCE
    node_role: ROLLOUT
    dependencies: [data]
    executable_ref: {NODES}:generate
    config: {{temperature: 1.0}}
  - node_id: reward
    node_type: MODEL_INFERENCE
    node_role: REWARD
    dependencies: [rollout]
    executable_ref: {NODES}:compute_reward
  - node_id: old_log_prob
    node_type: MODEL_INFERENCE
    node_role: ACTOR
    only_forward_compute: true
    dependencies: [reward]
    executable_ref: {NODES}:old_log_probs
  - node_id: advantage
    node_type: COMPUTE
    node_role: ADVANTAGE
    dependencies: [old_log_prob]
    executable_ref: {NODES}:compute_advantage
  - node_id: actor_train
    node_type: MODEL_TRAIN
    node_role: ACTOR
    dependencies: [advantage]
    executable_ref: {NODES}:train_actor
    agent_group: 0
  - node_id: sync
    node_type: BARRIER_SYNC
    dependencies: [actor_train]
"""


def write(tmp_path, text: str, name: str = "wf.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def check_grpo(graph: TaskGraph) -> None:
    assert isinstance(graph, TaskGraph)
    assert graph.graph_id == "grpo_yaml"
    assert graph.topological_order() == ["data", "rollout", "reward", "old_log_prob", "advantage", "actor_train",
                                         "sync"]
    types = {i: (n.node_type, n.node_role) for i, n in graph.nodes.items()}
    assert types == {
        "data": (NodeType.DATA_LOAD, NodeRole.DEFAULT),
        "rollout": (NodeType.MODEL_INFERENCE, NodeRole.ROLLOUT),
        "reward": (NodeType.MODEL_INFERENCE, NodeRole.REWARD),
        "old_log_prob": (NodeType.MODEL_INFERENCE, NodeRole.ACTOR),
        "advantage": (NodeType.COMPUTE, NodeRole.ADVANTAGE),
        "actor_train": (NodeType.MODEL_TRAIN, NodeRole.ACTOR),
        "sync": (NodeType.BARRIER_SYNC, NodeRole.DEFAULT),
    }
    assert graph.parents("advantage") == ["old_log_prob"]
    assert graph.nodes["rollout"].config == {"temperature": 1.0}
    assert graph.nodes["data"].config == {}
    assert graph.nodes["old_log_prob"].only_forward_compute is True
    assert graph.nodes["reward"].only_forward_compute is False
    assert graph.nodes["rollout"].executable == f"{NODES}:generate"
    assert graph.nodes["sync"].executable is None
    assert graph.columns_out("old_log_prob")["old_log_probs"] == "old_log_prob"


def test_load_yaml_file(tmp_path):
    check_grpo(load_workflow(write(tmp_path, GRPO_YAML)))
    check_grpo(load_workflow(str(write(tmp_path, GRPO_YAML))))  # a str path too


def test_load_mapping():
    import yaml

    raw = yaml.safe_load(GRPO_YAML)
    check_grpo(load_workflow(raw))
    # reads/writes in YAML override the executable's declaration.
    raw["nodes"][5]["reads"] = ["advantages"]
    raw["nodes"][5]["writes"] = ["trained"]
    graph = load_workflow(raw)
    assert graph.nodes["actor_train"].columns() == (["advantages"], ["trained"])


def test_load_validates_the_graph(tmp_path):
    text = GRPO_YAML.replace("dependencies: [old_log_prob]", "dependencies: [old_logprob]")
    with pytest.raises(WorkflowError, match=r"node 'advantage' \(compute, advantage\) depends on 'old_logprob'.*"
                                            r"did you mean 'old_log_prob'"):
        load_workflow(write(tmp_path, text))


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(WorkflowError, match=re.escape(f"workflow file {str(path)!r} does not exist; give the path of a "
                                                      "YAML file with dag_id and nodes")):
        load_workflow(path)


def test_load_invalid_yaml(tmp_path):
    path = write(tmp_path, "dag_id: x\nnodes: [\n  - {node_id: a\n")
    with pytest.raises(WorkflowError, match=re.escape(f"workflow file {str(path)!r} is not valid YAML: ")):
        load_workflow(path)


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("", "NoneType")])
def test_load_top_level_not_a_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    with pytest.raises(WorkflowError, match=re.escape(f"workflow file {str(path)!r} must be a mapping with dag_id "
                                                      f"and nodes, got {kind}")):
        load_workflow(path)
    with pytest.raises(WorkflowError, match=r"^workflow must be a mapping with dag_id and nodes, got list$"):
        load_workflow(["not", "a", "mapping"])


@pytest.mark.parametrize("dag_id", [None, "", 7])
def test_load_missing_dag_id(dag_id):
    raw = {"nodes": [{"node_id": "data", "node_type": "data_load", "executable_ref": f"{NODES}:load_prompts"}]}
    if dag_id is not None:
        raw["dag_id"] = dag_id
    with pytest.raises(WorkflowError, match=r"^workflow needs a dag_id \(a non-empty string\)$"):
        load_workflow(raw)


@pytest.mark.parametrize("nodes", [None, [], {"node_id": "data"}])
def test_load_empty_nodes(nodes):
    raw = {"dag_id": "g"} if nodes is None else {"dag_id": "g", "nodes": nodes}
    with pytest.raises(WorkflowError, match=re.escape("workflow ('g') needs `nodes`: a non-empty list of node "
                                                      "mappings")):
        load_workflow(raw)


def test_load_node_not_a_mapping():
    with pytest.raises(WorkflowError, match=re.escape("workflow, node 0 must be a mapping with node_id and node_type, "
                                                      "got str")):
        load_workflow({"dag_id": "g", "nodes": ["data"]})


@pytest.mark.parametrize("missing", ["node_id", "node_type"])
def test_load_node_missing_required_key(missing):
    node = {"node_id": "data", "node_type": "data_load", "executable_ref": f"{NODES}:load_prompts"}
    del node[missing]
    at = "workflow, node 0" + (" ('data')" if missing == "node_type" else " (None)")
    with pytest.raises(WorkflowError, match=re.escape(f"{at} has no {missing}; every node needs node_id and "
                                                      "node_type")):
        load_workflow({"dag_id": "g", "nodes": [node]})


def test_load_unknown_top_level_key():
    with pytest.raises(WorkflowError, match=re.escape("workflow: unknown key 'node'; did you mean 'nodes'?")):
        load_workflow({"dag_id": "g", "node": []})
    with pytest.raises(WorkflowError, match=re.escape("workflow: unknown key 'zzz'; valid keys: dag_id, description, "
                                                      "nodes")):
        load_workflow({"dag_id": "g", "zzz": 1, "nodes": []})


def test_load_unknown_node_key(tmp_path):
    text = GRPO_YAML.replace("    executable_ref: baton.dag.nodes:generate",
                             "    executable: baton.dag.nodes:generate")
    path = write(tmp_path, text)
    with pytest.raises(WorkflowError, match=re.escape(f"workflow file {str(path)!r}, node 1 ('rollout'): unknown key "
                                                      "'executable'; did you mean 'executable_ref'?")):
        load_workflow(path)


@pytest.mark.parametrize("key, value", [("dependencies", "data"), ("dependencies", ["data", 3]),
                                        ("reads", "prompt"), ("writes", [["x"]])])
def test_load_lists_of_strings(key, value):
    node = {"node_id": "c", "node_type": "compute", "dependencies": ["data"], "executable_ref": f"{NODES}:generate",
            key: value}
    raw = {"dag_id": "g", "nodes": [{"node_id": "data", "node_type": "data_load",
                                     "executable_ref": f"{NODES}:load_prompts"}, node]}
    with pytest.raises(WorkflowError, match=re.escape(f"workflow, node 1 ('c'): {key} must be a list of strings, got "
                                                      f"{value!r}")):
        load_workflow(raw)


@pytest.mark.parametrize("config", ["abc", [1, 2], 5])
def test_load_config_not_a_mapping(config):
    raw = {"dag_id": "g", "nodes": [{"node_id": "data", "node_type": "data_load",
                                     "executable_ref": f"{NODES}:load_prompts", "config": config}]}
    with pytest.raises(WorkflowError, match=re.escape(f"workflow, node 0 ('data'): config must be a mapping, got "
                                                      f"{config!r}")):
        load_workflow(raw)


def test_load_empty_list_config_is_an_error():
    raw = {"dag_id": "g", "nodes": [{"node_id": "data", "node_type": "data_load",
                                     "executable_ref": f"{NODES}:load_prompts", "config": []}]}
    with pytest.raises(WorkflowError, match="config must be a mapping"):
        load_workflow(raw)


def test_load_null_optional_fields_are_defaults():
    raw = {"dag_id": "g", "nodes": [{"node_id": "data", "node_type": "data_load", "node_role": None, "config": None,
                                     "dependencies": None, "executable_ref": f"{NODES}:load_prompts"}]}
    node = load_workflow(raw).nodes["data"]
    assert node.node_role is NodeRole.DEFAULT and node.config == {} and node.dependencies == []


def test_load_unknown_type_names_the_node():
    raw = {"dag_id": "g", "nodes": [{"node_id": "data", "node_type": "DATA_LAOD",
                                     "executable_ref": f"{NODES}:load_prompts"}]}
    with pytest.raises(WorkflowError, match=r"node 'data': node_type 'DATA_LAOD' is not one of .*did you mean "
                                            r"'data_load'"):
        load_workflow(raw)


# --- 5. the shipped RLVR workflows ----------------------------------------------------------------------------


def test_rlvr_workflow_grpo():
    from baton.pipelines.dag import rlvr_workflow

    graph = rlvr_workflow()
    assert graph.graph_id == "grpo"
    assert graph.topological_order() == ["data", "rollout", "reward", "old_log_prob", "advantage", "actor_train",
                                         "sync", "metrics"]
    assert "ref_log_prob" not in graph.nodes and "values" not in graph.nodes and "critic_train" not in graph.nodes
    assert graph.parents("advantage") == ["old_log_prob"]
    assert graph.parents("actor_train") == ["advantage"]
    assert graph.exits() == ["sync", "metrics"]
    assert graph.parents("metrics") == ["advantage", "actor_train"]  # after the update, beside the sync
    assert graph.nodes["old_log_prob"].only_forward_compute is True
    assert graph.nodes["rollout"].output_mode == "replace"
    into_adv = graph.columns_into("advantage")
    assert into_adv["old_log_probs"] == "old_log_prob" and into_adv["scores"] == "reward"
    assert into_adv["responses"] == "rollout"
    assert "values" not in into_adv and "ref_log_probs" not in into_adv


@pytest.mark.parametrize("has_reference, has_critic", [(False, False), (True, False), (False, True), (True, True)])
def test_rlvr_workflow_variants_validate(has_reference, has_critic):
    from baton.pipelines.dag import rlvr_workflow

    graph = rlvr_workflow(has_reference=has_reference, has_critic=has_critic)
    assert graph.graph_id == ("ppo" if has_critic else "grpo")
    forward = ["old_log_prob"] + ["ref_log_prob"] * has_reference + ["values"] * has_critic
    assert graph.parents("advantage") == forward
    for node_id in forward:
        assert graph.parents(node_id) == ["reward"]
    assert ("critic_train" in graph.nodes) is has_critic
    # Every node's executable imports, and the graph rebuilds from its own nodes.
    assert all(callable(n.resolve()) for n in graph.nodes.values())
    rebuilt = TaskGraph(graph.graph_id, graph.nodes.values())
    assert rebuilt.topological_order() == graph.topological_order()


def test_rlvr_workflow_with_reference_and_critic():
    from baton.pipelines.dag import rlvr_workflow

    graph = rlvr_workflow(has_reference=True, has_critic=True)
    order = graph.topological_order()
    assert order == ["data", "rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantage",
                     "critic_train", "actor_train", "sync", "metrics"]
    assert graph.parents("ref_log_prob") == ["reward"] and graph.parents("values") == ["reward"]
    assert graph.parents("advantage") == ["old_log_prob", "ref_log_prob", "values"]
    assert graph.parents("critic_train") == ["advantage"]
    assert graph.parents("actor_train") == ["critic_train"]
    assert order.index("critic_train") < order.index("actor_train")
    assert graph.ancestors("actor_train") >= {"critic_train", "values", "ref_log_prob", "old_log_prob"}
    assert graph.nodes["ref_log_prob"].node_role is NodeRole.REFERENCE
    assert graph.nodes["values"].node_role is NodeRole.CRITIC
    assert graph.nodes["critic_train"].node_type is NodeType.MODEL_TRAIN
    into_adv = graph.columns_into("advantage")
    assert into_adv["ref_log_probs"] == "ref_log_prob" and into_adv["values"] == "values"
    assert into_adv["old_log_probs"] == "old_log_prob"
