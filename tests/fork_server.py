"""A process that has done its slow imports once and forks a child per request: the tests'
stage runs (tests/stage_runner.py) and NeMo-RL probes (tests/nemo_rl_probe.py) start from one
instead of from a new interpreter that imports torch, transformers or NeMo-RL all over again.

The client (``Server``) starts ``command`` with ``env`` and sends requests as JSON lines on its
stdin: an ``argv``, a directory, an environment and the files stdout and stderr go to. The
server forks; the child takes the directory, environment and files, leads a process group of
its own (as ``start_new_session`` gives a new process), calls the ``become`` function the
server was started with and exits with its code. The answers come back on the server's stdout:
``{"pid": ...}`` when the child is forked, ``{"returncode": ...}`` when it exits.

A server started with ``serve(listen=PATH)`` also takes runs from clients of a Unix socket there
(tests/stage_shim.py: the stage processes a ``dvc`` command starts), any number at once: each
client sends the request with its own stdin, stdout and stderr attached, and gets the same
answers back on its connection, or ``{"fresh": [...]}`` when its environment ``differs`` from
the server's (it then starts a new process itself).

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
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

# Set to 1: every run gets a new interpreter, no fork (how to rule the servers out).
FRESH = "ALIGNPIPE_TEST_FRESH_PROCESSES"
# Read at run time, never by a library at import: may differ per run. The tests' own, and
# what a shell (`_`, SHLVL; SHELL, which DVC runs a stage's cmd with and CI may not set),
# DVC (DVC_ROOT, DVC_STAGE, DVC_EXP_*: read by DVCLive's Live()) and git's identity (GIT_*)
# add to a stage's environment.
RUNTIME_ONLY = frozenset(
    {"PATH", "PWD", "OLDPWD", "PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED", "_", "SHLVL", "SHELL"}
)
RUNTIME_ONLY_PREFIXES = ("ALIGNPIPE_", "DVC_", "GIT_")
# What the server's log (its stderr) says of each run a socket client asked for.
CLIENT_RUN = "client run"
CLIENT_FORKED, CLIENT_REFUSED = f"{CLIENT_RUN} forked:", f"{CLIENT_RUN} refused:"


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
        self.listen: Path | None = None  # the Unix socket, where the command makes it listen on one
        self.served = 0  # runs forked so far for this client (socket clients' runs: the log)
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
    """sys.stdout and sys.stderr as a new interpreter would make them on these files: stdout
    block-buffered (line-buffered on a terminal), stderr line-buffered, or both unbuffered under PYTHONUNBUFFERED (which
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
            line_buffering=(name == "stderr" or raw.isatty()) and not unbuffered,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _child(request: dict, become: Callable[[list[str]], int | None], stdio: tuple[int, int, int]) -> None:
    """In the forked child: take the request's files (``stdio``: stdin, stdout, stderr),
    directory and environment, run ``become`` on its argv, then exit with its code as the
    interpreter would."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, as a timeout kills it with whatever it started
        for fd, target in zip(stdio, (0, 1, 2), strict=True):
            os.dup2(fd, target)
        for fd in set(stdio) - {0, 1, 2}:
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


def _opened(request: dict) -> tuple[int, int, int]:
    """The files a stdin request names: stdin from /dev/null, stdout and stderr appended to."""
    stdout = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
    stderr = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND) if request["stderr"] else stdout
    return os.open(os.devnull, os.O_RDONLY), stdout, stderr


class _Loop:
    """The server's state: the stdin channel (one run at a time, answered on ``answers``), the
    socket's clients (each its own run) and the children, watched through pidfds."""

    def __init__(
        self, become: Callable[[list[str]], int | None], env: dict[str, str] | None, listen: str | None
    ):
        self.become, self.env = become, env
        self.answers = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # nothing the server imported may write into the answers
        self.listener = None
        if listen:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.listener.bind(listen)
            self.listener.listen(16)
        self.stdin_open, self.pending = True, b""
        self.clients: dict[socket.socket, int | None] = {}  # a connection -> the pid it started
        self.children: dict[int, tuple[int, socket.socket | None]] = {}  # pidfd -> (pid, client)

    def fork(self, request: dict, stdio: tuple[int, int, int], client: socket.socket | None) -> int:
        assert threading.active_count() == 1, "forking with threads running"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.answers.close()
            for sock in [self.listener, *self.clients]:
                if sock is not None:
                    sock.close()
            for pidfd in self.children:
                os.close(pidfd)
            _child(request, self.become, stdio)
        for fd in set(stdio):
            os.close(fd)
        self.children[os.pidfd_open(pid)] = (pid, client)
        return pid

    def from_stdin(self) -> None:
        data = os.read(0, 1 << 16)
        if not data:  # the client closed the server: stop what is still running
            self.stdin_open = False
            for pid, _ in self.children.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)
            return
        self.pending += data
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            request = json.loads(line)
            self.answer({"pid": self.fork(request, _opened(request), None)})

    def from_client(self, client: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(client, 1 << 20, 3)
        except OSError:  # reset by a client killed mid-send: as its death
            data, fds = b"", []
        if not data:  # the client died (the `alignpipe` dvc ran): its run gets what a parent's
            pid = self.clients.pop(client)  # death gives one (alignpipe.launch.interrupt)
            client.close()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)
            return
        message = json.loads(data)
        if "signal" in message:  # forwarded by the client, to the run and what it started
            if (pid := self.clients[client]) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, message["signal"])
            return
        why = differs(self.env, message["env"]) if self.env is not None else []
        if why:
            for fd in fds:
                os.close(fd)
            said = f"{' '.join(message['argv'])} in {message['cwd']}: {', '.join(why)} differ"
            print(f"{CLIENT_REFUSED} {said}", file=sys.stderr)
            client.send(json.dumps({"fresh": why}).encode())
            return
        self.clients[client] = self.fork(message, tuple(fds), client)
        said = f"{' '.join(message['argv'])} in {message['cwd']} (pid {self.clients[client]})"
        print(f"{CLIENT_FORKED} {said}", file=sys.stderr)
        client.send(json.dumps({"pid": self.clients[client]}).encode())

    def reap(self, pidfd: int) -> None:
        pid, client = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        answer = {"returncode": os.waitstatus_to_exitcode(status)}
        if client is None:
            self.answer(answer)
        elif client in self.clients:
            self.clients[client] = None  # nothing left to signal
            with contextlib.suppress(OSError):
                client.send(json.dumps(answer).encode())

    def answer(self, answer: dict) -> None:
        self.answers.write(json.dumps(answer) + "\n")
        self.answers.flush()

    def run(self) -> None:
        self.answer({"ready": True})
        while self.stdin_open or self.children:
            watched = [*([0] if self.stdin_open else []), *self.children, *self.clients]
            watched += [self.listener] if self.listener is not None and self.stdin_open else []
            for ready in select.select(watched, [], [])[0]:
                if ready == 0:
                    self.from_stdin()
                elif ready is self.listener:
                    self.clients[self.listener.accept()[0]] = None
                elif isinstance(ready, socket.socket):
                    if ready in self.clients:
                        self.from_client(ready)
                elif ready in self.children:
                    self.reap(ready)


def serve(
    become: Callable[[list[str]], int | None], *, listen: str | None = None, env: dict[str, str] | None = None
) -> None:
    """The server's loop, once its imports are done: fork a child per request on stdin (one at
    a time) and, with ``listen``, per request of a client of the Unix socket there (any number at
    once; tests/stage_shim.py). A client's run whose environment ``differs`` from ``env`` (the
    server's own before its imports) is refused: the client starts a new process instead. The
    server ends when its stdin closes, after the runs still going have stopped."""
    _Loop(become, env, listen).run()
