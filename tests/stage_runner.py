"""``alignpipe run`` for the tests, forked from an interpreter that has already imported torch,
transformers, TRL and datasets, instead of exec'd afresh.

Every stage process spends about 7 s of CPU importing those before its first step, and the
suite runs more than a hundred (DEVELOPING.md, "Test suite speed"). ``run`` hands a stage run to
a server process (per test worker, started on first use) that has done those imports with
the environment a stage process has when it does them (``set_offline_env``, ``set_cpu_env``,
the console's ``QUIET_ENV``, ``skip_transformers_optional_imports``): one server for the
stages that need no lm-eval, one with lm-eval preloaded for those that do (``LM_EVAL_STAGES``,
benchmark). The server forks (tests/fork_server.py); the child
takes the run's directory, environment, argv and output files and calls ``alignpipe.cli.main``:
the same code from the command line on, in a process of its own.

A run gets a new interpreter instead (``subprocess.Popen``) when the fork could behave
differently from one:

- its environment differs from the server's in a variable other than
  ``fork_server.RUNTIME_ONLY`` (libraries read ``HF_*``, ``TRANSFORMERS_*``, ``OMP_*``, ``HOME``
  ... once, at import);
- it is not ``alignpipe run`` (``plan`` and the others import no torch: nothing to save);
- ``ALIGNPIPE_TEST_FRESH_PROCESSES=1`` is set (every run fresh: how to rule the runner out).

``start`` is the same for a run the test watches and kills (tests/test_resume.py): a forked
run leads a process group of its own, as ``start_new_session`` gives a new one.

The stage processes a ``dvc`` command starts are forked from the same servers when the test
runs it with ``dvc_env(env)``: the servers also listen on a Unix socket, and an ``alignpipe``
script first on dvc's PATH (tests/stage_shim.py) hands each ``alignpipe run`` to them with
dvc's own stdin, stdout and stderr. The tiny pipeline, the DVC experiments and the starting-model
tests run that way; the interrupt tests (what the kernel does to a stage process when dvc dies)
keep new interpreters. tests/test_stage_runner.py checks that a forked run publishes the same
bytes as a new one, from a test and from dvc, and that a forked run stops with its dvc.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests import fork_server, stage_shim
from tests.fork_server import FRESH

REPO = Path(__file__).resolve().parents[1]
FLAVOURS = ("lean", "scientific")
LM_EVAL_STAGES = frozenset({"benchmark"})  # served by the "scientific" runner, lm-eval preloaded
_servers: dict[str, fork_server.Server] = {}  # by flavour
_shim: list[Path] = []  # the folder of this worker's stage_shim script, once written
_lock = threading.Lock()


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``,
    forked from the preloaded server where that is the same thing (module docstring)."""
    return fork_server.run(functools.partial(start, argv, cwd=cwd, env=env), argv, timeout)


# The worker's environment before its tests import anything (tests/conftest.py imports this
# module once it has set the suite's variables). Libraries add to os.environ when a test
# imports them in the worker (scikit-learn KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK, torch's
# inductor TORCHINDUCTOR_CACHE_DIR): no test chose those, and a stage process sets them itself if it imports the same library. Left in,
# every later run of that worker differed from its servers' environment and got a new process.
_WORKER_ENV = dict(os.environ)


def without_import_side_effects(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what the worker's own imports added to os.environ (same name, same value)."""
    added = {k for k in os.environ.keys() - _WORKER_ENV.keys() if env.get(k) == os.environ[k]}
    return {k: v for k, v in env.items() if k not in added}


def start(
    argv: list[str], *, cwd: Path, env: dict[str, str], stdout, stderr
) -> fork_server.Forked | subprocess.Popen:
    """``subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
    start_new_session=True)``, forked where that is the same thing: either way the run leads a
    process group of its own (``os.killpg(proc.pid, ...)``), with ``poll`` and ``wait``.
    ``stdout``/``stderr`` are open files (``stderr=subprocess.STDOUT`` joins them)."""
    if _forkable(argv, env):
        env = without_import_side_effects(env)
        flavour = "scientific" if _stage(argv) in _scientific_stages() else "lean"
        with _lock:
            # The server imports in this worker's environment; a run that changes an import-time
            # variable of it (a test's HF_HOME, say) is no fork of that server.
            server = (
                _server(flavour)
                if not fork_server.differs(without_import_side_effects(dict(os.environ)), env)
                else _servers.get(flavour)
            )
            if server is not None and server.alive() and not fork_server.differs(server.env, env):
                return server.start(argv, cwd, env, stdout, stderr)
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)


def dvc_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a ``dvc`` command whose stage processes (``alignpipe run``) should be forked
    from this worker's servers: tests/stage_shim.py's ``alignpipe`` first on PATH, and where the
    servers listen. Unchanged under ``ALIGNPIPE_TEST_FRESH_PROCESSES=1``; a run whose
    environment the servers refuse gets a new process there too."""
    if env.get(FRESH) == "1":
        return env
    with _lock:
        sockets = ",".join(f"{flavour}={_server(flavour).listen}" for flavour in FLAVOURS)
    return {
        **without_import_side_effects(env),
        "PATH": os.pathsep.join([str(_shim_dir()), env.get("PATH", "")]),
        stage_shim.SOCKETS: sockets,
        stage_shim.SCIENTIFIC: ",".join(sorted(_scientific_stages())),
    }


def served() -> int:
    """How many runs this worker has forked so far for its tests (``forked_for_dvc``: for dvc)."""
    return sum(server.served for server in _servers.values())


def forked_for_dvc(cwd: Path | None = None) -> list[tuple[str, int]]:
    """The runs this worker's servers forked for tests/stage_shim.py (in ``cwd``, if given:
    other tests' dvc commands may run beside): (command line, pid)."""
    runs = []
    for server in _servers.values():
        for line in server.log.read_text().splitlines():
            m = re.fullmatch(re.escape(fork_server.CLIENT_FORKED) + r" (.*) in (.*) \(pid (\d+)\)", line)
            if m and (cwd is None or m[2] == str(cwd)):
                runs.append((m[1], int(m[3])))
    return runs


def refused_for_dvc(cwd: Path) -> list[str]:
    """Why this worker's servers gave runs in ``cwd`` a new process instead of a fork."""
    prefix = f"{fork_server.CLIENT_REFUSED} "
    return [
        line.removeprefix(prefix)
        for server in _servers.values()
        for line in server.log.read_text().splitlines()
        if line.startswith(prefix) and f" in {cwd}: " in line
    ]


def _server(flavour: str) -> fork_server.Server:
    """This worker's server of ``flavour``, started on first use (hold ``_lock``)."""
    server = _servers.get(flavour)
    if server is None or not server.alive():
        listen = Path(tempfile.mkdtemp(prefix="apstage.")) / f"{flavour}.sock"  # < 108 bytes
        server = _servers[flavour] = fork_server.Server(
            [sys.executable, "-m", "tests.stage_runner", flavour, "--listen", str(listen)],
            env=without_import_side_effects(dict(os.environ)),
            cwd=REPO,
            name="stage runner",
        )
        server.listen = listen
        atexit.register(shutil.rmtree, listen.parent, ignore_errors=True)
    return server


def _shim_dir() -> Path:
    if not _shim:
        folder = Path(tempfile.mkdtemp(prefix="apshim."))
        stage_shim.write(str(folder), str(Path(sys.executable).parent / "alignpipe"), str(REPO))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _shim.append(folder)
    return _shim[0]


def _scientific_stages() -> frozenset[str]:
    return LM_EVAL_STAGES


def _stage(argv: list[str]) -> str:
    return argv[2].split("@")[0]


def _forkable(argv: list[str], env: dict[str, str]) -> bool:
    return env.get(FRESH) != "1" and len(argv) >= 3 and Path(argv[0]).name == "alignpipe" and argv[1] == "run"


# --- the server side -------------------------------------------------------------------------


def _preload(flavour: str) -> None:
    """What a stage process has imported before its first step, in the environment it imports
    them in (alignpipe.stage.run_stage)."""
    from alignpipe.console import QUIET_ENV
    from alignpipe.context import set_cpu_env, set_offline_env
    from alignpipe.engines.local.stages import skip_transformers_optional_imports

    set_offline_env()
    set_cpu_env()
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    skip_transformers_optional_imports()

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


def _become_alignpipe(argv: list[str]) -> int:
    """The console script's run: argv[0] and sys.path[0] are the script's path and directory."""
    script = shutil.which(argv[0], path=os.environ.get("PATH"))
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    from alignpipe.cli import main

    return main(sys.argv[1:])


if __name__ == "__main__":
    # python -m tests.stage_runner FLAVOUR [--listen SOCKET]
    started_with = dict(os.environ)  # what a client's run is compared with, before _preload sets more
    _preload(sys.argv[1])
    fork_server.serve(_become_alignpipe, listen=sys.argv[3] if len(sys.argv) > 3 else None, env=started_with)
