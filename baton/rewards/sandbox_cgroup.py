"""A cgroup per sandboxed case, so its memory and process caps hold over all of its processes together: cgroup v2
(`memory.max`, `pids.max`) where a unified hierarchy with both controllers is writable, else v1's `memory` and `pids`
hierarchies (`memory.limit_in_bytes`, `pids.max`), else none (the per-process rlimits then stand alone). A group
is reused by later cases of the same limits once its case is over and empty (making and removing one costs ~10 ms)."""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time

GROUP = "baton-sandbox"  # under each hierarchy's root; a case's group is "<scorer pid>-<n>"
_V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
_V1_ROOTS = {"memory": "/sys/fs/cgroup/memory", "pids": "/sys/fs/cgroup/pids"}
_RMDIR_WAIT_S = 2.0  # for the kernel to let go of a killed case's last process
_lock = threading.Lock()
_counter = itertools.count()
_bases: list[str] | None = None  # [v2 base] or [v1 memory base, v1 pids base], or [] where none is writable
_idle: dict[tuple[int, int], list["CaseCgroup"]] = {}  # (memory_bytes, max_processes) -> groups no case is in


def acquire(memory_bytes: int, max_processes: int) -> "CaseCgroup":
    """A group of these limits that no case is in: an idle one, or a new one."""
    with _lock:
        idle = _idle.get((memory_bytes, max_processes))
        group = idle.pop() if idle else None
    group = group or CaseCgroup(memory_bytes, max_processes)
    group.num_oom_kills_before = group.num_oom_kills()
    return group


def release(group: "CaseCgroup") -> None:
    """After its case: kept for the next case of its limits when no process is left in it, else removed."""
    if group.is_empty():
        with _lock:
            _idle.setdefault(group.key, []).append(group)
    else:
        group.remove()


@atexit.register
def _remove_idle() -> None:
    with _lock:
        groups = [group for idle in _idle.values() for group in idle]
        _idle.clear()
    for group in groups:
        try:
            group.remove()
        except OSError:  # swept by the next scoring process that starts
            pass


class CaseCgroup:
    """The cgroup(s) of one case: `procs` are the files the case writes its pid to; `oom_killed()` after it ended;
    `remove()` once every process of it is gone."""

    def __init__(self, memory_bytes: int, max_processes: int):
        self.key = (memory_bytes, max_processes)
        self.num_oom_kills_before = 0
        bases = _writable_bases()
        name = f"{os.getpid()}-{next(_counter)}"
        self.dirs = [os.path.join(base, name) for base in bases]
        for path in self.dirs:
            os.mkdir(path, 0o755)
        if len(self.dirs) == 1:  # v2
            _write(self.dirs[0], "memory.max", memory_bytes)
            _write(self.dirs[0], "memory.swap.max", 0, missing_ok=True)
            _write(self.dirs[0], "pids.max", max_processes)
        elif self.dirs:
            _write(self.dirs[0], "memory.limit_in_bytes", memory_bytes)
            _write(self.dirs[0], "memory.memsw.limit_in_bytes", memory_bytes, missing_ok=True)
            _write(self.dirs[1], "pids.max", max_processes)
        self.procs = [os.path.join(path, "cgroup.procs") for path in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the case (since `acquire`) for passing the memory cap."""
        return self.num_oom_kills() > self.num_oom_kills_before

    def num_oom_kills(self) -> int:
        if not self.dirs:
            return 0
        events = "memory.events" if len(self.dirs) == 1 else "memory.oom_control"
        with open(os.path.join(self.dirs[0], events)) as f:
            counts = dict(line.split() for line in f if line.strip())
        return int(counts.get("oom_kill", 0))

    def is_empty(self) -> bool:
        for procs in self.procs:
            with open(procs) as f:
                if f.read().strip():
                    return False
        return True

    def remove(self) -> None:
        for path in self.dirs:
            _remove(path)


def available() -> str:
    """"v2", "v1" or "" (none writable here)."""
    bases = _writable_bases()
    return "v2" if len(bases) == 1 else "v1" if bases else ""


def sweep_stale() -> None:
    """Remove case groups whose scorer process is gone (one killed before it could remove them)."""
    for base in _writable_bases():
        for name in os.listdir(base):
            pid = name.split("-")[0]
            if os.path.isdir(os.path.join(base, name)) and pid.isdigit() and is_stale(int(pid)):
                try:
                    _remove(os.path.join(base, name))
                except OSError:  # a process of it still lives; the next sweep tries again
                    pass


def _writable_bases() -> list[str]:
    global _bases
    with _lock:
        if _bases is None:
            _bases = _find_bases()
        return _bases


def _find_bases() -> list[str]:
    for root in _V2_ROOTS:
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if not {"memory", "pids"} <= set(f.read().split()):
                    continue
            base = os.path.join(root, GROUP)
            os.makedirs(base, exist_ok=True)
            for parent in (root, base):  # the controllers reach the case groups through both
                _write(parent, "cgroup.subtree_control", "+memory +pids")
            return [base]
        except OSError:
            continue
    try:
        bases = [os.path.join(_V1_ROOTS[name], GROUP) for name in ("memory", "pids")]
        for base in bases:
            os.makedirs(base, exist_ok=True)
            if not os.access(base, os.W_OK):
                return []
        return bases
    except OSError:
        return []


def _write(directory: str, name: str, value, missing_ok: bool = False) -> None:
    try:
        with open(os.path.join(directory, name), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def _remove(path: str) -> None:
    deadline = time.monotonic() + _RMDIR_WAIT_S
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a killed process not yet fully gone
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def is_stale(pid: int) -> bool:
    """Whether what scoring process `pid` left is stale: it is gone, or it is this process, which sweeps before its
    first case (so what it finds under its own pid is a dead process's whose pid it took)."""
    return pid == os.getpid() or not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
