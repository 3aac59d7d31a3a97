"""The layers of baton/ (docs/DESIGN.md, "Layers"): every import points down the list or stays within a layer, and
no modules import each other in a circle. The import graph is read from the source with `ast`, nothing imported.

What counts as an import of module B by module A:
- every `import` / `from ... import` in A naming B, relative ones resolved, wherever it stands: at module level, inside
  a function (a lazy import hides an arrow from the import system, not from the design), and under
  `if TYPE_CHECKING:` (a type named in an annotation is knowledge of the layer that defines it; and the lazily
  exporting packages, `baton`, `baton.engines`, `baton.models`, list their exports there);
- a string constant that is exactly B's dotted name below `baton`: how `_lazy.lazy_exports` tables and
  `importlib.import_module` name what they import.
A "package.module:attr" string is a plug-in path, not an import: a registry entry or a config default that
`import_object` / `strategy_class` resolves by name at run time, where a user's own path may stand instead. It may
name any layer (the `vllm` strategy's entry names its class in `baton.engines`); it must name an object that exists.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "baton"

# Bottom first: layer n is LAYERS[n - 1]. A module belongs to the entry that is the longest prefix of its dotted name
# ("baton" alone is the package's own __init__.py). Imports within a layer are fine; a circle never is.
LAYERS: list[tuple[str, ...]] = [
    ("baton.config", "baton.data", "baton.models", "baton.algorithms", "baton.rewards", "baton.tracking",
     "baton.checkpoint", "baton._lazy"),  # 1: ground: no Ray, no workers; pure functions and typed records
    ("baton.distributed",),  # 2: workers, dispatch, clusters, resources, futures; backends ray and local
    ("baton.strategy", "baton.datasets"),  # 3: how a role's model trains and scores; prompt and preference data
    ("baton.engines",),  # 4: request-level inference engines, and the batch generate over any of them
    ("baton.workers",),  # 5: role workers and weight sync
    ("baton.rl",),  # 6: the RL algorithm object the three drivers compose
    ("baton.rollout", "baton.agentic"),  # 7: the rollout system, and agentic environments on it
    ("baton.dag",),  # 8: workflow graphs, their scheduler and executors
    ("baton.pipelines",),  # 9: the pipelines
    ("baton.recipes", "baton.cli", "baton"),  # 10: presets, the command line, the package's public names
]

PLUGIN_PATH = re.compile(r"baton(\.\w+)+:\w+(\.\w+)*")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.importer} imports {self.imported}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def existing_module(name: str) -> str:
    """`name`, or the nearest package above it that exists here (`baton.x.Name` names an object of `baton.x`)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str, path: Path) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def add(name: str, node: ast.AST) -> None:
        if name == "baton" or name.startswith("baton."):
            found.append(Import(module, existing_module(name), path, node.lineno))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:  # `from baton.x import y`: the module baton.x.y where it is one, else baton.x
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in MODULES else base, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value and node.value in MODULES:
            add(node.value, node)  # "baton" alone is more often the project's name (a tracker's) than the package
    return list(dict.fromkeys(found))  # `from x import a, b`: one import


def all_imports() -> list[Import]:
    return [found for module, path in MODULES.items() for found in imports_of(module, path)
            if found.imported != module]


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer number, the table's entry) of a module, or None where no entry covers it."""
    matches = [(len(entry), number, entry) for number, entries in enumerate(LAYERS, 1) for entry in entries
               if module == entry or (entry != "baton" and module.startswith(entry + "."))]
    return max(matches)[1:] if matches else None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    missing = sorted(module for module in MODULES if layer_of(module) is None)
    assert not missing, f"modules no layer covers: {missing}; add their package to LAYERS (and to docs/DESIGN.md)"


def test_no_import_points_up_a_layer():
    upward = []
    for found in all_imports():
        (low, low_entry), (high, high_entry) = layer_of(found.importer), layer_of(found.imported)
        if high > low:
            upward.append(f"{found}: layer {low} ({low_entry}) imports layer {high} ({high_entry})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    edges: dict[str, set[str]] = {module: set() for module in MODULES}
    where: dict[tuple[str, str], Import] = {}
    for found in all_imports():
        edges[found.importer].add(found.imported)
        where.setdefault((found.importer, found.imported), found)
    circles = cycles(edges)
    lines = []
    for members in circles:
        lines.append(" <-> ".join(members))
        lines += [f"    {where[a, b]}" for a in members for b in sorted(edges[a]) if b in members]
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(lines)


def plugin_paths() -> list[tuple[Path, int, str]]:
    return [(path, node.lineno, node.value) for path in MODULES.values()
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and PLUGIN_PATH.fullmatch(node.value)]


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
    return names


def test_every_plugin_path_names_an_object_that_exists():
    """A plug-in path is not an import, so no import error shows a stale one: a moved class's registry entry would
    fail only when someone asks for it by name."""
    paths = plugin_paths()
    assert len(paths) >= 10, "the plug-in path pattern found almost nothing; has the spelling changed?"
    broken = []
    for path, line, value in paths:
        module, _, attribute = value.partition(":")
        if module not in MODULES:
            broken.append(f"{path.relative_to(ROOT)}:{line}: {value!r}: no module {module}")
        elif attribute.partition(".")[0] not in top_level_names(MODULES[module]):
            broken.append(f"{path.relative_to(ROOT)}:{line}: {value!r}: {module} defines no {attribute}")
    assert not broken, "plug-in paths that name nothing:\n" + "\n".join(broken)


# --- the checker itself, on small graphs --------------------------------------------------------------------------


def test_cycles_finds_each_circle_once_and_nothing_else():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"g"}}
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("module, layer", [
    ("baton", 10), ("baton.cli", 10), ("baton.data.proto", 1), ("baton._lazy", 1), ("baton.distributed", 2),
    ("baton.engines.batch", 4), ("baton.dag.nodes", 8), ("baton.pipelines.base", 9),
])
def test_layer_of_takes_the_longest_entry(module, layer):
    assert layer_of(module)[0] == layer


def test_imports_are_read_wherever_they_stand(tmp_path):
    """Relative, in a function, under TYPE_CHECKING, by module-name string; a plug-in path is not one."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import backend\n"
        "from ..data import DataProto\n"
        "if TYPE_CHECKING:\n"
        "    from baton.engines.protocol import Engine\n"
        "def f():\n"
        "    import baton.workers.roles\n"
        "    return {'x': 'baton.models.build', 'y': 'baton.strategy.hf:HFStrategy', 'project': 'baton'}\n")
    found = {(i.imported, i.line) for i in imports_of("baton.distributed.probe", source)}
    assert found == {("baton.distributed.backend", 2), ("baton.data", 3), ("baton.engines.protocol", 5),
                     ("baton.workers.roles", 7), ("baton.models.build", 8)}
