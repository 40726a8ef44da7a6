"""The code verifier's sandbox against hostile-looking but ordinary failure modes.

Every run uses small limits (about 2 s) so the file stays fast.
"""

import os
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox relies on Linux rlimits and /proc", allow_module_level=True)

from alignpipe.rewards import score_completion, score_completions  # noqa: E402
from alignpipe.rewards.sandbox import (  # noqa: E402
    SandboxLimits,
    extract_code,
    filesystem_isolation_mode,
    network_isolation_mode,
    run_code,
)

# Runs that must be stopped by the wall clock get ~2 s. Runs expected to end by themselves
# (pass, fail, fs/network/memory verdicts) get a generous wall clock so a loaded CI machine
# cannot turn them into timeouts; they take ~0.1 s either way.
HOSTILE = SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256, nproc=16)
FAST = SandboxLimits(timeout_s=30.0, cpu_s=2, memory_mb=256, nproc=16)
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def code_row(tests=ADD_TESTS, **limits):
    return {
        "prompt": "write add",
        "answer": "",
        "verifier": "code",
        "tests": tests,
        "sandbox": {"timeout_s": 30.0, "cpu_s": 2, "memory_mb": 256, "nproc": 16, **limits},
    }


# Under pytest-xdist the other worker may be running sandboxes of its own (the code verifier in
# a stage or in test_rewards): this process's tokens start with its pid, and only those count.
OWN_PREFIX = f"{os.getpid():08x}"
OWN_TOKENS = f"ALIGNPIPE_SANDBOX=ALIGNPIPE_SANDBOX_{OWN_PREFIX}".encode()


@pytest.fixture(autouse=True)
def own_tokens(monkeypatch) -> None:
    """Every sandbox token this test makes starts with this process's pid (the rest is random)."""
    import types
    import uuid

    from alignpipe.rewards import sandbox

    tagged = types.SimpleNamespace(uuid4=lambda: uuid.UUID(OWN_PREFIX + uuid.uuid4().hex[8:]))
    monkeypatch.setattr(sandbox, "uuid", tagged)


def sandbox_procs() -> list[int]:
    """Processes (other than us) that carry a sandbox token this process made."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if OWN_TOKENS in f.read():
                    found.append(int(d))
        except OSError:
            pass
    return found


def _uid_of(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


@pytest.fixture
def outside_dir():
    # World-writable, so only the sandbox (not file permissions) can stop the write.
    d = tempfile.mkdtemp(prefix="alignpipe-outside-")
    os.chmod(d, 0o777)
    yield d
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))
    os.rmdir(d)


def test_correct_solution_passes():
    completion = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert score_completion(code_row(), completion) == 1.0
    r = run_code("def add(a, b):\n    return a + b\n", ADD_TESTS, FAST)
    assert r.passed and r.reason == "ok" and r.score == 1.0 and r.returncode == 0


def test_wrong_solution_fails():
    assert score_completion(code_row(), "def add(a, b):\n    return a - b\n") == 0.0
    r = run_code("def add(a, b):\n    return a - b\n", ADD_TESTS, FAST)
    assert not r.passed and r.reason == "failed" and "AssertionError" in r.detail


def test_tests_as_list_and_syntax_error():
    row = code_row(tests=["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    assert score_completion(row, "def add(a, b): return a + b") == 1.0
    r = run_code("def add(a, b) return", ADD_TESTS, FAST)
    assert r.reason == "error" and "SyntaxError" in r.detail


def test_infinite_loop_is_killed_by_timeout():
    t0 = time.monotonic()
    r = run_code("while True:\n    pass\n", "assert True", HOSTILE)
    assert time.monotonic() - t0 < 15
    assert not r.passed and r.score == 0.0 and r.reason == "timeout"
    assert score_completion(code_row(timeout_s=2.0), "while True:\n    pass\n") == 0.0
    assert sandbox_procs() == []


def test_sleeping_child_escaping_with_setsid_is_cleaned_up():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\ntime.sleep(300)\n"
    r = run_code(code, "assert True", HOSTILE)
    assert r.reason == "timeout"
    assert sandbox_procs() == []


@pytest.mark.parametrize(
    "bomb",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    ],
    ids=["plain", "swallows-errors"],
)
def test_fork_bomb_is_contained(bomb):
    t0 = time.monotonic()
    r = run_code(bomb, "assert True", HOSTILE)
    assert time.monotonic() - t0 < 30
    assert not r.passed and r.score == 0.0
    assert r.reason in ("error", "timeout", "killed"), r
    # the machine is fine afterwards: nothing left behind, and we can still start processes
    assert sandbox_procs() == []
    if r.run_as.startswith("uid "):  # dedicated uid: not even a zombie is left
        uid = int(r.run_as.split()[1])
        assert [d for d in os.listdir("/proc") if d.isdigit() and _uid_of(d) == uid] == []
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout == b"1\n"
    assert run_code("def add(a, b): return a + b", ADD_TESTS, FAST).passed


def test_memory_hog_is_stopped():
    r = run_code("x = bytearray(4 * 1024 ** 3)\n", "assert True", FAST)
    assert not r.passed and r.reason == "memory", r
    r = run_code("chunks = []\nwhile True:\n    chunks.append(b'x' * 10 ** 7)\n", "assert True", FAST)
    assert not r.passed and r.reason in ("memory", "killed"), r
    assert score_completion(code_row(), "x = bytearray(4 * 1024 ** 3)") == 0.0


def test_write_outside_workdir_is_blocked(outside_dir):
    target = os.path.join(outside_dir, "pwned.txt")
    code = f"with open({target!r}, 'w') as f:\n    f.write('x')\n"
    r = run_code(code, "assert True", FAST)
    assert not os.path.exists(target)
    assert not r.passed and r.reason == "fs" and "pwned.txt" in r.detail
    # even if the code swallows the error, the attempt is reported and scores 0
    sneaky = f"try:\n    open({target!r}, 'w').write('x')\nexcept Exception:\n    pass\ndef add(a, b): return a + b\n"
    r = run_code(sneaky, ADD_TESTS, FAST)
    assert not os.path.exists(target)
    assert r.reason == "fs" and r.score == 0.0
    # os-level writes and removals too
    r = run_code(f"import os\nos.open({target!r}, os.O_WRONLY | os.O_CREAT)\n", "assert True", FAST)
    assert r.reason == "fs" and not os.path.exists(target)
    open(target, "w").close()
    os.chmod(target, 0o666)
    r = run_code(f"import os\nos.remove({target!r})\n", "assert True", FAST)
    assert r.reason == "fs" and os.path.exists(target)
    os.remove(target)


# Libraries that open paths themselves (C code the audit hook never sees, or a process started
# behind it) and Python-level tricks around the hook. {T}: a file in the outside dir, {D}: the dir.
PATH_OPENERS = {
    "sqlite3": "import sqlite3\nc = sqlite3.connect({T!r})\nc.execute('create table t(a)')\nc.commit()\n",
    "sqlite3-attach": (
        "import sqlite3\nc = sqlite3.connect(':memory:')\n"
        "c.execute(\"ATTACH DATABASE '{T}' AS x\")\nc.execute('create table x.t(a)')\nc.commit()\n"
    ),
    "sqlite3-uri": "import sqlite3\nc = sqlite3.connect('file:{T}?mode=rwc', uri=True)\nc.execute('create table t(a)')\n",
    "dbm": "import dbm\nd = dbm.open({T!r}, 'c')\nd[b'k'] = b'v'\nd.close()\n",
    "shelve": "import shelve\ns = shelve.open({T!r})\ns['k'] = 1\ns.close()\n",
    "zipfile": "import zipfile\nwith zipfile.ZipFile({T!r}, 'w') as z:\n    z.writestr('a', 'b')\n",
    "tarfile": "import tarfile\ntarfile.open({T!r}, 'w').close()\n",
    "tempfile-dir": "import tempfile\ntempfile.mkstemp(dir={D!r})\n",
    "logging-filehandler": "import logging\nlogging.FileHandler({T!r}).close()\n",
    "os-open-dir-fd": "import os\nfd = os.open({D!r}, os.O_RDONLY)\nos.close(os.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n",
    "io-fileio": "import _io\n_io.FileIO({T!r}, 'w').close()\n",
    "os-replace": "import os\nopen('a', 'w').close()\nos.replace('a', {T!r})\n",
    "symlink-dir": "import os\nos.symlink({D!r}, 'link')\nopen('link/x', 'w').close()\n",
    "readline-history": "import readline\nreadline.write_history_file({T!r})\n",
    "spawnv-passfds": (
        "import os\nfrom multiprocessing.util import spawnv_passfds\n"
        "os.waitpid(spawnv_passfds(b'/bin/sh', [b'/bin/sh', b'-c', b'echo x > {T}'], []), 0)\n"
    ),
}


@pytest.mark.parametrize("filesystem", ["auto", "audit"])
@pytest.mark.parametrize("opener", sorted(PATH_OPENERS))
def test_libraries_that_open_paths_cannot_write_outside(outside_dir, opener, filesystem):
    code = PATH_OPENERS[opener].format(T=os.path.join(outside_dir, "pwned.db"), D=outside_dir)
    limits = SandboxLimits(timeout_s=30.0, cpu_s=2, memory_mb=256, nproc=16, filesystem=filesystem)
    r = run_code(code, "assert True", limits)
    assert os.listdir(outside_dir) == [], (r.filesystem_isolation, r.detail, r.stderr[-500:])
    assert not r.passed and r.score == 0.0, r
    expected = "audit-hook" if filesystem == "audit" else filesystem_isolation_mode()
    assert r.filesystem_isolation == expected


def test_kernel_confines_writes_when_landlock_is_available(outside_dir):
    if not filesystem_isolation_mode().startswith("landlock"):
        pytest.skip("no Landlock in this kernel; the audit-hook fallback is tested above")
    # sqlite3 opens the file in C: only the kernel sees it. Swallowing the error does not write.
    target = os.path.join(outside_dir, "pwned.db")
    code = f"import sqlite3\ntry:\n    sqlite3.connect(':memory:').execute(\"ATTACH DATABASE '{target}' AS x\")\nexcept sqlite3.Error as e:\n    print('refused', e)\n"
    r = run_code(code, "assert True", FAST)
    assert os.listdir(outside_dir) == [] and "refused unable to open database" in r.stdout, r
    # sqlite3 in the work dir and in memory still works.
    ok = "import sqlite3\nc = sqlite3.connect('local.db')\nc.execute('create table t(a)')\nc.commit()\n"
    assert run_code(
        ok, "assert sqlite3.connect(':memory:').execute('select 1').fetchone() == (1,)", FAST
    ).passed


def test_a_row_cannot_turn_isolation_off():
    row = code_row(filesystem="audit", network="audit", drop_privileges=False, timeout_s=3.0)
    limits = SandboxLimits.from_row(row)
    assert (limits.filesystem, limits.network, limits.drop_privileges) == ("auto", "auto", True)
    assert limits.timeout_s == 3.0  # resource limits still come from the row


def test_writes_inside_workdir_are_fine_and_workdir_is_deleted():
    code = "import os\nopen('scratch.txt', 'w').write('hi')\nos.mkdir('sub')\nopen('sub/a', 'w').write('1')\nprint(os.getcwd())\n"
    r = run_code(code, "assert open('scratch.txt').read() == 'hi'", FAST)
    assert r.passed, r
    workdir = r.stdout.strip()
    assert workdir and not os.path.exists(workdir)


def _listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.5)
    return srv


def _assert_no_connection(srv):
    with pytest.raises(TimeoutError):
        conn, _ = srv.accept()
        conn.close()


@pytest.mark.parametrize("mode", ["auto", "audit"])
def test_network_is_blocked(mode):
    srv = _listener()
    port = srv.getsockname()[1]
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')\n"
        limits = SandboxLimits(timeout_s=30.0, cpu_s=2, memory_mb=256, nproc=16, network=mode)
        r = run_code(code, "assert True", limits)
        _assert_no_connection(srv)
        assert not r.passed and r.score == 0.0 and r.reason == "network", r
        assert r.network_isolation == ("audit-hook" if mode == "audit" else network_isolation_mode())
        # swallowing the error does not help
        sneaky = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\nexcept OSError:\n    pass\ndef add(a, b): return a + b\n"
        r = run_code(sneaky, ADD_TESTS, limits)
        _assert_no_connection(srv)
        assert r.reason == "network" and r.score == 0.0
    finally:
        srv.close()


def test_network_namespace_alone_blocks_when_available():
    if network_isolation_mode() != "netns":
        pytest.skip("no network namespace here; the audit-hook fallback is tested above")
    srv = _listener()
    port = srv.getsockname()[1]
    try:
        # ctypes-free raw connect that the hook sees but (in netns mode) does not stop:
        code = (
            "import socket, errno\ns = socket.socket()\n"
            f"err = s.connect_ex(('127.0.0.1', {port}))\nprint('ERR', err)\n"
        )
        r = run_code(code, "assert True", FAST)
        _assert_no_connection(srv)
        assert r.network_isolation == "netns"
        assert "ERR 0" not in r.stdout  # the kernel refused it inside the empty namespace
        assert r.reason == "network"
    finally:
        srv.close()


def test_subprocess_and_ctypes_are_forbidden():
    r = run_code("import subprocess\nsubprocess.run(['true'])\n", "assert True", FAST)
    assert r.reason == "forbidden" and "subprocess.Popen" in r.detail
    r = run_code("import os\nos.system('true')\n", "assert True", FAST)
    assert r.reason == "forbidden"


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("ALIGNPIPE_TEST_SECRET", "hunter2")
    code = "import os\nassert 'ALIGNPIPE_TEST_SECRET' not in os.environ\nassert os.environ['HOME'] == os.getcwd()\n"
    r = run_code(code, "assert True", FAST)
    assert r.passed, r


def test_output_is_capped():
    limits = SandboxLimits(timeout_s=30.0, cpu_s=2, memory_mb=256, output_bytes=1000)
    r = run_code(
        "import sys\nprint('x' * 10 ** 6)\nprint('y' * 10 ** 6, file=sys.stderr)\n", "assert True", limits
    )
    assert r.passed and len(r.stdout) == 1000 and len(r.stderr) == 1000


def test_exit_tricks_do_not_pass():
    # a solution that exits 0 before the tests run must not count as passing
    r = run_code("import os\nos._exit(0)\n", "assert False", FAST)
    assert not r.passed and r.reason == "error"
    r = run_code("import sys\nsys.exit(0)\n", "assert False", FAST)
    assert not r.passed


def test_batched_scoring_mixes_outcomes():
    rows = [code_row(), code_row(), code_row(timeout_s=2.0), code_row()]
    comps = [
        "def add(a, b): return a + b",
        "def add(a, b): return 0",
        "while True: pass",
        "def add(a, b): return b + a",
    ]
    t0 = time.monotonic()
    assert score_completions(rows, comps) == [1.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - t0 < 30


def test_missing_tests_is_a_clear_error():
    with pytest.raises(ValueError, match="tests"):
        score_completion({"answer": "", "verifier": "code"}, "x = 1")


def test_extract_code():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("d = 4") == "d = 4"


def test_runs_unprivileged_when_root():
    r = run_code("import os\nprint(os.getuid())\n", "assert True", FAST)
    assert r.passed
    if os.geteuid() == 0:
        assert int(r.stdout.strip()) != 0 and r.run_as.startswith("uid ")
    assert stat.S_ISDIR(os.stat(tempfile.gettempdir()).st_mode)


def test_without_pid_namespace_cleanup_still_works(monkeypatch):
    # Where no PID namespace can be made, process-group + token-scan cleanup must still
    # leave nothing running.
    from alignpipe.rewards import sandbox

    monkeypatch.setitem(sandbox._probe_cache, "pidns", False)
    assert not sandbox.pid_namespace_available()
    bomb = "import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(300)\ntime.sleep(300)\n"
    r = run_code(bomb, "assert True", HOSTILE)
    assert r.reason == "timeout" and r.score == 0.0
    assert sandbox_procs() == []
    assert run_code("def add(a, b): return a + b", ADD_TESTS, FAST).passed


@pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop only applies when running as root")
def test_fails_closed_when_privileges_cannot_be_dropped(monkeypatch):
    from alignpipe.rewards import sandbox

    monkeypatch.setitem(sandbox._probe_cache, "python:True", None)  # no interpreter for other uids
    r = run_code("print('ran')", "assert True", FAST)
    assert not r.passed and r.reason == "error" and "drop privileges" in r.detail
    assert "ran" not in r.stdout
