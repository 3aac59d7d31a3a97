"""Workflows as graphs of typed nodes (siiRL's model): build or load them, schedule them, run them."""

from baton.dag.executor import DAGExecutionError, NodeContext, NodeOutput, SingleControllerExecutor, WorkflowContext
from baton.dag.graph import Node, NodeRole, NodeStatus, NodeType, TaskGraph, Workflow, WorkflowError, node_function
from baton.dag.loader import load_workflow
from baton.dag.scheduler import ClusterLayout, Plan, schedule

__all__ = ["ClusterLayout", "DAGExecutionError", "Node", "NodeContext", "NodeOutput", "NodeRole", "NodeStatus",
           "NodeType", "Plan", "SingleControllerExecutor", "TaskGraph", "Workflow", "WorkflowContext", "WorkflowError",
           "load_workflow", "node_function", "schedule"]
