"""Starting the driver's Ray: join a cluster, or start a local instance that listens on the loopback address only and
keeps its files from the machine's other users."""

from __future__ import annotations

import os
import secrets
import stat
import sys
import tempfile
import warnings
from pathlib import Path

from baton.config import ray_runtime_env
from baton.distributed.worker import usable_cpu_count
from baton.pipelines.config import TrainerConfig


def start_ray(trainer: TrainerConfig) -> None:
    """Join `trainer.ray_address`, or start a local Ray instance with `trainer.num_cpus` logical CPUs (default: the
    cores this process may use, so that Ray does not place more CPU-only workers than there are cores).

    A local instance listens on the loopback address only (unless `trainer.ray_local_only` is false), so nothing
    outside this machine can reach it, and keeps its temp directory where only this user can enter
    (`private_temp_dir`). Ray's token authentication is left as Ray sets it (Ray turns it on for a new local
    instance); its token file is kept readable by this user only (`keep_auth_token_private`)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        running = ray.cluster_resources().get("CPU")
        if trainer.num_cpus and trainer.num_cpus != running:
            warnings.warn(f"trainer.num_cpus={trainer.num_cpus} is ignored: Ray is already running, with {running:g} "
                          "CPUs (set it where Ray starts: in the demo, sft.trainer.num_cpus)", stacklevel=2)
        return
    if not trainer.ray_address and trainer.ray_local_only:
        listen_on_loopback()
    keep_auth_token_private(starts_instance=not trainer.ray_address)
    import ray

    if trainer.ray_address:  # a local instance inherits PYTHONPATH; a cluster is told it (baton.config.paths)
        ray.init(address=trainer.ray_address, logging_level="ERROR", runtime_env=ray_runtime_env())
    else:
        ray.init(address="local", num_cpus=trainer.num_cpus or usable_cpu_count(), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False, _temp_dir=private_temp_dir())


def listen_on_loopback() -> None:
    """Make a Ray instance started by this process take 127.0.0.1 as its node address (every Ray server then listens
    there only). Ray's switch for this is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray is imported."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray was imported before this was set
        constants.ENABLE_RAY_CLUSTER = False


def private_temp_dir() -> str:
    """Ray's temp directory for a local instance: `ray` inside `baton-ray-<uid>` (0700) under RAY_TMPDIR or the
    system's temp directory. Ray makes each of its directories 0777 without the sticky bit (sessions, sockets, logs,
    spilled objects), so under the shared /tmp/ray any user of the machine could read or replace them; the 0700
    directory above keeps every other user out. PermissionError where that directory is not this user's own."""
    holder = os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), f"baton-ray-{os.getuid()}")
    try:
        os.mkdir(holder, 0o700)
    except FileExistsError:
        info = os.lstat(holder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{holder} is not a directory of this user's, so it cannot hold Ray's files privately; "
                                  "remove it, or set RAY_TMPDIR to a directory of your own") from None
    os.chmod(holder, 0o700)
    return os.path.join(holder, "ray")


def keep_auth_token_private(starts_instance: bool) -> None:
    """Make the token file Ray reads (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) readable by this user only.

    Ray (2.5x) turns token authentication on for a new local instance unless RAY_AUTH_MODE says otherwise, and where
    no token exists writes one to ~/.ray/auth_token with the process's umask, as a rule 0644: readable by every user
    of the machine. So where Ray would write one (`starts_instance`), it is written here first, 0600, as Ray makes
    it (64 hex digits); an existing file of this user's is made 0600."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    ray_writes_one = (starts_instance and os.environ.get("RAY_AUTH_MODE", "token").lower() == "token"
                      and not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"))
    if ray_writes_one and not os.path.lexists(path):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # written meanwhile (another run starting): made private below
            pass
        else:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_hex(32))
    if not path.exists():
        return
    info = path.stat()
    if stat.S_IMODE(info.st_mode) & 0o077 == 0:
        return
    if info.st_uid != os.getuid():
        warnings.warn(f"Ray's token {path} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}) and "
                      "belongs to another user, so it is left so; ask its owner to make it 0600", stacklevel=3)
        return
    os.chmod(path, 0o600)
