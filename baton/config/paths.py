"""Where the files a config names are found: the config file's directory and the working directory.

Loading a config file (`load_config`, `baton run CONFIG`) calls `add_config_dir`: the config's
directory and the working directory go to the end of `sys.path` (after the standard library and the
installed packages, so a module beside a config never shadows one of theirs) and into `PYTHONPATH` in
the same order, so import paths in the config (`reward_fn: revreward:score`, `worker_cls`,
`pipeline_cls`) resolve in the driver and in every Ray worker: a local Ray instance that the pipeline
starts inherits `PYTHONPATH`, and `ray_runtime_env()` carries the same directories to an existing
cluster (`--ray-address`; on several machines the directories must exist at the same path on each).
A world-writable directory (`/tmp`, mode o+w) is never made importable: anyone could plant a module
there. `find_file` reads a relative data path from the working directory, or else from the config
file's directory.

A run directory records these directories in `import_dirs.txt` beside its `config.yaml`, so that loading
that config again (a rerun, `baton eval --trust-run-dir`) finds the same modules from any working directory.
`add_config_dir(path, importable=False)` finds data beside a config without importing anything from there:
how `baton eval` / `baton generate` open a run directory they are not told to trust.
"""

from __future__ import annotations

import os
import stat
import sys
import warnings

IMPORT_DIRS_FILE = "import_dirs.txt"  # one directory per line, beside a run directory's config.yaml
_IMPORT_DIRS: list[str] = []  # what add_config_dir put on sys.path and PYTHONPATH, in order
_config_dir: str | None = None  # the directory of the latest config file loaded


def add_config_dir(config_path: str | os.PathLike, *, importable: bool = True) -> None:
    """Find data files beside `config_path` (`find_file`); with `importable`, also make its directory, the directories
    recorded beside it and the working directory importable here and in the workers to come, in that order, after
    everything importable already. World-writable directories are skipped, with a warning."""
    global _config_dir
    _config_dir = os.path.dirname(os.path.abspath(config_path))
    if not importable:
        return
    for directory in [_config_dir, *recorded_import_dirs(_config_dir), os.getcwd()]:
        if directory in _IMPORT_DIRS:
            continue
        if world_writable(directory):
            warnings.warn(f"{directory} is world-writable, so anyone could plant a module there: nothing is imported "
                          "from it (move the config and its modules to a directory of your own)", stacklevel=2)
            continue
        _IMPORT_DIRS.append(directory)
        if directory not in sys.path:
            sys.path.append(directory)
    # Workers see this process's sys.path order: the directories come after the standard library there too.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*inherited, *(p for p in sys.path if p and p not in inherited)])


def drop_import_dirs(directories) -> None:
    """Take `directories` (and whatever resolves to them) off `sys.path` and out of what `add_config_dir` added, so a
    config loaded from one of them later makes it importable again: how an untrusted run directory is opened."""
    untrusted = {os.path.realpath(d) for d in directories}
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) not in untrusted]
    _IMPORT_DIRS[:] = [d for d in _IMPORT_DIRS if os.path.realpath(d) not in untrusted]


def recorded_import_dirs(config_dir: str) -> list[str]:
    """The directories in `config_dir`/import_dirs.txt, world-writable ones left out (an older run may list them)."""
    record = os.path.join(config_dir, IMPORT_DIRS_FILE)
    if not os.path.isfile(record):
        return []
    with open(record, encoding="utf-8", errors="replace") as f:
        return [d for d in f.read().splitlines() if os.path.isabs(d) and not world_writable(d)]


def world_writable(directory: str) -> bool:
    """Whether anyone may create files in `directory` (mode o+w, as /tmp); False for one that does not exist."""
    try:
        return bool(os.stat(directory).st_mode & stat.S_IWOTH)
    except OSError:
        return False


def record_import_dirs(run_dir: str) -> None:
    """Write the directories `add_config_dir` made importable to `run_dir`/import_dirs.txt (nothing if none)."""
    if _IMPORT_DIRS:
        with open(os.path.join(run_dir, IMPORT_DIRS_FILE), "w") as f:
            f.write("".join(d + "\n" for d in _IMPORT_DIRS if not world_writable(d)))


def ray_runtime_env() -> dict | None:
    """The `runtime_env` for `ray.init(address=...)` that puts the config directories on the workers' PYTHONPATH
    after the cluster's own; None before any config file was loaded. (A cluster's workers put PYTHONPATH before
    their standard library: there the directories can shadow it, so they must hold only the run's own modules.)"""
    if not _IMPORT_DIRS:
        return None
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(["${PYTHONPATH}", *_IMPORT_DIRS])}}


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
