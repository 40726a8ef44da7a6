"""Running a stage: resolve its context, pick the engine and launcher, and hand over.

``alignpipe run <stage>`` (what dvc.yaml calls) either launches the stage's *inner*
command through the configured launcher, or, with ``--inner`` / the process launcher,
runs the engine right here.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import alignpipe
from alignpipe import console
from alignpipe.artifacts import package_hash
from alignpipe.config import get_path
from alignpipe.context import (
    OFFLINE_ENV,
    StageContext,
    build_context,
    inner_argv,
    set_cpu_env,
    set_offline_env,
)
from alignpipe.errors import ConfigError


def engine_module(ctx: StageContext):
    """The module that runs this stage on its engine: ``run(ctx)``."""
    if ctx.engine == "nemo_rl":
        return importlib.import_module("alignpipe.engines.nemo_rl")
    try:
        return importlib.import_module(f"alignpipe.engines.local.{ctx.name}")
    except ModuleNotFoundError as e:
        if e.name == f"alignpipe.engines.local.{ctx.name}":
            raise ConfigError(f"stage '{ctx.name}' has no local-engine implementation") from e
        raise


def check_running_code(root: Path) -> None:
    """The ``alignpipe`` running a stage must be the repository's: dvc.yaml hashes the
    repository's files as the stage's deps, so any other copy (an image's build-time install,
    another checkout's editable install) would publish outputs of code DVC never saw."""
    running = Path(alignpipe.__file__).resolve().parent
    repo = (root / "alignpipe").resolve()
    if running == repo or not repo.is_dir() or package_hash(running) == package_hash(repo):
        return
    raise ConfigError(
        f"the alignpipe package running this stage ({running}) differs from the repository's ({repo}), "
        f"so the stage would not run the code dvc.yaml tracks. In a container the launcher puts the "
        f"repository first on PYTHONPATH: check runtime.container_args does not override it; on a host, "
        f"install this checkout (`pip install -e {root}`) or run from the checkout your venv was built in"
    )


def run_stage(
    root: Path, stage: str, *, inner: bool = False, profile: str | None = None, source: str | None = None
) -> int:
    set_offline_env()
    ctx = build_context(root, stage, profile, source=source)
    label = f"{stage}@{source}" if source else stage
    if not inner:  # a launcher's inner run is the same stage: one header
        console.header(label, ctx.engine, ctx.profile, get_path(ctx.config, "policy.model_name", None))
    if inner or ctx.launcher == "process":
        check_running_code(root)
        if inner:  # a stage that hands work to a launcher must not do it again from inside it
            os.environ["ALIGNPIPE_INNER"] = "1"
        if ctx.engine == "local":
            set_cpu_env()
        console.quiet_libraries(console.raw_log_path(root, label))
        engine_module(ctx).run(ctx)
        if os.environ.get("ALIGNPIPE_TIMING"):  # benchmarks/: wall and CPU time of the whole stage process
            from alignpipe.timing import record_timing

            record_timing(f"{stage}@{source}" if source else stage, "end")
        return 0
    from alignpipe.launch import get_launcher
    from alignpipe.launch.base import forwarded_env

    launcher = get_launcher(ctx.launcher, ctx.runtime, ctx.params)
    env = {**forwarded_env(), **OFFLINE_ENV, "ALIGNPIPE_ROOT": str(root)}
    code = launcher.run(inner_argv(ctx), stage=stage, workdir=root, env=env)
    if code == 0:
        launcher.check_outputs(list(ctx.outputs.values()))
    else:
        print(
            f"alignpipe: stage '{stage}' failed on the {ctx.launcher} launcher (exit {code})", file=sys.stderr
        )
    return code
