"""The program one sandboxed test case runs in, `python -I -S -B sandbox_child.py PAYLOAD` (stdlib only): its limits,
cgroup, namespaces, minimal root, privilege drop, Landlock and seccomp first (`sandbox_kernel.py`), then the audit
hook, then the untrusted code and its test; `sandbox.py` says what each part enforces."""

import builtins
import json
import os
import resource
import select
import sys

# Imported before the privilege drop and the minimal root, so the code can use them wherever the stdlib lies;
# importlib here, so a later `import _imp` (refused below) is not needed by modules that use it.
PRELOADED = ("array", "bisect", "cmath", "collections", "copy", "datetime", "decimal", "enum",
             "fractions", "functools", "heapq", "importlib", "importlib.machinery", "importlib.util", "itertools",
             "math", "operator", "random", "re", "statistics", "socket", "string", "textwrap", "typing",
             "unicodedata")  # socket: what stops a connection is then the kernel and the hook, not a missing module
NOBODY = 65534
FILE_SYSTEM_LAYERS = ("root", "landlock")  # at least one holds, or the case is refused (unless allow_weak)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.truncate": 1,
                "os.utime": 1, "os.setxattr": 1, "os.removexattr": 1, "os.chdir": 1,
                "os.rename": 2, "os.symlink": 2, "os.link": 2}  # event -> how many leading arguments are paths
_READ_EVENTS = ("os.listdir", "os.scandir")
_REFUSED = ("sys.settrace", "sys.setprofile", "sys._getframe", "sys._current_frames", "gc.get_objects",
            "gc.get_referrers", "gc.get_referents")  # ways to rewrite or read the harness's frames
# ctypes reaches past the hook; a signal handler is handed the frame it interrupts; _imp.create_builtin loads
# _signal past the import check
_UNIMPORTABLE = ("ctypes", "_ctypes", "signal", "_signal", "_imp")
_FRAME_ATTRIBUTES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame")  # read through the "object.__getattr__" event
_PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                   "subprocess.Popen", "pty.spawn")


def main() -> None:
    path = sys.argv[1]
    with open(path) as f:
        payload = json.load(f)
    os.unlink(path)
    kernel = _load_kernel()
    kernel.set_parent_death_signal()
    if os.getppid() != payload["parent_pid"]:  # the scorer died before the prctl took hold
        os._exit(1)
    for procs in payload["cgroup_procs"]:  # first, so every process of the case is counted
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    limits = payload["limits"]
    _set_limits(limits)
    for name in PRELOADED:
        __import__(name)
    workdir, is_root = os.getcwd(), os.geteuid() == 0
    layers, missing = [], []
    if payload["cgroup_procs"]:
        layers.append("cgroup")
    if not payload["kernel"]:
        missing.append("kernel layers turned off")
    namespaces = payload["kernel"] and _try("namespaces", layers, missing, kernel.unshare_namespaces)
    if namespaces:  # this process stays outside and watches; its child is the new PID namespace's init
        kernel.set_parent_death_signal()
        if os.getppid() != payload["parent_pid"]:
            os._exit(1)
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid:  # the parent kills the namespace through its init, so it learns which process that is
            os.write(payload["verdict_fd"], f"{payload['nonce']} init {pid}\n".encode())
            _supervise(pid, limits["timeout_s"] + 1.0)
        os.close(alive_w)
        owner = (NOBODY, NOBODY) if is_root else (os.geteuid(), os.getegid())
        options = f"size={limits['max_workdir_bytes']},mode=0700,uid={owner[0]},gid={owner[1]}"
        _try("root", layers, missing, kernel.build_root, payload["new_root"], _read_only_paths(kernel), workdir,
             options)
    if is_root:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    elif namespaces:
        kernel.drop_capabilities()
    if namespaces:
        kernel.set_parent_death_signal()  # after setuid, which clears it: die with the watching parent
        if select.select([alive_r], [], [], 0)[0]:  # it died before the prctl took hold
            os._exit(1)
        os.close(alive_r)
    import _signal
    try:  # no Python-level handler left for interrupt_main to run (Python's own SIGINT one hands out no frame)
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    except OSError:  # a seccomp filter around the scorer already refuses handlers
        pass
    if payload["kernel"]:
        kernel.no_new_privs()
        read_only = _read_only_paths(kernel) + [d for d in kernel.DEVICES if d != "/dev/null"]
        _try("landlock", layers, missing, kernel.landlock, read_only, [workdir, "/dev/null"])
        _try("seccomp", layers, missing, kernel.seccomp)
    if not payload["allow_weak"] and not set(FILE_SYSTEM_LAYERS) & set(layers):
        os.write(payload["verdict_fd"], f"{payload['nonce']} refused {'; '.join(missing)}\n".encode())
        os._exit(0)
    os.write(payload["verdict_fd"], f"{payload['nonce']} layers {','.join(layers)}\n".encode())
    for name in [m for m in sys.modules if m.startswith(_UNIMPORTABLE)]:
        del sys.modules[name]
    del kernel, _signal
    allow_processes = "namespaces" in layers and (is_root or "cgroup" in layers)
    if payload["audit_hook"]:
        sys.addaudithook(_hook(os.path.realpath(workdir), allow_processes))
    _run(payload["code"], payload["test"], payload["verdict_fd"], payload["nonce"])


def _load_kernel():
    """sandbox_kernel.py, beside this file (`-I` leaves this directory off sys.path), kept out of sys.modules."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import sandbox_kernel
    finally:
        del sys.path[0]
    del sys.modules["sandbox_kernel"]
    return sandbox_kernel


def _try(name: str, layers: list, missing: list, step, *args) -> bool:
    """Run one kernel layer's set-up, `step(*args)`; record it as held, or as missing with the kernel's reason."""
    try:
        step(*args)
    except OSError as e:
        missing.append(f"{name}: {e.strerror or e}")
        return False
    layers.append(name)
    return True


def _read_only_paths(kernel) -> list[str]:
    """The stdlib's directories and the shared libraries' (the outermost of each, where one holds another)."""
    paths = sorted({os.path.realpath(p) for p in sys.path if p and os.path.exists(p)}
                   | {p for p in kernel.LIBRARY_PATHS if os.path.lexists(p)})
    return [p for i, p in enumerate(paths) if not any(p.startswith(q + "/") for q in paths[:i])]


def _supervise(pid: int, timeout_s: float) -> None:
    """Wait for the namespace's init, killing it (and so the namespace) past `timeout_s`; exit as it did."""
    pidfd = os.pidfd_open(pid)
    if not select.select([pidfd], [], [], timeout_s)[0]:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _set_limits(limits: dict) -> None:
    for name, value in (("RLIMIT_CPU", limits["cpu_time_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                        ("RLIMIT_FSIZE", limits["max_file_bytes"]), ("RLIMIT_NPROC", limits["max_processes"]),
                        ("RLIMIT_NOFILE", limits["max_open_files"]), ("RLIMIT_CORE", 0)):
        hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.setrlimit(getattr(resource, name), (value, hard))


def _hook(workdir: str, allow_processes: bool):
    """The audit hook: no sockets, no ctypes, no writes outside `workdir`, no reads outside it and the stdlib, no
    directory descriptors outside it and no relative path climbing out with `..` (the `dir_fd` forms resolve a path
    against a descriptor the hook is not told of), no signals to other processes, no frame tracing or walking (the
    harness's frame holds the verdict's nonce); no new processes unless the kernel contains them."""
    writable = (workdir, "/dev/null")
    readable = tuple(os.path.realpath(p) for p in sys.path if p) + (workdir, "/dev/null", "/dev/urandom")
    realpath, fspath, getpid, startswith, readlink = os.path.realpath, os.fspath, os.getpid, str.startswith, os.readlink
    isdir, isabs, sep = os.path.isdir, os.path.isabs, os.sep

    def resolve(path) -> str | None:
        """The real path, or None for a relative path with a `..` component or a descriptor of no file."""
        if isinstance(path, int):  # a descriptor: where it points (a pipe or socket has no path)
            try:
                target = readlink(f"/proc/self/fd/{path}")
            except OSError:
                return None
            return target if startswith(target, "/") else ""
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode(errors="surrogateescape")
        if not isabs(path) and ".." in path.split(sep):
            return None
        return realpath(path)

    def inside(path, roots) -> bool:
        path = resolve(path)
        return path is not None and (path == "" or any(path == root or startswith(path, root + "/")
                                                       for root in roots))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = bool(flags & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            if path is not None and (not inside(path, writable if writing else readable)
                                     or (not isinstance(path, int) and isdir(path) and not inside(path, writable))):
                raise PermissionError(f"sandbox: opening {path!r} {'to write' if writing else 'to read'} is refused")
        elif event in _PATH_EVENTS:
            for path in args[:_PATH_EVENTS[event]]:
                if path is not None and not inside(path, (workdir,)):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory is refused")
        elif event in _READ_EVENTS:
            if args and args[0] is not None and not inside(args[0], readable):
                raise PermissionError(f"sandbox: {event} of {args[0]!r} is refused")
        elif event.startswith(("socket.", "ctypes.")) or event in _REFUSED or (
                event == "object.__getattr__" and args[1] in _FRAME_ATTRIBUTES):
            raise PermissionError(f"sandbox: {event} is refused")
        elif event == "import" and startswith(args[0], _UNIMPORTABLE):
            raise PermissionError(f"sandbox: importing {args[0]} is refused")
        elif event in ("os.kill", "os.killpg") and args[0] not in (0, getpid()):
            raise PermissionError(f"sandbox: {event} of another process is refused")
        elif not allow_processes and (event in _PROCESS_EVENTS
                                      or (event == "import" and args[0] == "_posixsubprocess")):
            what = f"importing {args[0]}" if event == "import" else event
            raise PermissionError(f"sandbox: {what} is refused (new processes run only where the kernel counts "
                                  "and kills them: a PID namespace, and root or a pids cgroup)")

    return hook


def _message(error: BaseException, str=str, BaseException=BaseException) -> str:
    try:
        return str(error)
    except BaseException:  # the code's own exception class, whose __str__ raises
        return "<unprintable>"



def _run(code: str, test: str, verdict_fd: int, nonce: str, write=os.write, exit=os._exit, type=type, str=str,
         dict=dict, vars=vars, exec=exec, compile=compile, BaseException=BaseException,
         AssertionError=AssertionError, MemoryError=MemoryError, _message=_message, getpid=os.getpid,
         streams=(sys.stdout, sys.stderr)) -> None:
    """Compile the code and its test, then run the code, then the test; write the verdict, `<nonce> <status>
    <reason>`, and exit at once (no atexit handler, no thread of the code's runs after). Everything used after the
    code runs is bound before it (the defaults), and the test runs with the builtins as they were before it (the
    code cannot patch `exec`, `len` or `__import__` under the test) and without the code's names that shadow one.
    Only this process writes a verdict: a process the code forked that returns into the harness exits silently."""
    harness_pid = getpid()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    clean_builtins = dict(vars(builtins))
    part = "the code"
    try:
        code_object = compile(code, "<solution>", "exec")
        part = "the test"
        test_object = compile(test, "<test>", "exec")
        part = "the code"
        exec(code_object, namespace)
        part = "the test"
        test_namespace = {name: value for name, value in namespace.items()
                          if type(name) is str and name not in clean_builtins}
        test_namespace["__builtins__"] = clean_builtins
        exec(test_object, test_namespace)
        status, reason = "passed", ""
    except AssertionError as e:
        message = _message(e)
        if part == "the test":
            status, reason = "failed", f"assertion failed: {message or test.strip()}"
        else:
            status, reason = "error", f"the code raised AssertionError: {message}"
    except MemoryError:
        status, reason = "memory", f"{part} ran out of memory (MemoryError)"
    except BaseException as e:  # anything the untrusted code raises (SystemExit too) is its failure
        status, reason = "error", f"{part} raised {type(e).__name__}: {_message(e)}"
    for stream in streams:  # what the code printed, before os._exit drops it
        try:
            stream.flush()
        except BaseException:  # a stream past the file-size limit, or closed by the code
            pass
    reason = reason.replace("\n", " ")[:300]
    if getpid() != harness_pid:
        exit(0)
    write(verdict_fd, f"{nonce} {status} {reason}\n".encode(errors="replace"))
    exit(0)


if __name__ == "__main__":
    main()
