"""A sandbox reward for code tasks: a response's Python run against a task's tests (asserts), each test case in a
process tree of its own, confined by the kernel, with time, memory, output, file and process limits, no network, and
a working directory that is all it can write. docs/sandbox.md says what holds in each mode and what does not.

Per case (Linux; `sandbox_child.py` sets it up before the untrusted code runs, `sandbox_kernel.py` holds the
kernel calls, `sandbox_cgroup.py` the cgroup):
- the wall-clock limit `timeout_s`: this process kills the case's PID namespace and session past it, and after
  every case; the case's outer process also kills its namespace at `timeout_s` + 1 s, and dies with the thread
  that started it (PR_SET_PDEATHSIG, with a getppid re-check), so a killed scorer takes its cases with it;
- rlimits: RLIMIT_CPU, RLIMIT_AS (per process), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC, no core files;
- a cgroup, where one is writable: `memory_bytes` over all of the case's processes together (an OOM kill is
  MEMORY) and `max_processes`;
- namespaces (a user namespace first when not root): mount, PID, network, IPC, UTS, cgroup; in them a minimal
  root: a read-only tmpfs holding read-only binds of the stdlib and the shared libraries, four devices, a fresh
  procfs that shows the case's processes only, and the working directory, a tmpfs of `max_workdir_bytes`;
- as root the case drops to `nobody`; without root it keeps its uid with no capability left;
- no_new_privs, Landlock (read the stdlib and libraries, write the working directory; no TCP; no signal to a
  process outside), a seccomp filter (no ptrace, process_vm_*, non-unix sockets, mounts, namespaces, keyrings,
  bpf, perf, io_uring, signal handlers);
- an audit hook in the interpreter as a second line (files outside, `..` paths, outside directory descriptors,
  sockets, ctypes, _imp and signal, frame access, signals to others; new processes unless the kernel counts them).
Where neither the minimal root nor Landlock holds, `run_case` raises SandboxUnavailable unless `allow_weak`.

A case passes only when the harness writes its verdict line, keyed with a nonce the code is not given, after the
test ran; the test is compiled, and everything the harness uses bound, before the code runs, and the test sees the
builtins as they were, so patching builtins, exiting early or printing a verdict fails. A test `assert f(x) == y`
passes for an object whose `__eq__` says yes: write tests that check the type where it matters. Each case costs an
interpreter start, ~35 ms of CPU (bench/sandbox.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from baton.rewards import sandbox_cgroup
from baton.rewards.registry import register_reward

PASSED, FAILED, TIMEOUT, MEMORY, OUTPUT_LIMIT, ERROR = "passed", "failed", "timeout", "memory", "output_limit", "error"
STATUSES = (PASSED, FAILED, TIMEOUT, MEMORY, OUTPUT_LIMIT, ERROR)
NOBODY = 65534  # uid and gid a case runs as when the reward runs as root
MAX_CONCURRENT_CASES = max(2, os.cpu_count() or 1)  # test processes alive at once in this process, over all calls
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 65536
_MAX_VERDICT_BYTES = 4096
_KILL_WAIT_S = 5.0  # for a killed namespace's init to exit; it exits once every process in it has
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)
_PYTHON_FENCES = ("python", "python3", "py")
_slots = threading.BoundedSemaphore(MAX_CONCURRENT_CASES)
_DIR_PREFIX = "baton-sandbox-"  # then the scorer's pid: a directory whose scorer is gone is swept
_swept = threading.Lock()
_swept_pid: int | None = None


class SandboxUnavailable(RuntimeError):
    """The kernel confines no case's file system here (neither the minimal root nor Landlock) and `allow_weak` is
    not set."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one test case (one process, and its children when the kernel contains them)."""

    timeout_s: float = 5.0  # wall clock, the parent kills the case's session past it
    cpu_time_s: int = 5  # RLIMIT_CPU, whole seconds
    # RLIMIT_AS per process (the interpreter itself takes ~30 MiB), and the cgroup's cap over all of them together
    memory_bytes: int = 512 * 2**20
    max_output_bytes: int = 64 * 2**10  # stdout and stderr together; past it the case is killed: output_limit
    max_file_bytes: int = 2**20  # RLIMIT_FSIZE: any file the case writes
    max_workdir_bytes: int = 16 * 2**20  # all files together: in the namespaces the working directory is a tmpfs
    max_processes: int = 64  # the case's pids cgroup, and RLIMIT_NPROC (which counts the uid's processes machine-wide)
    max_open_files: int = 64  # RLIMIT_NOFILE
    allow_weak: bool = False  # score even where the kernel confines no file system (rlimits and the hook only)

    def __post_init__(self):
        if self.timeout_s <= 0 or self.cpu_time_s < 1:
            raise ValueError(f"the sandbox needs timeout_s > 0 and cpu_time_s >= 1 (whole seconds), got "
                             f"timeout_s={self.timeout_s}, cpu_time_s={self.cpu_time_s}")
        small = {k: v for k, v in asdict(self).items() if k not in ("timeout_s", "cpu_time_s", "allow_weak") and v < 1}
        if small:
            raise ValueError(f"sandbox limits must be >= 1, got {small}")


@dataclass(frozen=True)
class CaseResult:
    """One test case's outcome: `status` one of STATUSES, `reason` a line on why it did not pass ("" when it did),
    its stdout and stderr (decoded, at most max_output_bytes), its wall-clock duration, and the kernel layers that
    held for it (of "cgroup", "namespaces", "root", "landlock", "seccomp")."""

    status: str
    reason: str
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    layers: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def extract_code(response: str) -> str:
    """The code in a response: its last ```python (or ```py) fenced block, else its last bare ``` block (a block
    left unclosed, as a response cut off at the length limit leaves it, runs to the end); else the whole text."""
    blocks = _FENCE.findall(response)
    chosen = ([body for lang, body in blocks if lang.lower() in _PYTHON_FENCES]
              or [body for lang, body in blocks if not lang])
    return chosen[-1] if chosen else response


def parse_tests(label: Any) -> list[str]:
    """A task's tests: a list of Python snippets (asserts), or a JSON string of one; any other string is one test."""
    if isinstance(label, str):
        try:
            parsed = json.loads(label)
        except json.JSONDecodeError:
            return [label]
        label = parsed if isinstance(parsed, list) else label
        if isinstance(label, str):
            return [label]
    if not isinstance(label, (list, tuple)) or not label or not all(isinstance(t, str) for t in label):
        raise ValueError(f"code tests must be a non-empty list of Python snippets (asserts), or a JSON string of one, "
                         f"such as '[\"assert f(2) == 4\"]'; got {label!r:.200}")
    return list(label)


def run_case(code: str, test: str, limits: SandboxLimits = SandboxLimits(), *, _kernel: bool = True,
             _audit_hook: bool = True) -> CaseResult:
    """Run `code` then `test` in one sandboxed process (the module docstring says how it is held). Raises
    SandboxUnavailable where the kernel confines no file system and `limits.allow_weak` is not set. `_kernel=False`
    (for the benchmark's baseline) leaves out every kernel layer but the rlimits and, as root, the privilege drop;
    `_audit_hook=False` (for tests of the kernel layers alone) leaves out the hook."""
    sweep_stale()
    with _slots:
        root = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        try:
            return _run_in(root, code, test, limits, {"kernel": _kernel, "audit_hook": _audit_hook})
        finally:
            shutil.rmtree(root, onerror=_make_removable)


def sweep_stale() -> None:
    """Once per scoring process: remove the sandbox directories and cgroups of scoring processes that are gone
    (killed before they could remove them)."""
    global _swept_pid
    with _swept:
        if _swept_pid == os.getpid():
            return
        _swept_pid = os.getpid()
        temp = tempfile.gettempdir()
        for name in os.listdir(temp):
            pid = name[len(_DIR_PREFIX):].split("-")[0]
            if name.startswith(_DIR_PREFIX) and pid.isdigit() and sandbox_cgroup.is_stale(int(pid)):
                shutil.rmtree(os.path.join(temp, name), ignore_errors=True)
        sandbox_cgroup.sweep_stale()


def run_tests(code: str, tests: Sequence[str], limits: SandboxLimits = SandboxLimits(),
              max_concurrent: int = MAX_CONCURRENT_CASES) -> list[CaseResult]:
    """One `CaseResult` per test, in order, run concurrently (at most `max_concurrent` here, and at most
    MAX_CONCURRENT_CASES over all calls in this process)."""
    if len(tests) <= 1:
        return [run_case(code, test, limits) for test in tests]
    with ThreadPoolExecutor(min(max_concurrent, len(tests)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda test: run_case(code, test, limits), tests))


def score_results(results: Sequence[CaseResult], all_or_nothing: bool = False) -> float:
    """The fraction of cases passed, or with `all_or_nothing` 1.0 when every case passed, else 0.0."""
    passed = sum(r.passed for r in results)
    if all_or_nothing:
        return float(passed == len(results))
    return passed / len(results)


@register_reward("code_sandbox")
def code_sandbox_reward(response: str, ground_truth: Any, *, all_or_nothing: bool = False, timeout_s: float = 5.0,
                        memory_mb: int = 512, allow_weak: bool = False, **fields) -> float:
    """The fraction of the task's tests (the ground truth: a JSON list of asserts) that the response's code (see
    `extract_code`) passes, each test run in the sandbox; with `all_or_nothing`, 1.0 only when all pass. The
    keywords set the limits (`timeout_s` also sets the CPU-time limit; `allow_weak` scores where the kernel confines
    no file system, which otherwise raises SandboxUnavailable); a DAG reward node passes them as `kwargs`."""
    limits = SandboxLimits(timeout_s=timeout_s, cpu_time_s=max(1, math.ceil(timeout_s)), memory_bytes=memory_mb * 2**20,
                           allow_weak=allow_weak)
    return score_results(run_tests(extract_code(response), parse_tests(ground_truth), limits), all_or_nothing)


@register_reward("code_sandbox_all")
def code_sandbox_all_reward(response: str, ground_truth: Any, *, timeout_s: float = 5.0, memory_mb: int = 512,
                            allow_weak: bool = False, **fields) -> float:
    """`code_sandbox` all or nothing: 1.0 when the response's code passes every test, else 0.0. Its settings are
    `code_sandbox`'s, declared here so that they come from `reward_kwargs` only: a data field of their name is
    refused at load, never passed on as a limit."""
    return code_sandbox_reward(response, ground_truth, all_or_nothing=True, timeout_s=timeout_s, memory_mb=memory_mb,
                               allow_weak=allow_weak)


def _run_in(root: str, code: str, test: str, limits: SandboxLimits, layers: dict[str, bool]) -> CaseResult:
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    os.mkdir(os.path.join(root, "fs"), 0o700)  # where the case mounts its minimal root, in its own namespace
    os.chmod(root, 0o711)  # the case may reach its working directory by absolute path, not list what lies beside it
    if os.geteuid() == 0:
        os.chown(work, NOBODY, NOBODY)
    cgroup = sandbox_cgroup.acquire(limits.memory_bytes, limits.max_processes) if layers["kernel"] else None
    try:
        result = _run_process(root, work, code, test, limits, layers, cgroup.procs if cgroup else [])
        if cgroup and cgroup.oom_killed() and result.status != MEMORY:
            return dataclasses.replace(result, status=MEMORY, reason=f"the case's processes together passed "
                                       f"{limits.memory_bytes} bytes and the kernel killed one")
        return result
    finally:
        if cgroup:
            sandbox_cgroup.release(cgroup)


def _run_process(root: str, work: str, code: str, test: str, limits: SandboxLimits, layers: dict[str, bool],
                 cgroup_procs: list[str]) -> CaseResult:
    nonce = secrets.token_hex(16)
    verdict_r, verdict_w = os.pipe()
    payload = os.path.join(root, "payload.json")
    with open(os.open(payload, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump({"code": code, "test": test, "nonce": nonce, "verdict_fd": verdict_w, "parent_pid": os.getpid(),
                   **layers, "allow_weak": limits.allow_weak, "cgroup_procs": cgroup_procs,
                   "new_root": os.path.join(root, "fs"), "limits": asdict(limits)}, f)
    env = {"PATH": _ENV_PATH, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
    start = time.monotonic()
    try:
        process = subprocess.Popen([sys.executable, "-I", "-S", "-B", _CHILD, payload], cwd=work, env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   pass_fds=(verdict_w,), start_new_session=True)
    except BaseException:
        os.close(verdict_r)
        raise
    finally:
        os.close(verdict_w)
    with process, open(verdict_r, "rb", buffering=0) as verdict:
        outputs = {process.stdout: bytearray(), process.stderr: bytearray()}
        buffers = {**outputs, verdict: bytearray()}
        ended = _watch(process, buffers, outputs, start + limits.timeout_s, limits.max_output_bytes)
        _drain({verdict: buffers[verdict]}, outputs, limits.max_output_bytes)
        cpu_time_s = _kill(process, _namespace_init(bytes(buffers[verdict]), nonce, process.pid))
        _drain(buffers, outputs, limits.max_output_bytes)
    lines = _keyed_lines(bytes(buffers[verdict]), nonce)
    if "refused" in lines:
        raise SandboxUnavailable(f"the code sandbox has no kernel confinement of the file system here "
                                 f"({lines['refused']}); set the reward's allow_weak: true (reward_kwargs) to score "
                                 f"with rlimits and the audit hook only")
    if ended == "exited" and _size(outputs) > limits.max_output_bytes:
        ended = "output"
    stdout, stderr = (outputs[s][:limits.max_output_bytes].decode(errors="replace")
                      for s in (process.stdout, process.stderr))
    status, reason = _verdict(ended, lines, process.returncode, cpu_time_s, limits)
    held = tuple(lines["layers"].split(",")) if lines.get("layers") else ()
    return CaseResult(status, reason, stdout, stderr, time.monotonic() - start, held)


def _keyed_lines(verdict: bytes, nonce: str) -> dict[str, str]:
    """The child's lines keyed with `nonce`, `<nonce> <kind> <rest>`, as {kind: rest} (the first of each kind)."""
    lines = {}
    for line in verdict.decode(errors="replace").splitlines():
        key, _, rest = line.partition(" ")
        kind, _, rest = rest.partition(" ")
        if key == nonce:
            lines.setdefault(kind, rest)
    return lines


def _namespace_init(verdict: bytes, nonce: str, parent_pid: int) -> int | None:
    """A pidfd of the case's PID-namespace init, as the child announced its pid, while it is still the child of
    `parent_pid`; None without a namespace, or once the init is gone (and with it the namespace)."""
    pid = _keyed_lines(verdict, nonce).get("init", "")
    if not pid.isdigit():
        return None
    try:
        pidfd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        return None
    if _parent_pid(int(pid)) == parent_pid:  # not a process that took the pid after the init left it
        return pidfd
    os.close(pidfd)
    return None


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])  # after the command name, which may hold spaces
    except (OSError, IndexError, ValueError):
        return None


def _kill(process: subprocess.Popen, init: int | None) -> float:
    """Kill everything the case started and wait until it is gone: the namespace's init (`init`, a pidfd, closed
    here; the kernel kills every process in the namespace before the init exits), then the session's process group,
    then reap. The CPU seconds the case used (with the processes it reaped: the namespace's init, for one)."""
    try:
        if init is not None:
            try:
                signal.pidfd_send_signal(init, signal.SIGKILL)
                select.select([init], [], [], _KILL_WAIT_S)
            except ProcessLookupError:  # exited between the two
                pass
            outer = os.pidfd_open(process.pid)  # it reaps the init, then exits: killed first, it would leave a
            try:  # zombie for the machine's init, which may never reap it
                select.select([outer], [], [], _KILL_WAIT_S)
            finally:
                os.close(outer)
    finally:
        if init is not None:
            os.close(init)
        os.killpg(process.pid, signal.SIGKILL)  # before reaping, so the group id cannot have passed to another
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def _watch(process: subprocess.Popen, buffers: dict, outputs: dict, deadline: float, max_output_bytes: int) -> str:
    """Read the case's pipes into `buffers` until it exits ("exited"), runs past `deadline` ("timeout") or writes
    more than `max_output_bytes` to its `outputs` ("output")."""
    pidfd = os.pidfd_open(process.pid)  # readable once it exits; it is not reaped, so its group id stays its own
    try:
        with selectors.DefaultSelector() as selector:
            for stream in buffers:
                selector.register(stream, selectors.EVENT_READ)
            selector.register(pidfd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                for key, _ in selector.select(left):
                    if key.fileobj == pidfd:
                        return "exited"
                    if not _read_into(key.fileobj, buffers[key.fileobj], key.fileobj in outputs):
                        selector.unregister(key.fileobj)
                if _size(outputs) > max_output_bytes:
                    return "output"
    finally:
        os.close(pidfd)


def _read_into(stream, buffer: bytearray, is_output: bool) -> bool:
    """Read a chunk of `stream` into `buffer`; False at its end. The verdict pipe keeps its first bytes only."""
    chunk = os.read(stream.fileno(), _READ_CHUNK)
    buffer += chunk if is_output else chunk[:max(0, _MAX_VERDICT_BYTES - len(buffer))]
    return bool(chunk)


def _size(outputs: dict) -> int:
    return sum(len(buffer) for buffer in outputs.values())


def _drain(buffers: dict, outputs: dict, max_output_bytes: int) -> None:
    """What the pipes still hold, without waiting on a writer that escaped the kill."""
    for stream, buffer in buffers.items():
        os.set_blocking(stream.fileno(), False)
        is_output = stream in outputs
        try:
            while (not is_output or _size(outputs) <= max_output_bytes) and _read_into(stream, buffer, is_output):
                pass
        except BlockingIOError:
            pass


def _verdict(ended: str, lines: dict[str, str], returncode: int, cpu_time_s: float,
             limits: SandboxLimits) -> tuple[str, str]:
    if ended == "output":
        return OUTPUT_LIMIT, f"wrote more than {limits.max_output_bytes} bytes to stdout and stderr"
    if ended == "timeout":
        return TIMEOUT, f"ran past the wall-clock limit of {limits.timeout_s} s and was killed"
    for status in STATUSES:
        if status in lines:
            return status, lines[status]
    # SIGXCPU at the soft limit, or SIGKILL at the hard one: a namespace's init ignores SIGXCPU
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or cpu_time_s >= limits.cpu_time_s:
        return TIMEOUT, f"ran past the CPU-time limit of {limits.cpu_time_s} s and was killed"
    died = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
    return ERROR, f"the process {died} before its test finished"


def _make_removable(function, path: str, exc_info) -> None:
    """shutil.rmtree's onerror: a directory the code made unwritable (not root) is made writable and retried."""
    os.chmod(os.path.dirname(path), 0o700)
    function(path)
