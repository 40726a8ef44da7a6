"""Running a local-engine stage where vLLM is: the pinned NeMo-RL image.

benchmark's ``backend: vllm`` and evaluate's ``heldout.backend: vllm`` (the GPU profiles) need
vLLM, which the image has and a host usually lacks. On such a host the stage hands
``alignpipe run <stage> --inner`` to the launcher the NeMo-RL engine uses (container, Slurm or
Ray), as convert does with NeMo-RL's converter, and checks that its outputs came back.
"""

from __future__ import annotations

import os

from alignpipe.context import StageContext
from alignpipe.errors import AlignpipeError, ConfigError


def run_in_image(ctx: StageContext, knob: str) -> None:
    """Run this stage inside runtime.image; ``knob``: the setting that asked for vLLM (for errors)."""
    from alignpipe.context import OFFLINE_ENV, inner_argv
    from alignpipe.launch import get_launcher
    from alignpipe.launch.base import forwarded_env

    if os.environ.get("ALIGNPIPE_INNER"):
        raise ConfigError(
            f"{knob} is vllm, but vLLM is not installed where the launcher ran this stage: "
            f"runtime.image must be the pipeline's NeMo-RL image (docs/GPU.md §2), which has vLLM"
        )
    if ctx.nemo_rl_launcher in (None, "process"):
        raise ConfigError(
            f"{knob} is vllm, but vLLM is not installed here and runtime.engine="
            f"{ctx.runtime['engine']} / runtime.launcher={ctx.runtime['launcher']} gives no container to run "
            "it in; use hf, or a GPU profile's launcher (container, slurm or ray)"
        )
    label = f"{ctx.name}@{ctx.source}" if ctx.source else ctx.name
    launcher = get_launcher(ctx.nemo_rl_launcher, ctx.runtime, ctx.params)
    env = {**forwarded_env(), **OFFLINE_ENV, "ALIGNPIPE_ROOT": str(ctx.root)}
    code = launcher.run(inner_argv(ctx), stage=label, workdir=ctx.root, env=env)
    if code != 0:
        raise AlignpipeError(f"{label} failed on the {ctx.nemo_rl_launcher} launcher (exit {code})")
    launcher.check_outputs([ctx.output(p.name) for p in ctx.contract.produces])


def launch_script(ctx: StageContext) -> str:
    """The exact launch of the inner run on the NeMo-RL engine's launcher (``alignpipe plan``)."""
    from alignpipe.context import inner_argv
    from alignpipe.launch import get_launcher
    from alignpipe.launch.base import launch_script as script

    label = f"{ctx.name}@{ctx.source}" if ctx.source else ctx.name
    argv = get_launcher(ctx.nemo_rl_launcher, ctx.runtime, ctx.params).command(
        inner_argv(ctx), stage=label, workdir=ctx.root
    )
    return script(
        argv, what=f"{label} via the {ctx.nemo_rl_launcher} launcher (vLLM is in the image)", workdir=ctx.root
    )
