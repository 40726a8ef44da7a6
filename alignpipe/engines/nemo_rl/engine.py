"""The nemo_rl engine: NeMo-RL v0.7.0's own trainer does the work; this module runs a stage
(``run``) and shows what it would run (``plan``).

``run(ctx)`` (inside the container, via ``alignpipe run <stage> --inner``):

1. render the stage's config (render.py) into ``<scratch>/nemo_rl_config.yaml``;
2. prepare inputs NeMo-RL cannot read directly (inputs.py: NeMo-Gym rows; a Megatron warm start for a
   DTensor-only stage is converted to HF first; a LoRA adapter input, also one in place of
   sft's Megatron checkpoint, is merged with its chain; a Megatron stage's HF weights are named
   by content, as NeMo-RL caches their conversion by path);
3. run the entry script (``python examples/run_<algo>.py --config ...``) with cwd = the
   NeMo-RL checkout, streaming its output; a non-zero exit is the stage's exit code;
4. publish (publish.py): pick the checkpoint (best by ``checkpointing.metric_name``, else latest),
   copy or convert it into the stage's output (a LoRA run: its PEFT adapter, as
   ``checkpoint_lora``), import TensorBoard metrics into DVCLive,
   add held-out accuracy, write ``artifact.json`` + ``resolved_config.yaml``;
5. delete the scratch dir (only after everything is published).

An interrupted run leaves ``step_N`` checkpoints in the scratch dir, which is keyed by the
run (config + inputs); re-running the stage lets NeMo-RL auto-resume from them.
"""

from __future__ import annotations

import shutil

from alignpipe.config import get_path
from alignpipe.context import inner_argv
from alignpipe.engines.nemo_rl import convert as CV
from alignpipe.engines.nemo_rl import preflight
from alignpipe.engines.nemo_rl.inputs import prepare
from alignpipe.engines.nemo_rl.programs import CommandRunner, nemo_rl_dir, run_command
from alignpipe.engines.nemo_rl.publish import publish
from alignpipe.engines.nemo_rl.render import (
    RunPaths,
    config_header,
    dropped_training_knobs,
    entry_argv,
    render_for,
    to_yaml,
)
from alignpipe.errors import ConfigError, UnsupportedSetting


def run(ctx, *, runner: CommandRunner = run_command) -> None:
    dropped = dropped_training_knobs(ctx.name, ctx.config)
    if dropped:
        raise UnsupportedSetting(
            f"stage '{ctx.name}' (profile '{ctx.profile}') on the nemo_rl engine:\n  - "
            + "\n  - ".join(dropped)
        )
    workdir = nemo_rl_dir(ctx)
    if not (workdir / "examples").is_dir():
        raise ConfigError(
            f"NeMo-RL checkout not found at {workdir} (runtime.nemo_rl_dir). The nemo_rl engine runs "
            f"inside the NeMo-RL image (runtime.image, built from the repository's Dockerfile); "
            f"use the container launcher, or the tiny profile for the CPU engine."
        )
    paths = RunPaths(ctx.scratch_dir)
    cfg = prepare(ctx, paths, runner, workdir)
    if preflight.nemo_rl_source(ctx) is not None:  # always inside the image (runtime.nemo_rl_dir)
        print(preflight.require_valid(ctx, cfg).text().splitlines()[0], flush=True)
    resumed = sorted(p.name for p in paths.checkpoints.glob("step_*")) if paths.checkpoints.is_dir() else []
    if resumed:
        print(f"nemo_rl: resuming from {resumed[-1]} in {paths.checkpoints} (NeMo-RL auto-resume)")
    argv = entry_argv(ctx.name, cfg, paths.config)
    code = runner(argv, workdir)
    if code != 0:
        import sys

        print(
            f"alignpipe: stage '{ctx.name}': {' '.join(argv[1:3])} exited with {code}; checkpoints so far "
            f"stay in {paths.checkpoints} and the next run of this stage resumes from them",
            file=sys.stderr,
        )
        raise SystemExit(code)  # the trainer's exit code is the stage's
    publish(ctx, cfg, paths, runner=runner, workdir=workdir)
    shutil.rmtree(paths.scratch, ignore_errors=True)


def plan(ctx) -> dict[str, str]:
    """``<stage>.nemo_rl.yaml``: the rendered config, headed by what the inner run does with it.
    The launch that gets it there is the stage's launch plan (alignpipe.stage.launch_plan)."""
    from alignpipe.launch.base import shell_join

    paths = RunPaths(ctx.scratch_dir)
    cfg = render_for(ctx, paths.scratch)
    lora = get_path(cfg, "policy.megatron_cfg.enabled") and get_path(cfg, "policy.megatron_cfg.peft.enabled")
    steps = (
        f"# `{shell_join(inner_argv(ctx))}` writes this config to\n# {paths.config}\n"
        f"# and runs, with cwd {nemo_rl_dir(ctx)}:\n"
        f"#   {shell_join(entry_argv(ctx.name, cfg, paths.config))}\n"
        + (
            f"# then exports the best checkpoint's LoRA adapter with {CV.MCORE_PYTHON} {CV.LORA_TO_HF}\n"
            "# (alone, as HF PEFT; merged when its base is sft's Megatron checkpoint) and publishes it,\n"
            "# the metrics and artifact.json.\n"
            if lora
            else "# then publishes the best checkpoint, metrics and artifact.json.\n"
        )
    )
    return {f"{ctx.name}.nemo_rl.yaml": to_yaml(cfg, config_header(ctx) + steps)}


__all__ = ["plan", "run"]
