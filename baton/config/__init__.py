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
from baton.config.paths import add_config_dir, find_file, ray_runtime_env, record_import_dirs
from baton.config.registry import Registry

__all__ = [
    "ConfigError",
    "Registry",
    "add_config_dir",
    "apply_overrides",
    "deep_merge",
    "dump_yaml",
    "find_file",
    "from_dict",
    "import_object",
    "load_config",
    "load_yaml",
    "ray_runtime_env",
    "record_import_dirs",
    "to_dict",
]
