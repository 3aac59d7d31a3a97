"""Rules the test suite keeps: no test asserts on wall-clock time, and tests and benches read a run's metrics with
the one reader (`baton.tracking.run_metrics` / `read_metrics`), not by parsing `metrics.jsonl` themselves.

A time difference asserted against a number (`assert time.monotonic() - start < 5`) fails on a loaded machine and
says nothing about what went wrong. A test asserts on what happened instead (the error and what it names, a
counter, an event), lets `@pytest.mark.timeout` catch a hang, and waits for a condition with `conftest.wait_until`;
speed targets live in bench/, which prints figures and writes them with --json.
"""

from __future__ import annotations

import ast
import os
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(TESTS), "bench")
CLOCKS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns", "process_time"}
WRAPPERS = {"max", "min", "sum", "abs", "round", "float", "int", "sorted"}  # a duration passed through stays one


def _is_clock_call(node: ast.AST) -> bool:
    """`time.time()`, `time.monotonic()`, `time.perf_counter()`, ... or a bare `perf_counter()` / `monotonic()`."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CLOCKS and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id in CLOCKS - {"time"}


class _Scope:
    """The names of one function (or the module) that hold clock readings (instants) or differences of them."""

    def __init__(self):
        self.instants: set[str] = set()
        self.durations: set[str] = set()

    def is_instant(self, node: ast.AST) -> bool:
        return any(_is_clock_call(n) or (isinstance(n, ast.Name) and n.id in self.instants) for n in ast.walk(node))

    def is_duration(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.durations
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Sub) and (self.is_instant(node.left) or self.is_instant(node.right)):
                return True
            return self.is_duration(node.left) or self.is_duration(node.right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in WRAPPERS:
            return any(self.is_duration(a) for a in node.args)
        if isinstance(node, (ast.GeneratorExp, ast.ListComp)):
            return self.is_duration(node.elt)
        return False

    def bind(self, target: ast.AST, value: ast.AST) -> None:
        names = [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
        if self.is_duration(value):
            self.durations.update(names)
        elif self.is_instant(value):
            self.instants.update(names)


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(body: ast.AST):
    """The nodes of `body` outside the functions defined in it (those are scopes of their own)."""
    todo = list(ast.iter_child_nodes(body))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, FUNCTIONS):
            todo.extend(ast.iter_child_nodes(node))


def _learn(scope: _Scope, body: ast.AST) -> None:
    """Which names of `body` hold instants or durations (two passes: a name may be used before a later binding)."""
    for _ in range(2):
        for node in _own_nodes(body):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    scope.bind(target, node.value)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                scope.bind(node.target, node.value)
            elif isinstance(node, ast.NamedExpr):
                scope.bind(node.target, node.value)
            elif isinstance(node, (ast.For, ast.comprehension)):
                scope.bind(node.target, node.iter)
        for node in ast.walk(body):  # a list of clock readings, filled here or by a function defined here
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("append", "extend", "add") and isinstance(node.func.value, ast.Name)
                    and any(scope.is_instant(a) or scope.is_duration(a) for a in node.args)):
                scope.instants.add(node.func.value.id)


def _checks(body: ast.AST):
    """The expressions `body` checks: assert statements, and `if` tests whose branch fails the test."""
    for node in _own_nodes(body):
        if isinstance(node, ast.Assert):
            yield node.test
        elif isinstance(node, ast.If):
            fails = any((isinstance(n, ast.Raise) and "AssertionError" in ast.dump(n))
                        or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "fail")
                        for n in ast.walk(ast.Module(body=node.body, type_ignores=[])))
            if fails:
                yield node.test


def timed_asserts(source: str, filename: str = "<test>") -> list[str]:
    """'file:line: text' of each check in `source` that compares a wall-clock difference with a number."""
    found = {}

    def visit(body: ast.AST, outer: _Scope) -> None:
        scope = _Scope()
        scope.instants, scope.durations = set(outer.instants), set(outer.durations)  # a closure sees its outer names
        _learn(scope, body)
        for test in _checks(body):
            for compare in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
                sides = [compare.left, *compare.comparators]
                if any(scope.is_duration(s) for s in sides) and not all(scope.is_duration(s) for s in sides):
                    found[compare.lineno] = f"{filename}:{compare.lineno}: {ast.unparse(compare)}"
        for node in _own_nodes(body):
            if isinstance(node, FUNCTIONS):
                visit(node, scope)

    visit(ast.parse(source, filename), _Scope())
    return [found[line] for line in sorted(found)]


def findings(rule, *directories: str) -> list[str]:
    """What `rule(source, filename)` finds in every .py file of `directories`."""
    found = []
    for directory in directories:
        for name in sorted(os.listdir(directory)):
            if name.endswith(".py"):
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    found += rule(f.read(), name)
    return found


def test_no_test_asserts_on_wall_clock_time():
    found = findings(timed_asserts, TESTS)
    assert not found, ("tests assert on elapsed wall-clock time; assert on what happened and let "
                       "@pytest.mark.timeout catch a hang (speed targets go in bench/):\n" + "\n".join(found))


@pytest.mark.parametrize("code", [
    "start = time.monotonic()\nrun()\nassert time.monotonic() - start < 5",
    "t0 = time.time()\nrun()\nelapsed = time.time() - t0\nassert elapsed < 0.5 + 2.0, elapsed",
    "from time import perf_counter\nt0 = perf_counter()\nassert ok and perf_counter() - t0 <= LIMIT_S",
    "ticks = []\nfor _ in range(3):\n    ticks.append(time.monotonic())\nassert max(b - a for a, b in zip(ticks, ticks[1:])) < 2",
    "def test():\n    ticks = []\n    async def tick():\n        ticks.append(time.monotonic())\n"
    "    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 2",
    "start = time.monotonic()\nif time.monotonic() - start > 10:\n    pytest.fail('slow')",
    "def test():\n    start = time.monotonic()\n    seconds = time.monotonic() - start\n    assert 1 < seconds",
])
def test_the_rule_finds_a_time_difference_asserted_against_a_number(code):
    assert len(timed_asserts(code)) == 1, code


@pytest.mark.parametrize("code", [
    # bounded polling: the deadline bounds the wait, the assert names what never happened
    "deadline = time.monotonic() + 60\nwhile not done():\n    assert time.monotonic() < deadline, 'never done'",
    # a duration used as a setting, never checked
    "start = time.monotonic()\nrun(timeout=time.monotonic() - start)\nassert result == 3",
    # two clock readings ordered, taken where the work ran
    "assert metrics['a/start'] < metrics['b/end']",
    # the same name in another function holds no clock reading
    "def a():\n    start = time.monotonic()\ndef b():\n    start = 3\n    assert start - 1 < 5",
])
def test_the_rule_leaves_waits_and_other_comparisons_alone(code):
    assert timed_asserts(textwrap.dedent(code)) == [], code


def hand_read_metrics(source: str, filename: str = "<test>") -> list[str]:
    """'file:line: name' of each function in `source` that names a metrics.jsonl and parses JSON lines itself
    (`json.loads`; a summary.json read with `json.load` is not one)."""
    found = []
    for function in (n for n in ast.walk(ast.parse(source, filename)) if isinstance(n, FUNCTIONS)):
        nodes = list(ast.walk(function))
        names_file = any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith("metrics.jsonl")
                         for n in nodes)
        parses = any(isinstance(n, ast.Attribute) and n.attr == "loads" and isinstance(n.value, ast.Name)
                     and n.value.id == "json" for n in nodes)
        if names_file and parses:
            found.append(f"{filename}:{function.lineno}: {function.name}")
    return found


def test_tests_and_benches_read_metrics_with_the_one_reader():
    found = findings(hand_read_metrics, TESTS, BENCH)
    assert not found, ("these parse a metrics.jsonl by hand; use baton.tracking.run_metrics(run_dir) (by step, "
                       "without timings) or read_metrics(path) (the records as written):\n" + "\n".join(found))


def test_the_metrics_rule_finds_a_hand_parsed_file_and_leaves_the_reader_alone():
    hand = "def rows(d):\n    return [json.loads(line) for line in open(d / 'metrics.jsonl')]"
    reader = "def rows(d):\n    text = (d / 'metrics.jsonl').read_text()\n    return run_metrics(str(d)), json.dumps(text)"
    assert hand_read_metrics(hand) == ["<test>:1: rows"] and hand_read_metrics(reader) == []
