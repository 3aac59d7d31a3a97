"""Typed configuration: YAML files and `key.sub=value` overrides into dataclass trees, strictly checked."""

from baton.config.loader import (
    ConfigError,
    apply_overrides,
    deep_merge,
    dump_yaml,
    from_dict,
    import_object,
    load_config,
    load_yaml,
    to_dict,
)

__all__ = [
    "ConfigError",
    "apply_overrides",
    "deep_merge",
    "dump_yaml",
    "from_dict",
    "import_object",
    "load_config",
    "load_yaml",
    "to_dict",
]
