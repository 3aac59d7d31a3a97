"""Typed configuration: plain data (YAML, command-line overrides) to dataclass trees and back.

One strict rule throughout: a key that is not a field is an error naming the full dotted path and
the nearest valid key, and a value of the wrong type is an error naming the path and the type.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import re
import types
import typing
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from baton.config.paths import add_config_dir


class ConfigError(ValueError):
    """Bad configuration from the user: an unknown key, a wrong type, a missing field, a bad file."""


# ---------------------------------------------------------------------------------------------
# Plain data -> dataclasses


def from_dict(cls: type, data: Mapping, path: str = "") -> Any:
    """Build dataclass `cls` (and its nested dataclasses) from plain data, checking every key and type.

    `path` is the dotted key of `data` within the whole config; it prefixes every error message.
    Errors raised as ValueError by the dataclass's `__post_init__` come back as ConfigError with the path.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_where(path)}: expected a mapping of {cls.__name__} fields, got {_show(data)}")
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown_key(path, str(key), fields)
    kwargs = {}
    for name, (tp, required) in fields.items():
        key = _join(path, name)
        if name in data:
            kwargs[name] = _convert(data[name], tp, key)
        elif required:
            raise ConfigError(f"missing required key {key!r} ({_type_name(tp)})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{repr(path) if path else cls.__name__}: {e}") from e


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """name -> (resolved type, required) for the fields a dataclass takes in __init__."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        if f.init
    }


def _convert(value: Any, tp: Any, path: str) -> Any:
    """`value` checked against type `tp` (and converted: dicts to dataclasses, lists to tuples, ints to floats)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if _is_union(tp):
        candidates = [a for a in args if _same_shape(value, a)]
        if len(candidates) == 1 and isinstance(value, (Mapping, list, tuple)):  # the one fit: let its deeper error through
            return _convert(value, candidates[0], path)
        for member in candidates:  # in the declared order, e.g. `str | dict`
            try:
                return _convert(value, member, path)
            except ConfigError:
                pass
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, path)
    elif origin is list:
        if isinstance(value, (list, tuple)):
            return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is tuple:
        if isinstance(value, (list, tuple)) and args[-1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict:
        if isinstance(value, Mapping):
            key_type, value_type = args
            return {_convert(k, key_type, f"{path}[{k!r}]"): _convert(v, value_type, _join(path, str(k))) for k, v in value.items()}
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (dict, list, tuple):
        if isinstance(value, Mapping if tp is dict else (list, tuple)):
            return tp(value)
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        raise TypeError(f"{_where(path)}: the config loader does not handle fields of type {tp!r}")
    raise ConfigError(f"{_where(path)}: expected {_type_name(tp)}, got {_show(value)}")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _same_shape(value: Any, tp: Any) -> bool:
    """Whether `value` is the right kind of container for `tp` (mapping, sequence or scalar), before any deeper check."""
    container = typing.get_origin(tp) or tp
    if dataclasses.is_dataclass(tp):
        return isinstance(value, (Mapping, tp))
    if container is dict:
        return isinstance(value, Mapping)
    if container in (list, tuple):
        return isinstance(value, (list, tuple))
    return not isinstance(value, (Mapping, list, tuple))


# ---------------------------------------------------------------------------------------------
# Dataclasses -> plain data, YAML files


def to_dict(obj: Any) -> Any:
    """Plain data for a config: dataclasses become dicts, tuples become lists; the inverse of `from_dict`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any) -> str:
    """The config as YAML, in field order, readable back by `load_yaml` + `from_dict`."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False)


# A config is small: these bound what a hostile file can make the loader do (deep recursion, a billion laughs).
MAX_YAML_DEPTH = 64  # nested mappings and lists, aliases followed
MAX_YAML_NODES = 1_000_000  # keys, values and items, each alias counted at its full size


class _Loader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, but with YAML 1.2 floats (`1e-5` is a number, not the string "1e-5"), a duplicate
    key refused, and nesting deeper than MAX_YAML_DEPTH refused while composing (before Python's recursion limit)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` lays a mapping under this one's keys: not a duplicate
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {seen[key] + 1}); keep one",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def parse_yaml(text: str) -> Any:
    """The data in YAML `text`, refused (yaml.YAMLError with the line) when it nests deeper than MAX_YAML_DEPTH,
    expands past MAX_YAML_NODES through aliases, refers to itself, repeats a key or holds a lone surrogate."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, 0, set(), {}, [0])
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _measure(node: yaml.Node, depth: int, open_nodes: set[int], heights: dict[int, int], count: list[int]) -> int:
    """The height of `node`'s tree with aliases expanded; counts its expanded nodes into `count[0]`."""
    def refuse(problem: str):
        raise yaml.composer.ComposerError(None, None, problem, node.start_mark)

    if depth > MAX_YAML_DEPTH:
        refuse(f"nested deeper than {MAX_YAML_DEPTH} levels (through aliases)")
    if id(node) in open_nodes:
        refuse("an alias refers to the node that holds it")
    if isinstance(node, yaml.ScalarNode):
        count[0] += 1
        if any("\ud800" <= ch <= "\udfff" for ch in node.value):
            refuse("a lone surrogate (an unpaired \\uD800-\\uDFFF escape), which is not text")
        return 0
    if id(node) in heights and depth + heights[id(node)] > MAX_YAML_DEPTH:
        refuse(f"nested deeper than {MAX_YAML_DEPTH} levels (through aliases)")
    children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else node.value
    open_nodes.add(id(node))
    height = 1 + max((_measure(c, depth + 1, open_nodes, heights, count) for c in children), default=0)
    open_nodes.discard(id(node))
    heights[id(node)] = height
    count[0] += 1
    if count[0] > MAX_YAML_NODES:
        refuse(f"more than {MAX_YAML_NODES} values once its aliases are expanded (an alias bomb?)")
    return height


def load_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file ({} for an empty file); ConfigError naming the file (and line) when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: the byte {raw[e.start:e.start + 1]!r} at byte offset {e.start} is not UTF-8; "
                          "save the file as UTF-8") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {_show(data)}")
    return data


# ---------------------------------------------------------------------------------------------
# Overrides and merging


def deep_merge(base: Mapping, override: Mapping) -> dict:
    """A new dict: `base` with `override` laid over it, mappings merged key by key, anything else replaced."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_overrides(data: Mapping, overrides: Sequence[str], cls: type) -> dict:
    """A new dict: `data` with command-line `key.sub=value` items applied, each key checked against `cls`.

    Values are YAML (`lr=1e-5`, `flag=true`, `ids=[0,1]`, `name=hf`), read as `load_yaml` reads files.
    An override sets its key outright; a mapping value replaces the mapping there, it is not merged.
    """
    data = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {item!r} is not of the form key.sub=value, e.g. optimizer.lr=1e-5")
        try:
            value = _cli_value(raw, _key_type(cls, parts))
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML: {getattr(e, 'problem', None) or e}") from e
        node = data
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {prefix!r} is {_show(node[part])}, not a mapping of keys")
            node = node[part]
        node[parts[-1]] = value
    return data


def _key_type(cls: type, parts: list[str]) -> Any:
    """The declared type at dotted key `parts` below dataclass `cls`; ConfigError (with the nearest key) if there is none."""
    tp: Any = cls
    for i, part in enumerate(parts):
        path = ".".join(parts[:i])
        node = _mapping_member(tp)
        if node is None:
            raise ConfigError(f"override key {'.'.join(parts)!r}: {path!r} is {_type_name(tp)}, it has no key {part!r}")
        if dataclasses.is_dataclass(node):
            fields = _fields(node)
            if part not in fields:
                raise _unknown_key(path, part, fields)
            tp = fields[part][0]
        else:  # dict[str, X] or a bare dict: any key
            args = typing.get_args(node)
            tp = args[1] if args else Any
    return tp


def _mapping_member(tp: Any) -> Any:
    """The dataclass or dict type that `tp` (maybe a union such as `X | None` or `str | dict`) takes keys through."""
    for member in typing.get_args(tp) if _is_union(tp) else (tp,):
        if dataclasses.is_dataclass(member) or (typing.get_origin(member) or member) is dict or member is Any:
            return member
    return None


def _cli_value(raw: str, tp: Any) -> Any:
    """`raw` read as YAML, except that a number for a field that takes only strings keeps its text (`env_vars.RANK=0`)."""
    value = parse_yaml(raw)
    members = typing.get_args(tp) if _is_union(tp) else (tp,)
    if isinstance(value, (bool, int, float)) and str in members and not {bool, int, float} & set(members):
        return raw.strip()
    return value


def load_config(cls: type, path: str | Path | None, overrides: Sequence[str] = (), defaults: Mapping | None = None,
                *, import_beside: bool = True) -> Any:
    """The config `cls` from `defaults`, then the YAML file at `path`, then command-line `overrides`, each over the last.

    import_beside: whether modules beside the config file (and in the directories recorded there) become importable
    (`baton.config.paths.add_config_dir`); False for a file that is data only, such as an untrusted run's config.yaml.

    Without `defaults`, the defaults are `cls()`'s resolved tree (when every field has a default),
    so setting one key of a nested section keeps that section's other defaults as `cls` declares
    them (a parent's `default_factory` may differ from the nested class's own defaults).
    """
    if defaults is None and all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                                for f in dataclasses.fields(cls)):
        defaults = to_dict(cls())
    if path is not None:
        add_config_dir(path, importable=import_beside)  # import paths and data files beside it are found
    data = deep_merge(defaults or {}, load_yaml(path) if path is not None else {})
    return from_dict(cls, apply_overrides(data, overrides, cls))


# ---------------------------------------------------------------------------------------------
# Import paths


def import_object(spec: str) -> Any:
    """The object named by "package.module:Name" (or "package.module:Outer.Name"), for functions and classes named in configs."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"import path {spec!r} is not of the form 'package.module:Name'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise  # the module exists but one of its own imports is missing
        raise ConfigError(f"import path {spec!r}: no module named {e.name!r}") from e
    for i, attr in enumerate(attr_path.split(".")):
        if not hasattr(obj, attr):
            owner = ".".join([module_name, *attr_path.split(".")[:i]])
            close = difflib.get_close_matches(attr, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"import path {spec!r}: {owner!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
    return obj


# ---------------------------------------------------------------------------------------------
# Messages


def _unknown_key(path: str, key: str, fields: Mapping[str, Any]) -> ConfigError:
    close = difflib.get_close_matches(key, list(fields), n=1)
    if close:
        return ConfigError(f"unknown key {_join(path, key)!r}; did you mean {_join(path, close[0])!r}?")
    under = f" under {path!r}" if path else ""
    return ConfigError(f"unknown key {_join(path, key)!r}; valid keys{under}: {', '.join(fields)}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _where(path: str) -> str:
    return repr(path) if path else "config"


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _type_name(tp: Any) -> str:
    """`list[int] | None`, not `typing.Optional[typing.List[int]]`."""
    if tp is type(None):
        return "None"
    args = typing.get_args(tp)
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in args)
    if typing.get_origin(tp) is Literal:
        return f"one of {', '.join(map(repr, args))}"
    if typing.get_origin(tp) is not None:
        names = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{typing.get_origin(tp).__name__}[{names}]"
    return getattr(tp, "__name__", repr(tp))
