"""``alignpipe run`` for the tests, forked from an interpreter that has already imported torch,
transformers, TRL and datasets, instead of exec'd afresh.

Every stage process spends about 7 s of CPU importing those before its first step, and the
suite runs more than a hundred (benchmarks/RESULTS.md, "stop 49"). ``run`` hands a stage run to
a server process (per test worker, started on first use) that has done those imports with
the environment a stage process has when it does them (``set_offline_env``, ``set_cpu_env``,
the console's ``QUIET_ENV``, ``skip_unused_libraries``): one server for the stages that keep
scikit-learn and SciPy out, one with them and lm-eval for those that do not
(``USE_SCIENTIFIC_STACK``, benchmark). The server forks; the child takes the
run's directory, environment, argv and output files and calls ``alignpipe.cli.main``: the same
code from the command line on, in a process of its own.

A run gets a new interpreter instead (``subprocess.Popen``) when the fork could behave
differently from one:

- its environment differs from the server's in a variable other than ``RUNTIME_ONLY`` (the
  libraries read ``HF_*``, ``TRANSFORMERS_*``, ``OMP_*``, ``HOME`` ... once, at import);
- it is not ``alignpipe run`` (``plan`` and the others import no torch: nothing to save);
- ``ALIGNPIPE_TEST_FRESH_PROCESSES=1`` is set (every run fresh: how to rule the runner out).

``start`` is the same for a run the test watches and kills (tests/test_resume.py): a forked
run leads a process group of its own, as ``start_new_session`` gives a new one. Stage processes
that ``dvc repro`` starts (the tiny pipeline, the DVC and interrupt tests) are new interpreters,
and tests/test_stage_runner.py checks that a forked run publishes the same bytes as a new one.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from alignpipe.engines.local.stages import USE_SCIENTIFIC_STACK

FRESH = "ALIGNPIPE_TEST_FRESH_PROCESSES"
# Read by the stage's own code at run time, never by a library at import: may differ per run.
RUNTIME_ONLY = frozenset({"PATH", "PWD", "OLDPWD", "PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED"})
RUNTIME_ONLY_PREFIXES = ("ALIGNPIPE_",)

_servers: dict[str, _Server] = {}  # by flavour: "lean", "scientific"
_lock = threading.Lock()


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``,
    forked from the preloaded server where that is the same thing (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="alignpipe-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with out.open("w") as stdout, err.open("w") as stderr:
            proc = start(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
        try:
            code = proc.wait(timeout)
        except BaseException as e:  # a timeout, or Ctrl-C on the suite: the run is in its own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the stage and whatever it started
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            raise
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


def start(argv: list[str], *, cwd: Path, env: dict[str, str], stdout, stderr) -> Forked | subprocess.Popen:
    """``subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
    start_new_session=True)``, forked where that is the same thing: either way the run leads a
    process group of its own (``os.killpg(proc.pid, ...)``), with ``poll`` and ``wait``.
    ``stdout``/``stderr`` are open files (``stderr=subprocess.STDOUT`` joins them)."""
    if _forkable(argv, env):
        flavour = "scientific" if _stage(argv) in USE_SCIENTIFIC_STACK else "lean"
        with _lock:
            server = _servers.get(flavour)
            # The server imports in this worker's environment; a run that changes an import-time
            # variable of it (a test's HF_HOME, say) is no fork of that server.
            if (server is None or not server.alive()) and not _differs(dict(os.environ), env):
                server = _servers[flavour] = _Server(flavour, dict(os.environ))
            if server is not None and server.alive() and not _differs(server.env, env):
                return server.start(argv, cwd, env, stdout, stderr)
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)


def served() -> int:
    """How many runs this worker has forked so far."""
    return sum(server.served for server in _servers.values())


def _stage(argv: list[str]) -> str:
    return argv[2].split("@")[0]


def _forkable(argv: list[str], env: dict[str, str]) -> bool:
    return env.get(FRESH) != "1" and len(argv) >= 3 and Path(argv[0]).name == "alignpipe" and argv[1] == "run"


def _differs(server_env: dict[str, str], env: dict[str, str]) -> list[str]:
    return [
        k
        for k in sorted(server_env.keys() | env.keys())
        if server_env.get(k) != env.get(k)
        and k not in RUNTIME_ONLY
        and not k.startswith(RUNTIME_ONLY_PREFIXES)
    ]


class _Server:
    """The preloaded interpreter: requests as JSON lines on its stdin, answers on its stdout."""

    def __init__(self, flavour: str, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.served = 0  # runs forked so far
        self.in_flight: Forked | None = None
        fd, log = tempfile.mkstemp(prefix="alignpipe-stage-runner-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        with self.log.open("w") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.stage_runner", flavour],
                cwd=Path(__file__).resolve().parents[1],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,  # unbuffered answers: select() sees every line that has arrived
                stderr=log_file,
            )
        atexit.register(self.close)
        ready = self._answer(timeout=300)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the stage runner did not start:\n{self.log.read_text()[-4000:]}")

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
            raise subprocess.TimeoutExpired("stage runner", timeout)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the stage runner exited:\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], stdout, stderr) -> Forked:
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

    def __init__(self, server: _Server, pid: int) -> None:
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


def _preload(flavour: str) -> None:
    """What a stage process has imported before its first step, in the environment it imports
    them in (alignpipe.stage.run_stage)."""
    from alignpipe.console import QUIET_ENV
    from alignpipe.context import set_cpu_env, set_offline_env
    from alignpipe.engines.local.stages import skip_unused_libraries

    set_offline_env()
    set_cpu_env()
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if flavour == "lean":
        skip_unused_libraries("sft")

    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401

    if flavour == "scientific":
        from lm_eval import simple_evaluate  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
        from lm_eval.tasks import TaskManager  # noqa: F401


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


def _child(request: dict) -> None:
    """In the forked child: become the requested ``alignpipe`` process, then exit with its code."""
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
        # As the console script runs: argv[0] and sys.path[0] are the script's path and directory.
        script = shutil.which(request["argv"][0], path=os.environ.get("PATH"))
        sys.argv = [script, *request["argv"][1:]]
        sys.path[0] = os.path.dirname(script)
        from alignpipe.cli import main

        code = main(sys.argv[1:])
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


def serve(flavour: str) -> None:
    _preload(flavour)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing the server imports may write into the answers
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
            _child(request)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
