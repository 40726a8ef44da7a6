"""A process that has done its slow imports once and forks a child per request: the tests'
stage runs (tests/stage_runner.py) and NeMo-RL probes (tests/nemo_rl_probe.py) start from one
instead of from a new interpreter that imports torch, transformers or NeMo-RL all over again.

The client (``Server``) starts ``command`` with ``env`` and sends requests as JSON lines on its
stdin: an ``argv``, a directory, an environment and the files stdout and stderr go to. The
server forks; the child takes the directory, environment and files, leads a process group of
its own (as ``start_new_session`` gives a new process), calls the ``become`` function the
server was started with and exits with its code. The answers come back on the server's stdout:
``{"pid": ...}`` when the child is forked, ``{"returncode": ...}`` when it exits.

Standard library only: the server side also runs in NeMo-RL's runtime interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

# Set to 1: every run gets a new interpreter, no fork (how to rule the servers out).
FRESH = "ALIGNPIPE_TEST_FRESH_PROCESSES"
# Read by the tests' own code at run time, never by a library at import: may differ per run.
RUNTIME_ONLY = frozenset({"PATH", "PWD", "OLDPWD", "PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED"})
RUNTIME_ONLY_PREFIXES = ("ALIGNPIPE_",)


def differs(server_env: dict[str, str], env: dict[str, str]) -> list[str]:
    """The variables, but for ``RUNTIME_ONLY`` ones, in which ``env`` is not the server's: a
    library may have read them at import, so a run with other values is no fork of it."""
    return [
        k
        for k in sorted(server_env.keys() | env.keys())
        if server_env.get(k) != env.get(k)
        and k not in RUNTIME_ONLY
        and not k.startswith(RUNTIME_ONLY_PREFIXES)
    ]


def run(
    start: Callable[..., Forked | subprocess.Popen], argv: list[str], timeout: float
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` of the run that
    ``start(stdout=..., stderr=...)`` starts in a process group of its own (forked or not)."""
    with tempfile.TemporaryDirectory(prefix="alignpipe-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with out.open("w") as stdout, err.open("w") as stderr:
            proc = start(stdout=stdout, stderr=stderr)
        try:
            code = proc.wait(timeout)
        except BaseException as e:  # a timeout, or Ctrl-C on the suite: the run is in its own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the run and whatever it started
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            raise
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


class Server:
    """The client's handle on one preloaded server: one request at a time."""

    def __init__(self, command: list[str], *, env: dict[str, str], cwd: Path, name: str) -> None:
        self.env, self.name = dict(env), name
        self.served = 0  # runs forked so far
        self.in_flight: Forked | None = None
        fd, log = tempfile.mkstemp(prefix=f"alignpipe-{name}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        with self.log.open("w") as log_file:  # the server's own stderr; closed here once it holds it
            self.proc = subprocess.Popen(
                command,
                cwd=cwd,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,  # unbuffered answers: select() sees every line that has arrived
                stderr=log_file,
            )
        atexit.register(self.close)
        ready = self._answer(timeout=300)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the {name} did not start:\n{self.log.read_text()[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _answer(self, timeout: float | None = None) -> dict:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(self.name, timeout)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} exited:\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], stdout, stderr) -> Forked:
        """Fork ``argv`` (what ``become`` reads as ``sys.argv``) with ``stdout``/``stderr`` open
        files (``stderr=subprocess.STDOUT`` joins them)."""
        assert self.in_flight is None or self.in_flight.poll() is not None, "one run at a time"
        request = {
            "argv": argv,
            "cwd": str(cwd),
            "env": env,
            "stdout": os.path.realpath(f"/proc/self/fd/{stdout.fileno()}"),
        }
        request["stderr"] = (
            None if stderr == subprocess.STDOUT else os.path.realpath(f"/proc/self/fd/{stderr.fileno()}")
        )
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        self.in_flight = Forked(self, self._answer()["pid"])
        self.served += 1
        return self.in_flight


class Forked:
    """A run forked by a server, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, server: Server, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.server.proc.stdout], [], [], 0)[0]:
            self.returncode = self.server._answer()["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server._answer(timeout)["returncode"]
        return self.returncode


# --- the server side -------------------------------------------------------------------------


_SERVER_STDIO: list = []  # the server's own sys.stdout/stderr, kept open (they own fds 1 and 2)


def _reopen_stdio(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr as a new interpreter would make them on these files: block-
    buffered stdout and line-buffered stderr, or both unbuffered under PYTHONUNBUFFERED (which
    Python reads at start-up, so the server's own streams followed the server's environment)."""
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        old.flush()
        _SERVER_STDIO.append(old)
        raw = open(old.fileno(), "wb", buffering=0, closefd=False)  # noqa: SIM115
        binary = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            binary,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=name == "stderr" and not unbuffered,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _child(request: dict, become: Callable[[list[str]], int | None]) -> None:
    """In the forked child: take the request's files, directory and environment, run ``become``
    on its argv, then exit with its code as the interpreter would."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, as a timeout kills it with whatever it started
        stdin = os.open(os.devnull, os.O_RDONLY)
        stdout = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
        stderr = (
            os.open(request["stderr"], os.O_WRONLY | os.O_APPEND) if request["stderr"] else os.dup(stdout)
        )
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reopen_stdio(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
        code = become(request["argv"]) or 0
    except SystemExit as e:  # as the interpreter exits: None is 0, a message is printed and 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(become: Callable[[list[str]], int | None]) -> None:
    """The server's loop, once its imports are done: fork a child per request on stdin."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing the server imported may write into the answers
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        assert threading.active_count() == 1, "forking with threads running"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(request, become)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()
