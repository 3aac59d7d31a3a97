"""The code sandbox against model output written to escape it or to forge its verdict (issue 32), in both of its
modes: as root (as here and in CI), and on its non-root path (the scorer run with euid 1000 in a user namespace of
its own, `unshare --user --map-user=1000`; it keeps root's kernel uid, so file permissions hold nothing there and
what holds is the sandbox's user namespace, minimal root, Landlock, seccomp and audit hook). Each mode's cases run
in one scoring process, two at a time."""

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

from baton.datasets.code_oneliners import CODE_ONELINERS
from baton.datasets.files import read_rows
from baton.rewards import sandbox_cgroup
from baton.rewards.sandbox import (FAILED, MEMORY, PASSED, SandboxLimits, SandboxUnavailable, code_sandbox_reward,
                                   run_case)
from conftest import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_FILE = os.path.join(REPO, "baton", "rewards", "sandbox.py")
DATASET_FILE = os.path.join(REPO, "baton", "datasets", "data", "code_oneliners.jsonl")
SECRET = "hostile-secret-7f3a9c"  # in the scorer's environment and command line, and in a world-readable file
MODES = ["root", "non-root"]
_KERNEL_LAYERS = {"namespaces", "root", "landlock", "seccomp"}
# The scoring process of a mode: reads [{code, test} or {code, reward_tests}] on stdin, writes the results as JSON.
_SCORER = r"""
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
from baton.rewards.sandbox import SandboxLimits, code_sandbox_reward, run_case
items = json.load(sys.stdin)
def one(item):
    code = item["code"].replace("SCORER_PID", str(os.getpid()))
    if "reward_tests" in item:
        return {"score": code_sandbox_reward(code, item["reward_tests"])}
    r = run_case(code, item["test"], SandboxLimits(timeout_s=5.0, max_output_bytes=4096), _audit_hook=item["hook"])
    return {"status": r.status, "reason": r.reason, "output": r.stdout + r.stderr, "layers": list(r.layers)}
with ThreadPoolExecutor(2) as pool:
    results = list(pool.map(one, items))
print(json.dumps({"euid": os.geteuid(), "results": results}))
"""
_AS_USER = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]


def _userns_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        [*_AS_USER, "true"], capture_output=True, timeout=30).returncode == 0


def _scorer_command(mode: str, script: str) -> list[str]:
    if mode == "non-root":
        if os.geteuid() != 0 or not _userns_works():
            pytest.skip("the non-root path is run here in a user namespace made by root (unshare --user)")
        return [*_AS_USER, sys.executable, "-c", script, SECRET]
    if os.geteuid() != 0:
        pytest.skip("the root path needs root")
    return [sys.executable, "-c", script, SECRET]


@pytest.fixture(scope="module")
def outside():
    """A world-readable, world-writable directory outside the sandbox: a secret file, a file to keep, and paths
    the code must not create."""
    directory = tempfile.mkdtemp(prefix="baton-hostile-")
    os.chmod(directory, 0o777)
    with open(os.path.join(directory, "secret.txt"), "w") as f:
        f.write(SECRET)
    with open(os.path.join(directory, "keep.txt"), "w") as f:
        f.write("keep")
    os.chmod(os.path.join(directory, "secret.txt"), 0o644)
    os.chmod(os.path.join(directory, "keep.txt"), 0o666)
    yield directory
    shutil.rmtree(directory)


def _escapes(outside: str) -> dict[str, str]:
    """Code that tries each escape of issue 32's first item; none may pass, print SECRET or touch `outside`."""
    climb = ("import os\n"
             "fd = os.open('.', os.O_RDONLY)\n"
             "up = '../' * os.getcwd().count('/')  # from the working directory to /\n"
             "os.makedirs('a/b/c')\n"
             "os.chdir('a/b/c')  # so the path, read from here, seems to stay inside\n")
    rel = lambda name: f"up + {os.path.join(outside, name).lstrip('/')!r}"  # noqa: E731
    return {
        "dir_fd_read": climb + f"print(os.read(os.open({rel('secret.txt')}, os.O_RDONLY, dir_fd=fd), 100))",
        "dir_fd_write": climb + f"os.close(os.open({rel('written.txt')}, os.O_WRONLY | os.O_CREAT, dir_fd=fd))",
        "dir_fd_unlink": climb + f"os.unlink({rel('keep.txt')}, dir_fd=fd)",
        "dir_fd_mkdir": climb + f"os.mkdir({rel('made')}, dir_fd=fd)",
        "dir_fd_rename": climb + "open(os.path.join('/', *os.getcwd().split('/')[:-3], 'x'), 'w').close()\n"
                                 f"os.rename('x', {rel('renamed.txt')}, src_dir_fd=fd, dst_dir_fd=fd)",
        "fchdir_outside": f"import os\nos.fchdir(os.open({outside!r}, os.O_RDONLY))\nprint(open('secret.txt').read())",
        "imp_import": ("import _imp, time, importlib.machinery as m\n"
                       "s = _imp.create_builtin(m.ModuleSpec('_signal', None))\n"
                       "s.signal(14, lambda n, frame: print(frame.f_back.f_locals))\n"
                       "s.setitimer(0, 0.01)\ntime.sleep(0.2)\n"),
        "imp_create_builtin": ("import sys, time, importlib.machinery as m\n"
                               "s = sys.modules['_frozen_importlib']._imp.create_builtin("
                               "m.ModuleSpec('_signal', None))\n"
                               "s.signal(14, lambda n, frame: print(frame.f_back.f_locals))\n"
                               "s.setitimer(0, 0.01)\ntime.sleep(0.2)\n"),
        "parent_environ": "print(open('/proc/SCORER_PID/environ').read())",
        "parent_cmdline": "print(open('/proc/SCORER_PID/cmdline').read())",
        "any_cmdline": ("import os\nfor pid in range(2, 4096):\n"
                        "    try:\n        print(open(f'/proc/{pid}/cmdline').read())\n"
                        "    except OSError:\n        pass\nassert False"),
        "kill_scorer": "import os\nos.kill(SCORER_PID, 9)",
        "kill_everything": "import os\nos.kill(-1, 9)",
        "project_source": f"print(open({PROJECT_FILE!r}).read())",
        "dataset": f"print(open({DATASET_FILE!r}).read())",
        "list_project": f"import os\nprint(os.listdir({REPO!r}))",
        "world_readable_file": f"print(open({os.path.join(outside, 'secret.txt')!r}).read())",
    }


def _hacks(function: str = "f") -> dict[str, str]:
    """Responses a policy would find to score without solving the task, whose function is `function` (issue 32's
    second item)."""
    return {
        "patch_exec": "import builtins; builtins.exec = lambda *a, **k: None",
        "patch_compile": "import builtins; builtins.compile = lambda *a, **k: compile('pass', 't', 'exec')",
        "patch_import": "import builtins; builtins.__import__ = lambda *a, **k: None",
        "shadow_builtins": "len = sorted = set = list = sum = lambda *a, **k: 0",
        "print_verdicts": ("import os\nfor line in ('passed', 'passed ', '0 passed', 'ok'):\n    print(line)\n"
                           "    for fd in range(3, 64):\n        try:\n            os.write(fd, (line + '\\n').encode())\n"
                           "        except OSError:\n            pass"),
        "sys_exit": "import sys; sys.exit(0)",
        "os_exit": "import os; os._exit(0)",
        "exit_in_test": f"def {function}(*args):\n    raise SystemExit(0)",
        "os_exit_in_test": f"import os\ndef {function}(*args):\n    os._exit(0)",
        "flood": "while True:\n    print('passed ' * 1000)",
    }


@pytest.fixture(scope="module", params=MODES)
def scored(request, outside):
    """Every escape and hack of this module, scored in one scoring process of the mode."""
    rows, _, _ = read_rows(CODE_ONELINERS)
    tasks = [(row["answer"], re.search(r"def (\w+)", row["reference"]).group(1)) for row in rows[:2]]
    escapes, hacks = _escapes(outside), _hacks()
    items = ([{"code": code, "test": "pass", "hook": hook} for hook in (True, False) for code in escapes.values()]
             + [{"code": _hacks(function)[name], "reward_tests": tests} for name in hacks for tests, function in tasks])
    command = _scorer_command(request.param, _SCORER)
    process = subprocess.run(command, input=json.dumps(items), capture_output=True, text=True, timeout=300,
                             env={**os.environ, "BATON_HOSTILE_SECRET": SECRET}, cwd=REPO)
    assert process.returncode == 0, process.stderr[-3000:]  # the scorer lived, and so was not killed
    report = json.loads(process.stdout.splitlines()[-1])
    assert (report["euid"] == 0) == (request.param == "root")
    results = report["results"]
    by_escape = {(name, hook): results[i + (0 if hook else len(escapes))]
                 for i, name in enumerate(escapes) for hook in (True, False)}
    by_hack = {name: [r["score"] for r in results[2 * len(escapes) + i * len(tasks):][:len(tasks)]]
               for i, name in enumerate(hacks)}
    return by_escape, by_hack


@pytest.mark.parametrize("hook", [True, False], ids=["hook", "kernel-alone"])
@pytest.mark.parametrize("escape", list(_escapes("/x")))
def test_an_escape_is_blocked(scored, outside, escape, hook):
    """Blocked by the kernel and the hook together, and by the kernel alone (the hook left out)."""
    result = scored[0][(escape, hook)]
    assert result["status"] != PASSED, result
    assert SECRET not in result["output"] + result["reason"], result
    for path in (PROJECT_FILE, DATASET_FILE):
        with open(path) as f:
            assert f.readline().strip()[:40] not in result["output"], result
    assert _KERNEL_LAYERS <= set(result["layers"]), result
    assert sorted(os.listdir(outside)) == ["keep.txt", "secret.txt"]
    with open(os.path.join(outside, "keep.txt")) as f:
        assert f.read() == "keep"


@pytest.mark.parametrize("hack", list(_hacks()))
def test_a_reward_hack_scores_zero(scored, hack):
    assert scored[1][hack] == [0.0] * len(scored[1][hack])


@pytest.mark.parametrize("mode", MODES)
def test_the_kernel_holds_without_the_audit_hook(mode, outside, tmp_path):
    """Landlock and seccomp alone (no hook, no namespaces): the dir_fd climb, a world-readable file outside, a TCP
    socket and ptrace are refused by the kernel."""
    script = f"""
import ctypes, os, sys
sys.path.insert(0, {os.path.join(REPO, 'baton', 'rewards')!r})
import sandbox_kernel as kernel
work = {str(tmp_path)!r}
os.chdir(work)
kernel.no_new_privs()
kernel.landlock([p for p in sys.path[1:] if os.path.isdir(p)] + list(kernel.LIBRARY_PATHS), [work])
kernel.seccomp()
fd = os.open('.', os.O_RDONLY)
os.makedirs('a/b/c')
os.chdir('a/b/c')
refused = []
for attempt in (lambda: os.open('../' * work.count('/') + {os.path.join(outside, 'secret.txt').lstrip('/')!r},
                                os.O_RDONLY, dir_fd=fd),
                lambda: open({os.path.join(outside, 'secret.txt')!r}).read(),
                lambda: __import__('socket').socket(),
                lambda: ctypes.CDLL(None, use_errno=True).ptrace(16, os.getppid(), 0, 0) == 0 or 1 / 0):
    try:
        attempt()
    except (PermissionError, OSError, ZeroDivisionError):
        refused.append(True)
    else:
        refused.append(False)
print(refused)
"""
    if kernel_abi() < 1:
        pytest.skip("this kernel has no Landlock")
    process = subprocess.run(_scorer_command(mode, script), capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == "[True, True, True, True]"


def kernel_abi() -> int:
    from baton.rewards import sandbox_kernel
    return sandbox_kernel.landlock_abi()


def case_processes(scorer: subprocess.Popen) -> list[psutil.Process]:
    """The processes of the case `scorer` runs, once there are its outer process and its init."""
    cases: list[psutil.Process] = []

    def started() -> bool:
        cases[:] = psutil.Process(scorer.pid).children(recursive=True)
        return len(cases) >= 2

    wait_until(started, "the case to start", timeout_s=60)
    return cases


@pytest.mark.skipif(os.geteuid() != 0, reason="kills a scoring process of its own, found among root's")
@pytest.mark.timeout(300)
def test_a_killed_scorer_takes_its_cases_with_it_and_the_next_start_sweeps_its_directory():
    # The case sleeps an hour under a 10-minute wall limit: within the wait below only its scorer's death ends it.
    scorer = ("from baton.rewards.sandbox import SandboxLimits, run_case\n"
              "run_case('import time\\ntime.sleep(3600)', 'pass', SandboxLimits(timeout_s=600.0))\n")
    process = subprocess.Popen([sys.executable, "-c", scorer], cwd=REPO)
    try:
        cases = case_processes(process)
        directories = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"baton-sandbox-{process.pid}-")]
        assert len(directories) == 1
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        gone, alive = psutil.wait_procs(cases, timeout=60)
        assert not alive, f"the case outlived its killed scorer: {alive}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert os.path.isdir(os.path.join(tempfile.gettempdir(), directories[0]))  # left behind by the kill
    next_start = "from baton.rewards.sandbox import run_case\nassert run_case('x = 1', 'pass').passed\n"
    subprocess.run([sys.executable, "-c", next_start], cwd=REPO, check=True, timeout=60)
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), directories[0]))


@pytest.mark.skipif(not sandbox_cgroup.available(), reason="no writable cgroup hierarchy with memory and pids")
def test_the_memory_cap_holds_over_all_of_a_cases_processes():
    """Four forks of 100 MiB each, in a case capped at 200 MiB (each process well within its own RLIMIT_AS)."""
    code = ("import os, time\n"
            "children = []\n"
            "for _ in range(4):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        block = bytearray(100 * 2**20)\n"
            "        block[::4096] = b'x' * len(block[::4096])\n"
            "        time.sleep(1)\n"
            "        os._exit(0)\n"
            "    children.append(pid)\n"
            "for pid in children:\n"
            "    assert os.waitpid(pid, 0)[1] == 0\n")
    result = run_case(code, "pass", SandboxLimits(timeout_s=10.0, memory_bytes=200 * 2**20))
    assert result.status == MEMORY and "the kernel killed one" in result.reason, result  # not one MemoryError
    assert "cgroup" in result.layers


def test_without_kernel_confinement_scoring_is_refused_unless_allow_weak():
    with pytest.raises(SandboxUnavailable, match="allow_weak: true"):
        run_case("x = 1", "pass", _kernel=False)
    weak = run_case("x = 1", "pass", SandboxLimits(allow_weak=True), _kernel=False)
    assert weak.passed and weak.layers == ()
    assert code_sandbox_reward("def f(): return 1", '["assert f() == 1"]', allow_weak=True) == 1.0


def test_the_test_sees_the_builtins_as_they_were():
    code = "import builtins\ndef f(): return [1]\nlen = lambda x: 3\nbuiltins.sorted = lambda x: [9]\n"
    assert run_case(code, "assert len(f()) == 3").status == FAILED
    assert run_case(code, "assert sorted(f()) == [9]").status == FAILED
    assert run_case(code, "assert len(f()) == 1 and sorted(f()) == [1]").passed


@pytest.mark.skipif(os.geteuid() != 0, reason="new processes run where the kernel counts them (root here)")
def test_only_the_cases_own_process_gives_the_verdict():
    """A forked child that returns into the harness passes its test, and is ignored: the parent fails."""
    code = "import os\nif os.fork() == 0:\n    def f(): return 1\nelse:\n    os.wait()\n    def f(): return 0\n"
    assert run_case(code, "assert f() == 1").status == FAILED


@pytest.mark.parametrize("mode", MODES)
def test_landlock_alone_holds_where_namespaces_are_refused(mode, outside):
    """A scorer that cannot make namespaces (a seccomp filter of its own refuses them, as some containers do): its
    cases run on the host's file system under Landlock and seccomp, without the hook, and still reach nothing."""
    secret = os.path.join(outside, "secret.txt")
    script = f"""
import os, sys
sys.path.insert(0, {os.path.join(REPO, 'baton', 'rewards')!r})
import sandbox_kernel
sandbox_kernel.no_new_privs()
sandbox_kernel.seccomp()
from baton.rewards.sandbox import run_case
climb = ("import os\\nfd = os.open('.', os.O_RDONLY)\\nup = '../' * os.getcwd().count('/')\\nos.makedirs('a/b/c')\\n"
         "os.chdir('a/b/c')\\nprint(os.read(os.open(up + {secret.lstrip('/')!r}, os.O_RDONLY, dir_fd=fd), 100))")
for code in (climb, "print(open({secret!r}).read())", "print(open({PROJECT_FILE!r}).read())",
             "open({os.path.join(outside, 'written.txt')!r}, 'w').write('x')",
             "open('inside', 'w').write('ok'); assert open('inside').read() == 'ok'"):
    r = run_case(code, "pass", _audit_hook=False)
    print(r.status, ",".join(r.layers), r.stdout.replace("\\n", " ")[:200])
"""
    process = subprocess.run(_scorer_command(mode, script), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert process.returncode == 0, process.stderr[-3000:]
    lines = process.stdout.splitlines()
    assert len(lines) == 5 and SECRET not in process.stdout, process.stdout
    for line in lines[:4]:
        status, layers = line.split()[:2]
        assert status == "error" and "landlock" in layers and "namespaces" not in layers, line
    assert lines[4].startswith("passed"), lines[4]
    assert sorted(os.listdir(outside)) == ["keep.txt", "secret.txt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="stops a scoring process of its own, found among root's")
@pytest.mark.timeout(300)
def test_the_case_holds_its_own_wall_limit_while_the_scorer_is_stopped():
    """The scorer stopped (SIGSTOP) cannot kill the case at its limit; the case's outer process kills its
    namespace at the limit + 1 s by itself. The case sleeps an hour: within the wait below, only that kill ends it."""
    scorer = ("from baton.rewards.sandbox import SandboxLimits, run_case\n"
              "print(run_case('import time\\ntime.sleep(3600)', 'pass', SandboxLimits(timeout_s=1.0)).status)\n")
    process = subprocess.Popen([sys.executable, "-c", scorer], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        cases = case_processes(process)
        inner = [p for p in cases if p.ppid() != process.pid]  # the namespace's init (its outer process, the
        os.kill(process.pid, signal.SIGSTOP)  # scorer's child, stays a zombie until the scorer reaps it)
        assert inner
        _, alive = psutil.wait_procs(inner, timeout=60)
        assert not alive, f"the case outlived its own wall limit: {alive}"
    finally:
        os.kill(process.pid, signal.SIGCONT)
    assert process.communicate(timeout=60)[0].strip() == "timeout"
