"""Running a stage: resolve its context, ask it where it runs, and run or launch it there.

``alignpipe run <stage>`` (what dvc.yaml calls) either launches the stage's *inner* command
(``--inner``) through a launcher, or runs the engine right here. The context decides which
(``StageContext.launcher_for``: the configured launcher, or the NeMo-RL image for a local
stage that needs it). ``launch_plan`` builds the one ``LaunchPlan`` that ``run`` executes and
``plan`` prints; ``launch`` below is the only place anything is launched.
"""

from __future__ import annotations

import contextlib
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
from alignpipe.launch.base import forwarded_env
from alignpipe.launch.plan import LaunchPlan


def engine_module(ctx: StageContext):
    """The module that runs this stage on its engine: ``run(ctx)``."""
    if ctx.engine == "nemo_rl":
        return importlib.import_module("alignpipe.engines.nemo_rl.engine")
    try:
        return importlib.import_module(f"alignpipe.engines.local.stages.{ctx.name}")
    except ModuleNotFoundError as e:
        if e.name == f"alignpipe.engines.local.stages.{ctx.name}":
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


def needs_image(ctx: StageContext, module=None):
    """The stage's reason to run inside runtime.image (its engine module's ``needs_image``), if any."""
    module = module or engine_module(ctx)
    return module.needs_image(ctx) if hasattr(module, "needs_image") else None


def launch_plan(ctx: StageContext, module=None, *, planning: bool = False) -> LaunchPlan:
    """The stage's one launch: where the context sends it, the inner command, the environment
    every launched stage gets. ``run`` executes it, ``plan`` prints it. ``planning``: where the
    run goes cannot be decided yet (an input not made) or would be refused, and ``plan`` shows
    the configured launcher with the reason instead of failing."""
    from alignpipe.launch import get_launcher

    try:
        need = needs_image(ctx, module)
        name, undecided = ctx.launcher_for(need) or "process", ""
    except ConfigError as e:
        if not planning:
            raise
        need, name = None, ctx.launcher
        undecided = " ".join(f"Where it runs is decided at run time; now: {e}".split())
    what = f"Stage '{ctx.label}', profile '{ctx.profile}', engine {ctx.engine}, via the {name} launcher"
    pinned = {**OFFLINE_ENV, "ALIGNPIPE_ROOT": str(ctx.root)}
    return LaunchPlan(
        launcher=get_launcher(name, ctx.runtime, ctx.params),
        argv=tuple(inner_argv(ctx)),
        env={**forwarded_env(), **pinned},
        pinned=frozenset(pinned),
        label=ctx.label,
        workdir=ctx.root,
        outputs=tuple(ctx.outputs.values()),
        notes=(what + (f" ({need.needs} is in the image)." if need is not None else "."),)
        + ((undecided,) if undecided else ()),
    )


def launch(plan: LaunchPlan) -> int:
    """Run ``plan`` through its launcher and check its outputs came back. The one place a
    stage is launched."""
    code = plan.run()
    if code != 0:
        print(
            f"alignpipe: stage '{plan.label}' failed on the {plan.launcher.name} launcher (exit {code})",
            file=sys.stderr,
        )
    return code


def run_stage(
    root: Path, stage: str, *, inner: bool = False, profile: str | None = None, source: str | None = None
) -> int:
    set_offline_env()
    ctx = build_context(root, stage, profile, source=source)
    if not inner:  # a launcher's inner run is the same stage: one header
        console.header(ctx.label, ctx.engine, ctx.profile, get_path(ctx.config, "policy.model_name", None))
    module = engine_module(ctx)
    environment: dict[str, str] = {}
    if inner:
        ctx.launcher_for(needs_image(ctx, module), inner=True)  # refuses a need this place cannot meet
    else:
        plan = launch_plan(ctx, module)
        if not plan.here:
            return launch(plan)
        environment = dict(plan.env)  # the process launcher's job is this process
    with _environment(environment):
        check_running_code(root)
        if ctx.engine == "local":
            set_cpu_env()
            from alignpipe.engines.local.stages import skip_transformers_optional_imports

            skip_transformers_optional_imports()
        console.quiet_libraries(console.raw_log_path(root, ctx.label))
        module.run(ctx)
        if os.environ.get("ALIGNPIPE_TIMING"):  # benchmarks/: wall and CPU time of the whole stage process
            from alignpipe.timing import record_timing

            record_timing(ctx.label, "end")
    return 0


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``env`` in this process's environment for the stage's run, and what was there before
    afterwards: a caller that runs a stage in-process (a test, a notebook) keeps its own."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
