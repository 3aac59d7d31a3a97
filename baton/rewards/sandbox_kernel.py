"""The kernel layers of a sandboxed case, set up through ctypes inside `sandbox_child.py` (stdlib only, so the child
can load it by path): namespaces (a user namespace when not root), a minimal root with a fresh procfs, Landlock,
a seccomp filter and no_new_privs. Each function says what it needs; each returns whether it held or raises OSError."""

from __future__ import annotations

import ctypes
import os
import platform
import struct

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 1 << 12, 1 << 14, 1 << 18)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
_KEPT_FLAGS = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME  # = the MS_* bits
# Shared libraries an extension module of the stdlib may load, and the loader's cache that finds them.
LIBRARY_PATHS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib",
                 "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> None:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def set_parent_death_signal() -> None:
    """SIGKILL this process when its parent (thread) dies. A change of credentials clears it, so set it after
    them, and then check that the parent has not died already."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def unshare_namespaces() -> None:
    """New mount, PID (for the children), network, IPC, UTS and cgroup namespaces; without root first a user
    namespace, mapping this process's uid and gid to themselves, in which it may make the others."""
    if os.geteuid() == 0:
        _check(_libc.unshare(NAMESPACE_FLAGS), "unshare")
        return
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(CLONE_NEWUSER | NAMESPACE_FLAGS), "unshare(CLONE_NEWUSER)")
    for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(line)


def build_root(new_root: str, read_only: list[str], workdir: str, workdir_options: str) -> None:
    """Make `new_root` (an empty directory) this mount namespace's root: a tmpfs holding read-only binds of
    `read_only` (at their own paths), the devices in DEVICES, a fresh procfs (this PID namespace's), and a tmpfs
    at `workdir` mounted with `workdir_options`; then pivot into it, leaving the old root unreachable. Call as the
    init of a new PID namespace, with CAP_SYS_ADMIN in the mount namespace's owner."""
    if "pivot_root" not in _SYSCALLS:
        raise OSError(0, f"no pivot_root syscall number for {platform.machine()}")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below reaches the host's mounts
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in read_only:
        target = new_root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.lexists(target):
                os.symlink(os.readlink(path), target)
            continue
        _bind(path, target, read_only=True)
    for device in DEVICES:
        if os.path.exists(device):
            _bind(device, new_root + device, read_only=False)
    os.makedirs(new_root + "/proc")
    _mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(new_root + workdir)
    _mount("tmpfs", new_root + workdir, "tmpfs", MS_NOSUID | MS_NODEV, workdir_options)
    os.chdir(new_root)
    try:
        _check(_libc.syscall(_SYSCALLS["pivot_root"], b".", b"."), "pivot_root")  # the old root now lies under "/"
    except OSError:
        os.chdir(workdir)  # the case then runs where it started, under Landlock alone
        raise
    _check(_libc.umount2(b".", MNT_DETACH), "umount2")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(workdir)


def _bind(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:  # a bind takes its flags from the source; those a user namespace locks must be kept
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | (os.statvfs(source).f_flag & _KEPT_FLAGS))


def _mount(source, target: str, fstype, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def drop_capabilities() -> None:
    """Clear every capability of this process (capset version 3: two 32-bit words per set)."""
    header = struct.pack("Ii", 0x20080522, 0)
    data = bytes(24)
    _check(_libc.syscall(_SYSCALLS["capset"], header, data), "capset")


def no_new_privs() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


# --- Landlock -------------------------------------------------------------------------------------------------

_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_DIR_WRITES = sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_LL_NET_TCP = 0b11  # bind and connect
_LL_SCOPE = 0b11  # abstract unix sockets and signals outside the domain
_LL_CREATE_RULESET_VERSION, _LL_RULE_PATH_BENEATH = 1, 1
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # the same on every architecture


def landlock_abi() -> int:
    """Landlock's ABI version, 0 where the kernel has none (or it is disabled)."""
    return max(0, _libc.syscall(_LL_CREATE, None, 0, _LL_CREATE_RULESET_VERSION))


def landlock(read_only: list[str], read_write: list[str]) -> int:
    """Confine this process and its future children: files under `read_only` readable (and executable), under
    `read_write` also writable, nothing else; with ABI >= 4 no TCP bind or connect, with ABI >= 6 no signal to and
    no abstract unix socket of a process outside. Needs no_new_privs. The ABI used."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(0, "Landlock is not available")
    handled_fs = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_READ_DIR | _LL_DIR_WRITES
    handled_fs |= (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0) | (_LL_IOCTL_DEV if abi >= 5 else 0)
    attr = struct.pack("QQQ", handled_fs, _LL_NET_TCP if abi >= 4 else 0, _LL_SCOPE if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _libc.syscall(_LL_CREATE, attr, size, 0)
    _check(ruleset, "landlock_create_ruleset")
    try:
        file_rights = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | (handled_fs & (_LL_TRUNCATE | _LL_IOCTL_DEV))
        for paths, rights in ((read_only, _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR), (read_write, handled_fs)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    allowed = rights if os.path.isdir(path) else rights & file_rights
                    rule = struct.pack("=Qi", allowed, fd)
                    _check(_libc.syscall(_LL_ADD_RULE, ruleset, _LL_RULE_PATH_BENEATH, rule, 0), f"landlock {path}")
                finally:
                    os.close(fd)
        _check(_libc.syscall(_LL_RESTRICT, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


# --- seccomp --------------------------------------------------------------------------------------------------

_X86_64 = {"arch": 0xC000003E, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "socket": 41,
           "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "mount": 165, "umount2": 166,
           "unshare": 272, "setns": 308, "perf_event_open": 298, "pivot_root": 155, "chroot": 161,
           "rt_sigaction": 13, "init_module": 175, "finit_module": 313, "delete_module": 176, "userfaultfd": 323,
           "name_to_handle_at": 303, "open_by_handle_at": 304, "kcmp": 312, "clone": 56, "capset": 126}
_AARCH64 = {"arch": 0xC00000B7, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "socket": 198,
            "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "mount": 40, "umount2": 39,
            "unshare": 97, "setns": 268, "perf_event_open": 241, "pivot_root": 41, "chroot": 51,
            "rt_sigaction": 134, "init_module": 105, "finit_module": 273, "delete_module": 106, "userfaultfd": 282,
            "name_to_handle_at": 264, "open_by_handle_at": 265, "kcmp": 272, "clone": 220, "capset": 91}
# The same number on both: io_uring (its operations pass by seccomp), the new mount API, pidfd_getfd, clone3.
_GENERIC = {"io_uring_setup": 425, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
            "fsmount": 432, "fspick": 433, "pidfd_getfd": 438, "mount_setattr": 442, "clone3": 435}
_SYSCALLS = {**{"x86_64": _X86_64, "aarch64": _AARCH64}.get(platform.machine(), {}), **_GENERIC}
_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "keyctl", "add_key", "request_key", "bpf", "mount",
           "umount2", "unshare", "setns", "perf_event_open", "pivot_root", "chroot", "init_module", "finit_module",
           "delete_module", "userfaultfd", "name_to_handle_at", "open_by_handle_at", "kcmp", "io_uring_setup",
           "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "pidfd_getfd", "mount_setattr")
_EPERM, _ENOSYS, _EAFNOSUPPORT, _AF_UNIX = 1, 38, 97, 1
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
_LD_W_ABS, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, ..., BPF_RET|BPF_K
_NR, _ARCH, _ARG0, _ARG1_LOW, _ARG1_HIGH = 0, 4, 16, 24, 28  # offsets in struct seccomp_data


def seccomp_supported() -> bool:
    return "arch" in _SYSCALLS


def seccomp() -> None:
    """A filter, for this process and its children, refusing (EPERM) ptrace, process_vm_*, keyrings, bpf, mounts,
    new namespaces (unshare, setns, clone with a namespace flag), perf_event_open, kernel modules, file handles,
    io_uring, pidfd_getfd, and sockets other than AF_UNIX; rt_sigaction that sets a handler (so no Python signal
    handler, which would be handed the harness's frame, ever runs); clone3 (ENOSYS: the C library falls back to
    clone, whose flags can be checked). Other architectures than the native one are killed. Needs no_new_privs."""
    if not seccomp_supported():
        raise OSError(0, f"no seccomp syscall table for {platform.machine()}")
    program = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, _SYSCALLS["arch"]), (_RET, 0, 0, _RET_KILL),
               (_LD_W_ABS, 0, 0, _NR)]
    if platform.machine() == "x86_64":  # the x32 ABI: the same numbers with bit 30 set
        program += [(0x35, 0, 1, 0x40000000), (_RET, 0, 0, _RET_ERRNO | _EPERM)]  # BPF_JGE
    for name in _DENIED:
        program += [(_JEQ, 0, 1, _SYSCALLS[name]), (_RET, 0, 0, _RET_ERRNO | _EPERM)]
    program += [(_JEQ, 0, 1, _SYSCALLS["clone3"]), (_RET, 0, 0, _RET_ERRNO | _ENOSYS)]
    program += [(_JEQ, 0, 4, _SYSCALLS["socket"]), (_LD_W_ABS, 0, 0, _ARG0), (_JEQ, 0, 1, _AF_UNIX),
                (_RET, 0, 0, _RET_ALLOW), (_RET, 0, 0, _RET_ERRNO | _EAFNOSUPPORT)]
    program += [(_JEQ, 0, 5, _SYSCALLS["rt_sigaction"]), (_LD_W_ABS, 0, 0, _ARG1_LOW), (_JEQ, 0, 2, 0),
                (_LD_W_ABS, 0, 0, _ARG1_HIGH), (_JEQ, 1, 0, 0), (_RET, 0, 0, _RET_ERRNO | _EPERM)]
    program += [(_LD_W_ABS, 0, 0, _NR), (_JEQ, 0, 3, _SYSCALLS["clone"]), (_LD_W_ABS, 0, 0, _ARG0),
                (_JSET, 0, 1, CLONE_NEWUSER | NAMESPACE_FLAGS), (_RET, 0, 0, _RET_ERRNO | _EPERM)]
    program += [(_RET, 0, 0, _RET_ALLOW)]
    filters = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(filters)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program), ctypes.addressof(buffer))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
