"""The program one sandboxed test case runs in, `python -I -S -B sandbox_child.py PAYLOAD` (stdlib only): its limits,
namespaces and privilege drop first, then the audit hook, then the untrusted code and its test; `sandbox.py` says
what each part enforces."""

import builtins
import json
import os
import resource
import select
import sys

# Imported before the privilege drop, so the code can use them where the interpreter's stdlib is not readable by the
# sandbox user (a Python under /root, mode 0700); other stdlib modules import only where it is.
PRELOADED = ("array", "bisect", "cmath", "collections", "copy", "datetime", "decimal", "enum",
             "fractions", "functools", "heapq", "itertools", "math", "operator", "random", "re", "statistics",
             "socket", "string", "textwrap", "typing", "unicodedata")  # socket: what stops a connection is then the
# hook and the network namespace everywhere, not whether the stdlib happens to be readable
CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWNS = 0x40000000, 0x20000000, 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 1 << 12, 1 << 14, 1 << 18
PR_SET_PDEATHSIG = 1
_KEPT_FLAGS = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME  # = the MS_* bits
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.truncate": 1,
                "os.utime": 1, "os.setxattr": 1, "os.removexattr": 1, "os.chdir": 1,
                "os.rename": 2, "os.symlink": 2, "os.link": 2}  # event -> how many leading arguments are paths
_READ_EVENTS = ("os.listdir", "os.scandir")
_REFUSED = ("sys.settrace", "sys.setprofile", "sys._getframe", "sys._current_frames", "gc.get_objects",
            "gc.get_referrers", "gc.get_referents")  # ways to rewrite or read the harness's frames
# ctypes reaches past the hook; a signal handler is handed the frame it interrupts
_UNIMPORTABLE = ("ctypes", "_ctypes", "signal", "_signal")
_FRAME_ATTRIBUTES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame")  # read through the "object.__getattr__" event
_PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                   "subprocess.Popen", "pty.spawn")


def main() -> None:
    path = sys.argv[1]
    with open(path) as f:
        payload = json.load(f)
    os.unlink(path)
    limits = payload["limits"]
    _set_limits(limits)
    for name in PRELOADED:
        __import__(name)
    libc = _libc()
    pid_namespace = payload["drop_to"] is not None and _unshare(libc, limits["max_workdir_bytes"], payload["drop_to"])
    if pid_namespace:  # this process stays outside and waits; its child is the new namespace's init
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid:  # the parent kills the namespace through its init, so it learns which process that is
            os.write(payload["verdict_fd"], f"{payload['nonce']} init {pid}\n".encode())
            _wait_and_exit(pid)
        os.close(alive_w)
    if payload["drop_to"] is not None:
        uid, gid = payload["drop_to"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if pid_namespace:
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # after setuid, which clears it: die with the waiting parent
        if select.select([alive_r], [], [], 0)[0]:  # it died before the prctl took hold
            os._exit(1)
        os.close(alive_r)
    for name in [m for m in sys.modules if m.startswith(_UNIMPORTABLE)]:
        del sys.modules[name]
    del libc
    sys.addaudithook(_hook(os.path.realpath(os.getcwd()), allow_processes=payload["drop_to"] is not None))
    _run(payload["code"], payload["test"], payload["verdict_fd"], payload["nonce"])


def _set_limits(limits: dict) -> None:
    for name, value in (("RLIMIT_CPU", limits["cpu_time_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                        ("RLIMIT_FSIZE", limits["max_file_bytes"]), ("RLIMIT_NPROC", limits["max_processes"]),
                        ("RLIMIT_NOFILE", limits["max_open_files"]), ("RLIMIT_CORE", 0)):
        hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.setrlimit(getattr(resource, name), (value, hard))


def _libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


def _unshare(libc, max_workdir_bytes: int, owner: tuple[int, int]) -> bool:
    """A network namespace of its own (no interface but a down loopback), a mount namespace where the working
    directory is a tmpfs of `max_workdir_bytes`, and a PID namespace for its children; each where the kernel allows
    it. Whether the PID namespace was made."""
    libc.unshare(CLONE_NEWNET)
    if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
        # only once nothing mounted here can reach the host's mounts
        _remount_read_only(libc)
        options = f"size={max_workdir_bytes},mode=0700,uid={owner[0]},gid={owner[1]}".encode()
        if libc.mount(b"tmpfs", os.getcwd().encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0:
            os.chdir(os.getcwd())  # into the tmpfs, which now covers the directory this process was in
    return libc.unshare(CLONE_NEWPID) == 0


def _remount_read_only(libc) -> None:
    """Every mount of this (private) mount namespace read-only, keeping its nosuid/nodev/noexec; device nodes such
    as /dev/null stay writable, a read-only mount does not stop writes to a device."""
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    for point in dict.fromkeys(points):
        point = point.encode().decode("unicode_escape").encode("latin-1")  # /proc/mounts writes a space as \040
        try:
            flags = os.statvfs(point).f_flag & _KEPT_FLAGS
        except OSError:
            continue
        libc.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)


def _wait_and_exit(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _hook(workdir: str, allow_processes: bool):
    """The audit hook: no sockets, no ctypes, no writes outside `workdir`, no reads outside it and the stdlib, no
    signals to other processes, no frame tracing or walking (the harness's frame holds the verdict's nonce); no
    new processes unless the kernel contains them."""
    writable = (workdir, "/dev/null")
    readable = tuple(os.path.realpath(p) for p in sys.path if p) + (workdir, "/dev/null", "/dev/urandom")
    realpath, fspath, getpid, startswith = os.path.realpath, os.fspath, os.getpid, str.startswith

    def inside(path, roots) -> bool:
        if isinstance(path, int):  # an open file descriptor
            return True
        path = realpath(fspath(path))
        if isinstance(path, bytes):
            path = path.decode(errors="surrogateescape")
        return any(path == root or startswith(path, root + "/") for root in roots)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = bool(flags & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            if path is not None and not inside(path, writable if writing else readable):
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
            raise PermissionError(f"sandbox: {what} is refused (new processes run only when the sandbox drops "
                                  "root, which makes the kernel count and kill them)")

    return hook


def _run(code: str, test: str, verdict_fd: int, nonce: str, write=os.write, exit=os._exit, type=type, str=str,
         BaseException=BaseException, AssertionError=AssertionError, MemoryError=MemoryError,
         streams=(sys.stdout, sys.stderr)) -> None:
    """Run the code, then its test, in one namespace; write the verdict, `<nonce> <status> <reason>`, and exit at once
    (no atexit handler, no thread of the code's runs after). The defaults are bound before the code runs, so it cannot
    swap them."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    part = "the code"
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
        part = "the test"
        exec(compile(test, "<test>", "exec"), namespace)
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
    write(verdict_fd, f"{nonce} {status} {reason}\n".encode(errors="replace"))
    exit(0)


def _message(error: BaseException, str=str, BaseException=BaseException) -> str:
    try:
        return str(error)
    except BaseException:  # the code's own exception class, whose __str__ raises
        return "<unprintable>"


if __name__ == "__main__":
    main()
