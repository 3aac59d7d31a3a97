"""The code sandbox reward: correct and wrong code, and hostile code (loops, memory and fork bombs, writes and reads
outside the sandbox, sockets, floods of output, signals to the parent), each contained and scored as a failure
while this process lives on; the shipped code task's reference solutions score 1 through score_rows."""

import json
import os
import socket
import threading

import psutil
import pytest

from baton.datasets.code_oneliners import CODE_ONELINERS
from baton.datasets.files import read_rows
from baton.rewards import REWARDS, ScoringPool, score_rows
from baton.rewards.sandbox import (ERROR, FAILED, MEMORY, NOBODY, OUTPUT_LIMIT, PASSED, TIMEOUT, SandboxLimits,
                                   code_sandbox_reward, extract_code, parse_tests, run_case, run_tests, score_results)

IS_ROOT = os.geteuid() == 0
FAST = SandboxLimits(timeout_s=2.0, cpu_time_s=2)
root_only = pytest.mark.skipif(not IS_ROOT, reason="the privilege drop, RLIMIT_NPROC and namespaces need root")


def _namespaces_allowed() -> bool:
    """Whether this machine lets root make namespaces (a container without CAP_SYS_ADMIN does not; the sandbox
    then runs without them, as its docstring says)."""
    import subprocess
    import sys

    probe = "import ctypes, os; os._exit(0 if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0 else 1)"
    return IS_ROOT and subprocess.run([sys.executable, "-c", probe], timeout=30).returncode == 0


NAMESPACES = _namespaces_allowed()
namespaced = pytest.mark.skipif(not NAMESPACES, reason="needs root allowed to make namespaces (CAP_SYS_ADMIN)")


def _sandbox_processes() -> list[psutil.Process]:
    """Processes a case left: any of uid nobody, or any running the sandbox's child program."""
    left = []
    for p in psutil.process_iter(["uids", "cmdline"]):
        try:
            if (IS_ROOT and p.info["uids"] and p.info["uids"].real == NOBODY) or \
                    any("sandbox_child.py" in part for part in p.info["cmdline"] or ()):
                left.append(p)
        except psutil.Error:
            pass
    return left


@pytest.fixture(autouse=True)
def no_leftovers():
    before = {p.pid for p in _sandbox_processes()}  # uid nobody's own processes, if the machine runs any
    yield
    left = [p for p in _sandbox_processes() if p.pid not in before]
    assert not left, f"a sandboxed case left processes behind: {left}"


def test_extract_code_and_parse_tests():
    assert extract_code("Here:\n```python\ndef f(): return 1\n```\nDone.") == "def f(): return 1\n"
    assert extract_code("```\nx = 1\n```\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("```python\ndef f(): return 1") == "def f(): return 1"  # cut off before the closing fence
    assert extract_code("def f(): return 1") == "def f(): return 1"
    assert extract_code("```js\nlet x\n```\nThen:\n```\ny = 3\n```\n") == "y = 3\n"
    assert extract_code("```js\nlet x\n```") == "```js\nlet x\n```"
    assert parse_tests('["assert f() == 1", "assert f() != 2"]') == ["assert f() == 1", "assert f() != 2"]
    assert parse_tests(["assert True"]) == ["assert True"]
    assert parse_tests("assert f() == 1") == ["assert f() == 1"]
    with pytest.raises(ValueError, match="non-empty list"):
        parse_tests([])
    with pytest.raises(ValueError, match="non-empty list"):
        parse_tests('[1, 2]')


def test_correct_code_scores_one_and_wrong_code_zero():
    tests = json.dumps(["assert double(2) == 4", "assert double(0) == 0", "assert double(-3) == -6"])
    assert code_sandbox_reward("```python\ndef double(x): return 2 * x\n```", tests) == 1.0
    assert code_sandbox_reward("def double(x): return x + 2", tests) == pytest.approx(1 / 3)  # only 2 + 2 == 4
    assert code_sandbox_reward("def double(x): return x + 2", tests, all_or_nothing=True) == 0.0
    assert REWARDS["code_sandbox_all"]("def double(x): return x + 2", tests) == 0.0
    assert code_sandbox_reward("def double(x): return x", tests) == pytest.approx(1 / 3)
    assert code_sandbox_reward("def double(x) return", tests) == 0.0
    results = run_tests("def double(x): return x", ["assert double(2) == 4, 'not doubled'", "assert double(0) == 0"])
    assert [r.status for r in results] == [FAILED, PASSED]
    assert results[0].reason == "assertion failed: not doubled"
    assert run_case("def f(): return 0", "assert f() == 1").reason == "assertion failed: assert f() == 1"
    assert score_results(results) == 0.5 and score_results(results, all_or_nothing=True) == 0.0


def test_exiting_early_or_printing_a_verdict_fails():
    for code in ("import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit",
                 "import os; [os.write(fd, b'passed\\n') for fd in range(3, 10) if fd]"):
        result = run_case(code + "\ndef f(): return 0", "assert f() == 1")
        assert result.status in (ERROR, FAILED), (code, result)


def test_reaching_the_harness_frames_is_refused():
    for code in ("try:\n    raise ValueError\nexcept ValueError as e:\n    e.__traceback__.tb_frame.f_back.f_locals",
                 "import sys; sys._getframe(1)", "import gc; gc.get_objects()",
                 "import sys; sys.settrace(lambda *a: None)", "import signal", "import _signal"):
        result = run_case(code + "\ndef f(): return 0", "assert f() == 1")
        assert result.status == ERROR and "refused" in result.reason, (code, result)


def test_output_comes_back():
    result = run_case("print('to stdout'); import sys; print('to stderr', file=sys.stderr)", "pass")
    assert result.status == PASSED
    assert result.stdout == "to stdout\n" and result.stderr == "to stderr\n"


@pytest.mark.timeout(60)
def test_an_infinite_loop_times_out():
    # The wall-clock limit ends it (the reason names which limit), before the CPU-time one could.
    result = run_case("while True:\n    pass", "pass", SandboxLimits(timeout_s=1.0, cpu_time_s=5))
    assert result.status == TIMEOUT and result.reason == "ran past the wall-clock limit of 1.0 s and was killed", result


def test_a_sleeping_loop_times_out_and_the_cpu_limit_holds():
    sleeping = run_case("import time\nwhile True:\n    time.sleep(1)", "pass", SandboxLimits(timeout_s=1.0))
    assert sleeping.status == TIMEOUT
    result = run_case("while True:\n    pass", "pass", SandboxLimits(timeout_s=20.0, cpu_time_s=1))
    assert result.status == TIMEOUT and "CPU-time" in result.reason, result


def test_a_memory_bomb_hits_the_memory_limit():
    limits = SandboxLimits(timeout_s=10.0, memory_bytes=256 * 2**20)  # pages are touched: slow on a busy machine
    result = run_case("x = []\nwhile True:\n    x.append(bytearray(2**25))", "pass", limits)
    assert result.status == MEMORY, result
    assert run_case("x = bytearray(2**40)", "pass", FAST).status == MEMORY


def test_huge_output_hits_the_output_limit():
    limits = SandboxLimits(timeout_s=5.0, max_output_bytes=1000)
    result = run_case("while True:\n    print('x' * 1000)", "pass", limits)
    assert result.status == OUTPUT_LIMIT and len(result.stdout) <= 1000
    assert run_case("print('x' * 2000)", "pass", limits).status == OUTPUT_LIMIT
    assert run_case("import sys; sys.stderr.write('y' * 600); print('x' * 600)", "pass", limits).status == OUTPUT_LIMIT
    assert run_case("print('x' * 900)", "pass", limits).status == PASSED


def test_a_bounded_fork_loop_is_counted_and_its_children_killed():
    """The containment itself, on a few forks first: each child sleeps; the case ends; none is left."""
    code = ("import os, time\n"
            "for _ in range(5):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n")
    result = run_case(code, "pass", FAST)
    if IS_ROOT:
        assert result.status == PASSED, result
    else:  # not root: the hook refuses new processes
        assert result.status == ERROR and "refused" in result.reason


@root_only
def test_the_process_limit_holds_after_the_privilege_drop():
    """RLIMIT_NPROC counts uid nobody's processes on the machine; the case's pids cgroup (where writable) counts the
    case's own, its outer process and init included: the fork that passes the lower of the two fails."""
    code = ("import os, time\n"
            "n = 0\n"
            "try:\n"
            "    for _ in range(100):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "finally:\n"
            "    print(n)\n")
    num_nobody = sum(p.info["uids"].real == NOBODY for p in psutil.process_iter(["uids"]))
    result = run_case(code, "pass", SandboxLimits(timeout_s=5.0, max_processes=10))
    assert result.status == ERROR and "BlockingIOError" in result.reason
    expected = 10 - 2 if "cgroup" in result.layers else 9 - num_nobody  # the outer process and the init; the init
    assert result.stdout == f"{expected}\n"


@pytest.mark.parametrize("escape", [False, True], ids=["in-session", "setsid"])
def test_a_fork_bomb_is_contained(escape):
    bomb = ("import os\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            f"        {'os.setsid()' if escape else 'pass'}\n"
            "    except OSError:\n"
            "        pass\n")
    if escape and not NAMESPACES:
        pytest.skip("leaving the session is contained by the PID namespace, which needs root and CAP_SYS_ADMIN")
    before = {p.pid for p in _sandbox_processes()}
    result = run_case(bomb, "pass", SandboxLimits(timeout_s=1.5, cpu_time_s=2, max_processes=32))
    assert result.status in ((TIMEOUT,) if IS_ROOT else (ERROR,)), result
    # Every process of the bomb runs as nobody (root) and shares the case's command line: none is left, at once.
    assert {p.pid for p in _sandbox_processes()} <= before


@namespaced
def test_the_case_runs_as_nobody_in_namespaces_of_its_own():
    code = ("import os\n"
            "assert (os.getuid(), os.getgid(), os.getgroups()) == (65534, 65534, [])\n"
            "assert os.getpid() == 1  # the init of its own PID namespace\n")
    result = run_case(code, "pass")
    assert result.status == PASSED, result
    assert {"namespaces", "root", "landlock", "seccomp"} <= set(result.layers)


@namespaced
def test_the_working_directory_is_a_capped_tmpfs_and_every_other_mount_read_only():
    limits = SandboxLimits(max_file_bytes=2**20, max_workdir_bytes=2**21)
    code = ("for i in range(8):\n"
            "    with open(f'part{i}', 'w') as f:\n"
            "        f.write('x' * 2**19)\n")  # each file within RLIMIT_FSIZE, all of them past the tmpfs
    result = run_case(code, "pass", limits)
    assert result.status == ERROR and "No space left on device" in result.reason, result
    assert run_case("open('one', 'w').write('x' * 2**21)", "pass", limits).reason.endswith("File too large")
    with open("/proc/self/mounts") as f:
        assert "baton-sandbox" not in f.read()  # the case's mount stayed in its namespace
    read_only = ("import os\n"
                 "for path in ('/', '/usr/lib', os.path.dirname(os.getcwd())):\n"
                 "    assert os.statvfs(path).f_flag & os.ST_RDONLY, path\n"
                 f"for path in ('/dev/shm', '/home', {os.path.abspath(__file__)!r}):  # not in the minimal root\n"
                 "    assert not os.path.exists(path), path\n"
                 "assert not os.statvfs('.').f_flag & os.ST_RDONLY\n"
                 "open('/dev/null', 'w').write('x')\n")
    assert run_case(read_only, "pass").status == PASSED  # so writes outside are refused by the kernel too


def test_writing_outside_the_sandbox_is_refused(tmp_path):
    targets = [str(tmp_path / "escaped.txt"), f"/tmp/baton-sandbox-escape-{os.getpid()}.txt"]  # /tmp: anyone writes
    for target in targets:
        for code in (f"open({target!r}, 'w').write('x')",
                     f"import os; os.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
                     f"import os; os.symlink({target!r}, 'link'); open('link', 'w').write('x')",
                     f"import os; open('inside.txt', 'w').write('x'); os.rename('inside.txt', {target!r})"):
            result = run_case(code, "pass")
            assert result.status == ERROR and "PermissionError" in result.reason, (code, result)
            assert not os.path.lexists(target), code
    result = run_case("open('inside.txt', 'w').write('ok'); assert open('inside.txt').read() == 'ok'", "pass")
    assert result.status == PASSED, result


def test_removing_files_outside_the_sandbox_is_refused(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("keep")
    keep.chmod(0o666)
    for code in (f"import os; os.remove({str(keep)!r})", f"import os; os.rename({str(keep)!r}, 'moved')",
                 f"open({str(keep)!r}, 'a').write('x')"):
        assert run_case(code, "pass").status == ERROR, code
    assert keep.read_text() == "keep"


def test_reading_files_outside_the_sandbox_fails(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-value")
    secret.chmod(0o600)
    for code in (f"print(open({str(secret)!r}).read())", f"import os; print(os.listdir({str(tmp_path)!r}))",
                 f"import os; print(os.read(os.open({str(secret)!r}, os.O_RDONLY), 100))"):
        result = run_case(code, "pass")
        assert result.status == ERROR, (code, result)
        assert "the-secret-value" not in result.stdout + result.stderr + result.reason
    world_readable = run_case(f"print(open({os.path.abspath(__file__)!r}).read())", "pass")  # the hook's refusal
    assert world_readable.status == ERROR and "refused" in world_readable.reason


def test_sockets_are_refused_and_a_local_server_sees_no_connection():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    connections = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connections.append(server.accept())
            except OSError:  # the timeout: look at stop again
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        for code in (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                     f"import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
                     "import socket; socket.getaddrinfo('localhost', 80)",
                     "import ctypes", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:1')"):
            result = run_case(code, "pass")
            assert result.status == ERROR, (code, result)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert connections == []


def test_killing_the_parent_fails_and_the_parent_survives():
    """Signals to this process are refused by the hook (ERROR); as root they could not reach it anyway (another
    uid, another PID namespace, where getppid() is 0 and kill(0) the case's own group, which it cannot kill)."""
    me = os.getpid()
    for code in (f"import os; os.kill({me}, 9)", "import os; os.kill(-1, 9)",
                 f"import os; os.killpg({os.getpgid(0)}, 9)"):
        result = run_case(code + "\ndef f(): return 1", "assert f() == 1")
        assert result.status == ERROR and "refused" in result.reason, (code, result)
    for code in ("import os; os.kill(os.getppid(), 9)", "import os; os.killpg(os.getpgid(0), 9)",
                 f"import os; os.system('kill -9 {me}')"):
        run_case(code + "\ndef f(): return 1", "assert f() == 1")
    assert psutil.pid_exists(me) and psutil.Process(me).status() != psutil.STATUS_ZOMBIE


def test_many_cases_at_once():
    code = "def f(x): return x + 1"
    tests = [f"assert f({i}) == {i + 1}" for i in range(8)] + ["assert f(0) == 5"]
    results: list = [None] * 4

    def score(slot: int) -> None:
        results[slot] = run_tests(code, tests, max_concurrent=8)

    threads = [threading.Thread(target=score, args=(slot,)) for slot in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for per_call in results:
        assert [r.status for r in per_call] == [PASSED] * 8 + [FAILED]


def test_shipped_task_reference_solutions_score_one_through_score_rows():
    rows, _, _ = read_rows(CODE_ONELINERS)
    assert 30 <= len(rows) <= 100
    for row in rows:
        assert row["reference"] not in row["prompt"]
    responses = [f"```python\n{row['reference']}\n```" for row in rows]
    columns = {key: [row[key] for row in rows] for key in ("prompt", "reference", "data_source")}
    scores = score_rows("code_sandbox", responses, [row["answer"] for row in rows], columns)
    assert scores.scores == [1.0] * len(rows) and scores.num_errors == 0
    some = slice(0, 4)
    wrong = score_rows("code_sandbox_all", ["def nothing(): pass"] * 4, [row["answer"] for row in rows][some],
                       {key: values[some] for key, values in columns.items()})
    assert wrong.scores == [0.0] * 4


def test_scoring_pool_processes_survive_hostile_rows():
    pool = ScoringPool("code_sandbox", num_processes=2, timeout_s_per_row=30)
    try:
        tests = json.dumps(["assert f() == 1"])
        responses = ["def f(): return 1", "import os; os.kill(os.getppid(), 9)", "import os; os._exit(1)",
                     "x = bytearray(2**40)", "def f(): return 1"]
        scores = score_rows("code_sandbox", responses, [tests] * len(responses), {}, pool=pool)
        assert scores.scores == [1.0, 0.0, 0.0, 0.0, 1.0] and scores.num_errors == 0
        assert all(child.process.poll() is None for child in pool._children)
    finally:
        pool.close()
