"""Shared fixtures: throwaway copies of the repository to run real stages in."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
}
for _k, _v in OFFLINE.items():
    os.environ.setdefault(_k, _v)
# Every `dvc` command the tests run would otherwise start a detached `dvc daemon analytics`
# process (~0.6 CPU s) that posts a usage report; tests send none.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
# The throwaway repositories the tests commit in (and `dvc exp run` commits to) need an author; a
# fresh machine's git has none.
for _who in ("GIT_AUTHOR", "GIT_COMMITTER"):
    os.environ.setdefault(f"{_who}_NAME", "t")
    os.environ.setdefault(f"{_who}_EMAIL", "t@t")
# Stage commands (alignpipe, dvc) come from the interpreter's own environment, as under `make test`.
_BIN = str(Path(sys.executable).parent)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")
# The stage processes' CPU environment in every test process too, before torch loads
# (alignpipe.context.set_cpu_env): the portable kernels, so what a test computes in-process is the
# same bits on any x86-64 CPU with AVX2 as what its stage processes compute, and OpenMP workers
# that sleep while they wait, so a stage run in-process with two threads on a busy machine does
# not spin (benchmarks/RESULTS.md, "Threads").
from alignpipe.cli import defer_full_collections  # noqa: E402
from alignpipe.context import set_cpu_env  # noqa: E402

set_cpu_env()
# As in a stage process: a test process imports more (torch, transformers, TRL, lm-eval, Ray) and
# runs stages in it.
defer_full_collections()

# Fixtures that train: a test that uses one is `slow` whatever its own marks say; one that runs
# NeMo-RL's runtime code (a process importing NeMo-RL, often with Ray) is `upstream`. The quick
# tier (`make test-quick`: -m "not slow and not upstream and not container and not slurm and
# not ray") runs neither.
TRAINING_FIXTURES = ("trained_sft", "tiny_pipeline", "prepared_repo")
UPSTREAM_FIXTURES = ("nemo_rl_runtime", "dcp_run", "megatron_run")  # the last two: NeMo-RL's checkpointing


# `make test` runs the suite on every core (pytest-xdist, --dist loadgroup). Each test module
# stays on one worker, so a module's fixtures are built once; the modules that start Slurm and
# Ray clusters share one, so no two clusters run at once; and the modules that call NeMo-RL's
# probe worker share one, so one worker imports NeMo-RL and starts its Ray, not one per core
# (an idle local Ray costs ~2 CPU s a minute until the session ends).
CLUSTER_MODULES = ("test_slurm", "test_ray", "test_ray_auth", "test_launch_plan")


# First: pytest-xdist's own hook turns the xdist_group marks into the node ids' `@group` suffix that
# `--dist loadgroup` schedules by, and -m deselects by the marks added here. Run after them, the
# groups were ignored: each test was scheduled alone, and both workers built a module's fixtures.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    groups: dict[str, list] = {}
    probing = {item.module for item in items if "nemo_rl_runtime" in item.fixturenames}
    for item in items:
        if any(name in item.fixturenames for name in TRAINING_FIXTURES):
            item.add_marker(pytest.mark.slow)
        if any(name in item.fixturenames for name in UPSTREAM_FIXTURES):
            item.add_marker(pytest.mark.upstream)
        module = item.module.__name__.rsplit(".", 1)[-1]
        group = module
        if module in CLUSTER_MODULES:
            group = "clusters"
        elif item.module in probing:
            group = "nemo_rl_runtime"
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
    items[:] = [item for group in schedule_order(groups) for item in groups[group]]


def pytest_collection_finish(session) -> None:
    """What collection imported lives as long as the process: full collections (accelerate runs
    one after every training run, ~0.4 s each here) skip it from now on."""
    gc.freeze()


def pytest_configure(config) -> None:
    """Refuse `--dist loadgroup` where pytest-xdist cannot see the groups: pytest 9.2's structured
    node ids drop the ``@group`` suffix xdist 3.8 schedules by (pytest-dev/pytest-xdist#1386). The
    run would pass, slowly: every test scheduled alone, each module's fixtures built on both workers."""
    import importlib.metadata

    from packaging.version import Version

    if config.getoption("dist", None) != "loadgroup" or hasattr(config, "workerinput"):
        return
    pytest_v, xdist_v = (Version(importlib.metadata.version(d)) for d in ("pytest", "pytest-xdist"))
    if pytest_v >= Version("9.2") and xdist_v <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {pytest_v} with pytest-xdist {xdist_v} ignores --dist loadgroup's groups "
            "(pytest-dev/pytest-xdist#1386): install the dev extra's pins, pip install -e '.[dev]'"
        )


HEAVY_MARKS = ("slow", "upstream", "container", "slurm", "ray")


def schedule_order(groups: dict[str, list]) -> list[str]:
    """The order workers take the groups in (`--dist loadgroup --no-loadscope-reorder`: whole
    groups, first come first served). Longest first, so that no long group starts last: the
    groups that train or start services, most such tests first; then the groups that read
    ``tiny_pipeline``, whose build started in the background with the session
    (``pipeline_in_background``) and is done or nearly by then; then the quick groups."""

    def heavy(group: str) -> int:
        return sum(any(item.get_closest_marker(m) for m in HEAVY_MARKS) for item in groups[group])

    readers = [g for g in groups if any("tiny_pipeline" in i.fixturenames for i in groups[g])]
    trainers = sorted((g for g in groups if heavy(g) and g not in readers), key=heavy, reverse=True)
    quick = [g for g in groups if not heavy(g) and g not in readers]
    return [*trainers, *readers, *quick]


# A stand-in for `dvc repro`: runs a command through `/bin/sh -c`, as DVC does when SHELL is
# unset, and like DVC does not pass SIGTERM on; it just dies. Debian's sh (dash) forks and
# waits, so the stage's parent is a shell that outlives this one. Launchers' tests put the
# stage under it to check the stage follows the process that started it.
DVC_LIKE_PARENT = [
    sys.executable,
    "-c",
    "import shlex, subprocess, sys; sys.exit(subprocess.call(['/bin/sh', '-c', shlex.join(sys.argv[1:])]))",
]


def with_default_sigint() -> None:
    """``preexec_fn`` for a stage started by a test that sends it Ctrl-C: a shell running the
    suite in the background (``make test &``) leaves SIGINT ignored, and Python keeps an
    inherited SIG_IGN, so the stage would never see the interrupt the test sends."""

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_like_a_stage(
    argv: list[str], log: Path, *, under_dvc: bool, cwd: Path | None = None
) -> subprocess.Popen:
    """Start ``argv`` in its own session with Ctrl-C deliverable, output to ``log``: directly, or
    (``under_dvc``) below ``DVC_LIKE_PARENT``, for the tests that interrupt a launcher."""
    with log.open("w") as out:
        return subprocess.Popen(
            [*DVC_LIKE_PARENT, *argv] if under_dvc else argv,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=with_default_sigint,
        )


def project_files(root: Path = REPO) -> list[str]:
    """Tracked files plus new, not-ignored ones: what a clone of this work would hold."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if line and (root / line).is_file()]


def copy_repo(dst: Path, *, git: bool = False) -> Path:
    """Copy the project into ``dst`` (no data, models or venv), optionally as a git+DVC repo."""
    dst.mkdir(parents=True, exist_ok=True)
    for rel in project_files():
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    if git:
        commit_all(dst)
    return dst


def commit_all(root: Path) -> None:
    """Make ``root`` a git repo (if it is not) and commit everything in it."""
    if not (root / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", "copy"], cwd=root, check=True)


def deep_merge(base: dict, new: dict) -> None:
    """Merge ``new`` into ``base`` in place: nested dicts merge, anything else is replaced."""
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)


def set_params(root: Path, updates: dict) -> None:
    """Deep-merge ``updates`` into ``root/params.yaml`` (like `dvc exp run -S`)."""
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    deep_merge(params, updates)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def set_model(root: Path, name: str | None, **more) -> None:
    """Set ``model.name`` in ``root/params.yaml`` as `dvc exp run -S model.name=...` does,
    deriving ``model.dep`` with the same resolver DVC's Hydra composition runs."""
    from hydra_plugins.alignpipe_model_dep import model_dep

    set_params(root, {"model": {"name": name, "dep": model_dep(name), **more}})


def run_cli(
    root: Path,
    *args: str,
    env: dict | None = None,
    check: bool = True,
    timeout: float = 900,
    process: bool = False,
):
    """Run the real ``alignpipe`` CLI in ``root``: a stage run (``run``) in this process, from
    ``cli.main`` on (``in_process``: the worker has imported torch and TRL once, as TRL's own
    trainer tests do); anything else, or with ``process=True`` (what a library reads from the
    environment at import is the point), in a new process as DVC starts one."""
    full_env = {**os.environ, **OFFLINE, "ALIGNPIPE_ROOT": str(root), **(env or {})}
    if args[0] == "run" and not process:
        proc = in_process(list(args), cwd=root, env=full_env)
    else:
        proc = subprocess.run(["alignpipe", *args], cwd=root, env=full_env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(
            f"alignpipe {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def _set_environ(env: dict[str, str]) -> None:
    """os.environ becomes ``env``, variable by variable: a thread starting a process meanwhile
    (the background pipeline's git) never sees an environment without PATH."""
    for key in os.environ.keys() - env.keys():
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def in_process(argv: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``alignpipe ARGV`` run by ``cli.main`` in this process, with ``cwd``, ``env`` and its output
    (Python's and the C libraries') captured; the worker's directory, environment, logging,
    warning filters and torch threads are put back afterwards. An exception is a stage
    process's crash: its traceback on stderr, return code 1."""
    import logging
    import tempfile
    import traceback
    import warnings

    import torch

    from alignpipe import cli

    root_logger = logging.getLogger()
    saved = (
        dict(os.environ),
        os.getcwd(),
        root_logger.handlers[:],
        root_logger.level,
        torch.get_num_threads(),
    )
    import_path, imported = sys.path[:], set(sys.modules)
    out, err = (tempfile.TemporaryFile("w+", encoding="utf-8") for _ in range(2))
    sys.stdout.flush()
    sys.stderr.flush()
    fds = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            _set_environ(env)
            os.chdir(cwd)
            try:
                code = cli.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:
                traceback.print_exc()
                code = 1
            logging.captureWarnings(False)
    finally:
        out.flush()
        err.flush()
        for fd, target in zip(fds, (1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
        _set_environ(saved[0])
        os.chdir(saved[1])
        for handler in root_logger.handlers:
            if handler not in saved[2]:
                handler.close()
        root_logger.handlers[:], root_logger.level = saved[2], saved[3]
        torch.set_num_threads(saved[4])
        # What the stage imported from its own repository (a user's tools/ module) goes with it,
        # as with its process: another repository's stage must import its own copy.
        sys.path[:] = import_path
        here = Path(cwd).resolve()
        for name in set(sys.modules) - imported:
            if Path(getattr(sys.modules[name], "__file__", None) or "/").resolve().is_relative_to(here):
                del sys.modules[name]
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(["alignpipe", *argv], code, out.read(), err.read())


@pytest.fixture(scope="session", autouse=True)
def own_scratch(tmp_path_factory) -> None:
    """Stages a test runs without naming a scratch dir keep their checkpoints under this worker's
    temp dir, not ~/.cache: two workers running the same stage on copies named `repo` would
    otherwise share (and delete) one scratch dir."""
    os.environ.setdefault("ALIGNPIPE_SCRATCH", str(tmp_path_factory.getbasetemp() / "scratch"))


@pytest.fixture
def repo_copy(tmp_path: Path, monkeypatch) -> Path:
    """A fresh copy of the project with its own scratch dir."""
    root = copy_repo(tmp_path / "repo")
    monkeypatch.setenv("ALIGNPIPE_SCRATCH", str(tmp_path / "scratch"))
    return root


# Small, fast settings for trainer tests: same code paths, fewer steps.
FAST_SFT = {"sft": {"sft": {"max_num_steps": 40}}}
# Trainer tests check mechanics (resume, adapters, launchers), not conversations: single-turn
# data trains in half the time (a `chat` row is ~3x a plain one's tokens, and pads its batch).
# The committed pipeline (`tiny_pipeline`) and the equivalence suite train conversations.
SINGLE_TURN = {"prep": {"builtin": {"tasks": {"chat": {"weight": 0}}}}}
# One torch thread per stage process in the shared trainer fixtures, not the profile's two: two
# test workers on two cores run two stages at once, and four threads on two cores cost every
# tiny stage 15-20% more CPU (DEVELOPING.md, "Test suite speed"). The count is a setting like the
# step counts above; results stay byte-reproducible at either. The committed pipeline keeps 2.
ONE_THREAD = {stage: {"alignpipe": {"torch_threads": 1}}
              for stage in ("sft", "rm", "dpo", "rlvr", "rlhf", "convert", "benchmark", "evaluate")}  # fmt: skip


def merged(*updates: dict) -> dict:
    """One ``set_params`` update from several (later ones win, nested keys merge)."""
    out: dict = {}
    for update in updates:
        deep_merge(out, update)
    return out


def set_writable(root: Path, writable: bool) -> None:
    """Add or remove write permission on everything under ``root`` (directories keep x)."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def writable_copy(src: Path, dst: Path) -> Path:
    """A copy of a (read-only) session fixture's tree that a test may change."""
    shutil.copytree(src, dst, symlinks=True)
    set_writable(dst, True)
    return dst


def build_once(tmp_path_factory, name: str, build) -> Path:
    """``build(dir)`` once per test session, whichever worker asks first (pytest-xdist starts one
    process per core); the others wait for it and get the same directory. A build that failed
    fails every later ask with its error, without building again."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    target, done, failed = shared / name, shared / f"{name}.done", shared / f"{name}.failed"
    with FileLock(str(shared / f"{name}.lock")):
        if failed.exists():
            raise AssertionError(f"building {name} failed earlier in this session:\n{failed.read_text()}")
        if not done.exists():
            if target.exists():
                set_writable(target, True)
                shutil.rmtree(target)
            target.mkdir()
            try:
                build(target)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}")
                raise
            done.touch()
    return target


@pytest.fixture(scope="session")
def trained_sft(tmp_path_factory) -> Path:
    """A repo copy with prep, base and a briefly trained SFT policy, shared by trainer tests.

    Read-only, so that test order cannot change results: a test that writes (runs a stage,
    edits params.yaml) fails loudly with PermissionError; it works on ``writable_copy``.
    """

    def build(tmp: Path) -> None:
        root = copy_repo(tmp / "repo")
        env = {"ALIGNPIPE_SCRATCH": str(tmp / "scratch")}
        set_params(root, merged(FAST_SFT, SINGLE_TURN, ONE_THREAD))
        for stage in ("prep", "base", "sft"):
            run_cli(root, "run", stage, env=env)
        set_writable(root, False)

    return build_once(tmp_path_factory, "trained-sft", build) / "repo"


@pytest.fixture(scope="session")
def prepared_repo(tmp_path_factory) -> Path:
    """A git + DVC copy of the project where `dvc repro base` has run (single-turn data) and is
    committed, with its outputs in the copy's DVC cache: a checkout about to train, for tests
    that drive `dvc repro` of a trainer and would otherwise prepare data and build the base
    again each (two stage processes). Read-only; tests work on ``writable_copy``."""

    def build(tmp: Path) -> None:
        root = copy_repo(tmp / "repo", git=True)
        set_params(root, merged(SINGLE_TURN, ONE_THREAD))
        env = {**os.environ, **OFFLINE, "ALIGNPIPE_SCRATCH": str(tmp / "scratch")}
        repro = subprocess.run(["dvc", "repro", "base"], cwd=root, env=env, capture_output=True, text=True)
        if repro.returncode != 0:
            raise AssertionError(f"dvc repro base failed:\n{repro.stdout[-4000:]}\n{repro.stderr[-4000:]}")
        commit_all(root)
        set_writable(root, False)

    return build_once(tmp_path_factory, "prepared", build) / "repo"


@dataclass(frozen=True)
class Reproduced:
    """The committed tiny pipeline after one ``dvc repro`` (``tiny_pipeline``)."""

    root: Path  # a git + DVC copy of the project with every stage's outputs; read-only
    ran: list[str]  # the stages `dvc repro` ran, in order
    committed_lock: str  # dvc.lock as committed, before the run rewrote it
    log: str  # what `dvc repro` printed: each stage's console, stdout and stderr

    def metrics(self, stage: str) -> dict:
        import json

        return json.loads((self.root / "results" / stage / "metrics.json").read_text())


# The `dvc repro` that ``build_tiny_pipeline`` started in this process, while it runs.
_PIPELINE_REPRO: list[subprocess.Popen] = []


def build_tiny_pipeline(tmp_path_factory, environ: dict[str, str] | None = None) -> Reproduced:
    """The committed tiny pipeline, reproduced once per test session (``build_once``), with
    ``environ`` (default: this process's now). A thread passes the one it was started with: a
    stage run in a test's process changes os.environ (ALIGNPIPE_ROOT) while it runs."""
    import json
    import re

    environ = dict(os.environ if environ is None else environ)

    def build(tmp: Path) -> None:
        root = copy_repo(tmp / "repo", git=True)
        (tmp / "committed.lock").write_text((root / "dvc.lock").read_text())
        env = {
            **environ,
            **OFFLINE,
            "ALIGNPIPE_SCRATCH": str(tmp / "scratch"),
            "PYTHONHASHSEED": "0",
        }
        proc = subprocess.Popen(["dvc", "repro"], cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        _PIPELINE_REPRO.append(proc)
        out, _ = proc.communicate()
        _PIPELINE_REPRO.remove(proc)
        if proc.returncode != 0:
            raise AssertionError(f"dvc repro of the tiny pipeline failed:\n{out[-8000:]}")
        (tmp / "repro.log").write_text(out)
        (tmp / "ran.json").write_text(json.dumps(re.findall(r"Running stage '([^']+)'", out)))
        set_writable(root, False)

    tmp = build_once(tmp_path_factory, "tiny-pipeline", build)
    return Reproduced(
        tmp / "repo",
        json.loads((tmp / "ran.json").read_text()),
        (tmp / "committed.lock").read_text(),
        (tmp / "repro.log").read_text(),
    )


@pytest.fixture(scope="session", autouse=True)
def pipeline_in_background(request, tmp_path_factory):
    """Start reproducing the tiny pipeline beside the first tests when any collected test reads
    it: the build (most of ten minutes, one stage process at a time) then overlaps the other
    tests instead of holding up the worker that first asks for it; whoever asks waits for it.
    At the session's end this worker waits for a build it started (another worker may still
    need it), unless the session is stopping early (-x, a failure limit)."""
    import threading

    if not any("tiny_pipeline" in item.fixturenames for item in request.session.items):
        yield
        return

    environ = dict(os.environ)  # before any test changes it

    def run() -> None:
        try:
            build_tiny_pipeline(tmp_path_factory, environ)
        except BaseException:  # recorded by build_once; the tests that read it report it
            pass

    thread = threading.Thread(target=run, name="tiny-pipeline", daemon=True)
    thread.start()
    yield
    if request.session.shouldfail or request.session.shouldstop:
        for proc in list(_PIPELINE_REPRO):
            proc.terminate()
    elif _PIPELINE_REPRO:
        thread.join()


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory) -> Reproduced:
    """The committed tiny pipeline, reproduced once per test session with `dvc repro` on a fresh
    git + DVC copy (what `make repro` does on a clone), and shared by every test that reads a
    trained model, an export or a score. Read-only: a test that runs a stage or a `dvc` command
    works on ``writable_copy(tiny_pipeline.root, ...)``."""
    return build_tiny_pipeline(tmp_path_factory)


# --- NeMo-RL v0.7.0 source (vendored as data in ../shared/vendor; never copied into the repo) ---

VENDORED_NEMO_RL = REPO.parent / "shared" / "vendor" / "nemo-rl-v0.7.0.tar.gz"
VENDORED_NEMO_RL_SHA256 = "80fb89422d0e2b1c9fc7b88e276e41d522815877bdd41842fdc17d2fdfe56ba6"
# Where the vendored archive is absent (a clone outside this workplace), the same files come
# from GitHub's archive of the v0.7.0 commit. The vendored archive is `git archive` of these
# paths at that commit (../shared/vendor/README.md), so a download is checked file by file
# against the digest of that tree (``tree_digest``), not against archive bytes.
NEMO_RL_COMMIT = "81aa43dda4765b0429cf31dab44441e4e4383911"
NEMO_RL_ARCHIVE_URL = f"https://codeload.github.com/NVIDIA-NeMo/RL/tar.gz/{NEMO_RL_COMMIT}"
NEMO_RL_PATHS = ("nemo_rl/", "examples/", "docker/", "LICENSE", "pyproject.toml", "uv.lock", "ray.sub",
                 "tests/unit/test_config_validation.py")  # fmt: skip
NEMO_RL_TREE_SHA256 = "5154872644b2ed091f757d7fa6fbf7f3c9be21297c0e6a153a45b67b0e7d89e9"
NEMO_RL_TOP = "nemo-rl-v0.7.0"


def tree_digest(top: Path) -> str:
    """sha256 over every file and link under ``top`` (``<top name>/<path>``, sorted) with the
    sha256 of its bytes (a link: its target): the same for any archive of the same tree. The
    interpreter's bytecode caches are not the source: importing the tree writes them wherever
    PYTHONDONTWRITEBYTECODE is unset."""
    import hashlib

    entries = []
    for path in top.rglob("*"):
        if "__pycache__" in path.relative_to(top).parts:
            continue
        name = f"{top.name}/{path.relative_to(top).as_posix()}"
        if path.is_symlink():
            entries.append((name, "2"))  # tarfile's SYMTYPE, as the pinned digest was taken
        elif path.is_file():
            entries.append((name, hashlib.sha256(path.read_bytes()).hexdigest()))
    h = hashlib.sha256()
    for name, digest in sorted(entries):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def fetch_nemo_rl_source(into: Path, url: str = NEMO_RL_ARCHIVE_URL) -> Path:
    """Download the v0.7.0 commit's archive from ``url`` and keep ``NEMO_RL_PATHS`` under
    ``into/nemo-rl-v0.7.0``, checked against ``NEMO_RL_TREE_SHA256``; fails naming what to do."""
    import tarfile
    import urllib.request

    archive = into / "download.tar.gz"
    try:
        with urllib.request.urlopen(url, timeout=300) as response, archive.open("wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as e:
        raise AssertionError(
            f"NeMo-RL v0.7.0 source not found and could not be downloaded from {url} ({e}): put the "
            f"archive at {VENDORED_NEMO_RL}, or point NEMO_RL_SRC at a v0.7.0 checkout "
            f"(git clone https://github.com/NVIDIA-NeMo/RL && git -C RL checkout {NEMO_RL_COMMIT})"
        ) from None
    top = into / NEMO_RL_TOP
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            _, _, rel = member.name.partition("/")  # GitHub's top folder is RL-<commit>
            if rel and any(rel == p or rel.startswith(p) for p in NEMO_RL_PATHS):
                member.name = f"{NEMO_RL_TOP}/{rel}"
                tar.extract(member, into, filter="data")
    archive.unlink()
    got = tree_digest(top) if top.is_dir() else "nothing"
    if got != NEMO_RL_TREE_SHA256:
        raise AssertionError(
            f"{url}: the NeMo-RL files it holds digest to {got}, not v0.7.0's {NEMO_RL_TREE_SHA256} "
            f"(commit {NEMO_RL_COMMIT}); point NEMO_RL_SRC at a v0.7.0 checkout instead"
        )
    return top


def extract_nemo_rl_source() -> Path:
    """NeMo-RL v0.7.0's source tree: ``$NEMO_RL_SRC`` if set, else the vendored archive, else
    the same files downloaded from GitHub (``fetch_nemo_rl_source``; ``$ALIGNPIPE_NEMO_RL_URL``
    overrides the address), extracted once into ``~/.cache/alignpipe/upstream/``.

    Fails (never skips) when none can be had, naming how to get it: CI has the archive at
    ../shared/vendor/.
    """
    import hashlib
    import tarfile
    import tempfile

    given = os.environ.get("NEMO_RL_SRC")
    if given:
        src = Path(given).expanduser().resolve()
        if not (src / "nemo_rl").is_dir() or not (src / "examples").is_dir():
            raise AssertionError(f"NEMO_RL_SRC={given} is not a NeMo-RL checkout (no nemo_rl/ and examples/)")
        return src
    vendored = VENDORED_NEMO_RL.is_file()
    if vendored:
        digest = hashlib.sha256(VENDORED_NEMO_RL.read_bytes()).hexdigest()
        if digest != VENDORED_NEMO_RL_SHA256:
            raise AssertionError(
                f"{VENDORED_NEMO_RL}: sha256 {digest}, expected {VENDORED_NEMO_RL_SHA256} (v0.7.0)"
            )
    cache = Path(
        os.environ.get("ALIGNPIPE_UPSTREAM_CACHE", Path.home() / ".cache" / "alignpipe" / "upstream")
    )
    # One cache entry whichever way it came: a download is checked to hold the same files.
    dest = cache / f"nemo-rl-v0.7.0-{VENDORED_NEMO_RL_SHA256[:12]}"
    if not (dest / NEMO_RL_TOP / "nemo_rl").is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".extract-"))
        if vendored:
            with tarfile.open(VENDORED_NEMO_RL) as tar:
                tar.extractall(tmp, filter="data")
        else:
            try:
                fetch_nemo_rl_source(tmp, os.environ.get("ALIGNPIPE_NEMO_RL_URL", NEMO_RL_ARCHIVE_URL))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        # Its bytecode, once (the digest leaves it out): the probes import nemo_rl from here,
        # and where PYTHONDONTWRITEBYTECODE is set (these machines) each compiled it again.
        import compileall

        package = Path(NEMO_RL_TOP) / "nemo_rl"
        compileall.compile_dir(tmp / package, ddir=dest / package, quiet=2)
        try:
            tmp.rename(dest)  # atomic: a concurrent or interrupted run never sees half a tree
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return dest / NEMO_RL_TOP


@pytest.fixture(scope="session")
def nemo_rl_src() -> Path:
    """Read-only NeMo-RL v0.7.0 source tree (``$NEMO_RL_SRC`` or the extracted vendored archive)."""
    return extract_nemo_rl_source()


# NeMo-RL v0.7.0's own pins (its uv.lock) of the config stack: the schema the contract tests
# validate with is then the one NeMo-RL's image builds (measured byte-identical).
NEMO_RL_SCHEMA_PINS = (
    "pydantic==2.13.4",
    "pydantic-core==2.46.4",
    "typing-extensions==4.15.0",
    "omegaconf==2.3.0",
    "hydra-core==1.3.2",
    "pyyaml==6.0.3",
    "packaging==25.0",
    # their own dependencies, at the same lock's versions
    "antlr4-python3-runtime==4.9.3",
    "annotated-types==0.7.0",
    "typing-inspection==0.4.2",
)


def nemo_rl_schema_python() -> Path:
    """A small cached venv with ``NEMO_RL_SCHEMA_PINS``; built once (about 10 s from PyPI)."""
    import hashlib

    from filelock import FileLock

    key = hashlib.sha256(" ".join(NEMO_RL_SCHEMA_PINS).encode()).hexdigest()[:12]
    venv = Path.home() / ".cache" / "alignpipe" / f"nemo-rl-schema-venv-{key}"
    python, done = venv / "bin" / "python", venv / ".complete"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{venv}.lock"):  # one builder at a time: the suite runs on every core
        if not done.is_file():
            _build_schema_venv(venv, python, done)
    return python


def _build_schema_venv(venv: Path, python: Path, done: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)  # a half-built venv from an interrupted run
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *NEMO_RL_SCHEMA_PINS], check=True)
    done.write_text("\n".join(NEMO_RL_SCHEMA_PINS) + "\n")


@pytest.fixture(scope="session")
def schema_python() -> Path:
    return nemo_rl_schema_python()


# --- NeMo-RL v0.7.0's own loss, data, advantage and environment code, run on CPU ---
# The equivalence suite (tests/test_equivalence_*.py) imports NeMo-RL's real modules. Their
# import closure reaches its logger backends and data plane (nemo-rl.md §12); those packages
# run here, so they are installed for real at NeMo-RL's own uv.lock versions, in a small venv
# layered on this one (a .pth line), which keeps torch/transformers/ray the project's own.
NEMO_RL_RUNTIME_PINS = (
    "pyzmq==27.1.0",
    "wandb==0.28.0",
    "mlflow-skinny==3.14.0",
    "swanlab==0.7.18",
    "soundfile==0.13.1",
    "torchdata==0.11.0",
    "tensordict==0.12.4",
    "scipy==1.17.1",
)


def nemo_rl_runtime_python() -> Path:
    """An interpreter that sees this venv's packages plus ``NEMO_RL_RUNTIME_PINS``; built once
    (about 20 s from PyPI), keyed by the pins and this interpreter."""
    import hashlib
    import sysconfig

    from filelock import FileLock

    key = hashlib.sha256(" ".join((sys.prefix, *NEMO_RL_RUNTIME_PINS)).encode()).hexdigest()[:12]
    venv = Path.home() / ".cache" / "alignpipe" / f"nemo-rl-runtime-venv-{key}"
    python, done = venv / "bin" / "python", venv / ".complete"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{venv}.lock"):  # one builder at a time: the suite runs on every core
        if done.is_file():
            return python
        shutil.rmtree(venv, ignore_errors=True)  # a half-built venv from an interrupted run
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        (Path(site) / "alignpipe_project_venv.pth").write_text("\n".join(sorted(ours)) + "\n")
        pip = subprocess.run([str(python), "-m", "pip", "install", "-q", *NEMO_RL_RUNTIME_PINS],
                             capture_output=True, text=True)  # fmt: skip
        assert pip.returncode == 0, f"installing {NEMO_RL_RUNTIME_PINS} failed:\n{pip.stderr[-4000:]}"
        done.write_text("\n".join(NEMO_RL_RUNTIME_PINS) + "\n")
    return python


@pytest.fixture(scope="session")
def nemo_rl_runtime(nemo_rl_src: Path):
    """``call(probe, payload, timeout=600) -> result``: runs probe ``probe`` of
    tests/nemo_rl_probe.py on NeMo-RL's source with ``payload`` (anything ``torch.save`` takes)
    and returns what the probe returned. One ``--worker`` process per test process runs the
    calls one after another, having imported NeMo-RL once; started on the first call, and again
    on the call after one that killed it."""
    import json
    import select
    import tempfile

    import torch

    python = nemo_rl_runtime_python()
    tmp = Path(tempfile.mkdtemp(prefix="nemo-rl-probe-"))
    log = tmp / "worker.log"

    def worker() -> subprocess.Popen:
        if not _PROBE_WORKERS or _PROBE_WORKERS[0].poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(nemo_rl_src), str(REPO)])}
            with log.open("a") as stderr:
                _PROBE_WORKERS[:] = [
                    subprocess.Popen(
                        [str(python), "-m", "tests.nemo_rl_probe", "--worker"],
                        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                        bufsize=0, start_new_session=True,
                    )
                ]  # fmt: skip
        return _PROBE_WORKERS[0]

    def call(probe: str, payload, timeout: float = 600):
        start = log.stat().st_size if log.exists() else 0
        proc = worker()

        def said() -> str:  # what the worker logged during this call
            with log.open("rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace")[-6000:]

        with tempfile.TemporaryDirectory(dir=tmp) as call_dir:
            src, dst = Path(call_dir) / "in.pt", Path(call_dir) / "out.pt"
            torch.save(payload, src)
            request = json.dumps({"probe": probe, "src": str(src), "dst": str(dst)})
            try:
                proc.stdin.write((request + "\n").encode())
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died: the empty answer below says so
            if not select.select([proc.stdout], [], [], timeout)[0]:
                _kill_probe_worker(proc)
                raise TimeoutError(f"NeMo-RL probe '{probe}' ran past {timeout} s; its log:\n{said()}")
            line = proc.stdout.readline()
            if not line:
                _kill_probe_worker(proc)
                raise RuntimeError(
                    f"the NeMo-RL probe worker died (exit {proc.returncode}) in '{probe}'; its log:\n{said()}"
                )
            answer = json.loads(line)
            assert answer["ok"], f"NeMo-RL probe '{probe}' failed:\n{answer['error'][-6000:]}\nlog:\n{said()}"
            return torch.load(dst, weights_only=False)

    yield call
    _stop_probe_workers()
    shutil.rmtree(tmp, ignore_errors=True)


# ``nemo_rl_runtime``'s worker process, while one runs.
_PROBE_WORKERS: list[subprocess.Popen] = []


def _kill_probe_worker(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and whatever it started (Ray)
    proc.wait()


def _stop_probe_workers() -> None:
    while _PROBE_WORKERS:
        proc = _PROBE_WORKERS.pop()
        proc.stdin.close()  # EOF: the worker ends after the call in flight
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        _kill_probe_worker(proc)


def pytest_runtest_teardown(item, nextitem) -> None:
    """The tests that call NeMo-RL's probe worker run as one group on one test worker; after the
    group, the probe worker (and its idle Ray, ~3 CPU s a minute) stops rather than idling to the
    session's end. A later call would start it again."""

    def group(test) -> str | None:
        mark = test and test.get_closest_marker("xdist_group")
        return mark.args[0] if mark else None

    if _PROBE_WORKERS and group(item) == "nemo_rl_runtime" != group(nextitem):
        _stop_probe_workers()
