"""tests/fork_server.py, on a server that imports nothing: a forked run takes the request's
argv, directory, environment and files and exits with its own code; a run past its timeout is
killed with its process group, and the server goes on serving."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fork_server

REPO = Path(__file__).resolve().parents[1]

# The server's `become`: print what the child sees, then sleep or exit with the asked code.
SERVER = """
import os, sys, time
from tests import fork_server

def become(argv):
    print(" ".join(argv), os.getcwd(), os.environ.get("FORK_TEST"), os.getpgid(0) == os.getpid(), flush=True)
    print("to stderr", file=sys.stderr)
    if argv[0] == "sleep":
        time.sleep(600)
    return int(argv[1])

fork_server.serve(become)
"""


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = fork_server.Server([sys.executable, "-c", SERVER], env=env, cwd=REPO, name="test fork server")
    yield server
    server.close()


def _run(server, argv, cwd, env, timeout=60):
    start = functools.partial(server.start, argv, cwd, env)
    return fork_server.run(lambda stdout, stderr: start(stdout, stderr), argv, timeout)


def test_a_forked_run_takes_the_requests_argv_directory_environment_and_code(server, tmp_path) -> None:
    env = {**server.env, "FORK_TEST": "seen"}
    done = _run(server, ["exit", "3"], tmp_path, env)
    assert done.returncode == 3
    assert done.stdout == f"exit 3 {tmp_path} seen True\n"  # a process group of its own
    assert done.stderr == "to stderr\n"
    assert _run(server, ["exit", "0"], tmp_path, server.env).stdout.endswith(" None True\n")
    assert server.served == 2 and server.alive()


def test_a_run_past_its_timeout_is_killed_and_the_server_serves_on(server, tmp_path) -> None:
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        _run(server, ["sleep", "0"], tmp_path, server.env, timeout=2)
    assert raised.value.output.startswith("sleep 0 ")  # what it wrote before it was killed
    assert _run(server, ["exit", "5"], tmp_path, server.env).returncode == 5


def test_a_variable_libraries_read_at_import_makes_another_environment() -> None:
    env = {"HOME": "/root", "PATH": "/bin", "ALIGNPIPE_ROOT": "/a"}
    assert fork_server.differs(env, {**env, "HOME": "/elsewhere"}) == ["HOME"]
    assert fork_server.differs(env, {**env, "PATH": "/usr/bin", "ALIGNPIPE_ROOT": "/b"}) == []
