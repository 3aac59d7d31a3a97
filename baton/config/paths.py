"""Where the files a config names are found: the config file's directory and the working directory.

Loading a config file (`load_config`, `baton run CONFIG`) calls `add_config_dir`: the config's
directory and the working directory go to the front of `sys.path` and of `PYTHONPATH`, so import
paths in the config (`reward_fn: revreward:score`, `worker_cls`, `pipeline_cls`) resolve in the
driver and in every Ray worker: a local Ray instance that the pipeline starts inherits `PYTHONPATH`,
and `ray_runtime_env()` carries the same directories to an existing cluster (`--ray-address`; on
several machines the directories must exist at the same path on each). `find_file` reads a relative
data path from the working directory, or else from the config file's directory.

A run directory records these directories in `import_dirs.txt` beside its `config.yaml`, so that loading
that config again (`baton eval`, a rerun) finds the same modules from any working directory.
"""

from __future__ import annotations

import os
import sys

IMPORT_DIRS_FILE = "import_dirs.txt"  # one directory per line, beside a run directory's config.yaml
_IMPORT_DIRS: list[str] = []  # what add_config_dir put on sys.path and PYTHONPATH, in order
_config_dir: str | None = None  # the directory of the latest config file loaded


def add_config_dir(config_path: str | os.PathLike) -> None:
    """Make the directory of `config_path`, the directories recorded beside it and the working directory importable
    here and in the workers to come, in that order."""
    global _config_dir
    _config_dir = os.path.dirname(os.path.abspath(config_path))
    record = os.path.join(_config_dir, IMPORT_DIRS_FILE)
    recorded = open(record).read().splitlines() if os.path.isfile(record) else []
    for directory in reversed([_config_dir, *recorded, os.getcwd()]):  # each goes in front of the ones after it
        if directory in _IMPORT_DIRS:
            continue
        _IMPORT_DIRS.insert(0, directory)
        if directory not in sys.path:
            sys.path.insert(0, directory)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _IMPORT_DIRS]
    os.environ["PYTHONPATH"] = os.pathsep.join(_IMPORT_DIRS + inherited)


def record_import_dirs(run_dir: str) -> None:
    """Write the directories `add_config_dir` made importable to `run_dir`/import_dirs.txt (nothing if none)."""
    if _IMPORT_DIRS:
        with open(os.path.join(run_dir, IMPORT_DIRS_FILE), "w") as f:
            f.write("".join(d + "\n" for d in _IMPORT_DIRS))


def ray_runtime_env() -> dict | None:
    """The `runtime_env` for `ray.init(address=...)` that puts the config directories on the workers' PYTHONPATH
    in front of the cluster's own; None before any config file was loaded."""
    if not _IMPORT_DIRS:
        return None
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([*_IMPORT_DIRS, "${PYTHONPATH}"])}}


def find_file(path: str) -> str:
    """`path` if it exists as given (absolute, or relative to the working directory), else relative to the directory
    of the latest config file loaded; FileNotFoundError naming the places looked in."""
    if os.path.exists(path):
        return path
    beside_config = os.path.join(_config_dir, path) if _config_dir and not os.path.isabs(path) else None
    if beside_config and os.path.exists(beside_config):
        return beside_config
    where = "" if os.path.isabs(path) else f" in the working directory {os.getcwd()}" + (
        f" or in the config's directory {_config_dir}" if beside_config else "")
    raise FileNotFoundError(f"{path} does not exist{where}")


def absolute_if_found(path: str | None) -> str | None:
    """`path` made absolute where `find_file` finds it; else as given (a name, or a missing file reported by its user).
    Config classes keep found files this way, so a run directory's config.yaml works from any working directory."""
    try:
        return os.path.abspath(find_file(path)) if path else path
    except FileNotFoundError:
        return path
