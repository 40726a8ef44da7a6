"""The nemo_rl engine: NeMo-RL v0.7.0's own trainer does the work; this module renders,
launches, and publishes.

``run(ctx)`` (inside the container, via ``alignpipe run <stage> --inner``):

1. render the stage's config (render.py) into ``<scratch>/nemo_rl_config.yaml``;
2. prepare inputs NeMo-RL cannot read directly (NeMo-Gym rows; a Megatron warm start for a
   DTensor-only stage is converted to HF first; a LoRA adapter input, also one in place of
   sft's Megatron checkpoint, is merged with its chain; a Megatron stage's HF weights are named
   by content, as NeMo-RL caches their conversion by path);
3. run the entry script (``python examples/run_<algo>.py --config ...``) with cwd = the
   NeMo-RL checkout, streaming its output; a non-zero exit is the stage's exit code;
4. publish: pick the checkpoint (best by ``checkpointing.metric_name``, else latest),
   copy or convert it into the stage's output (a LoRA run: its PEFT adapter, as
   ``checkpoint_lora``), import TensorBoard metrics into DVCLive,
   add held-out accuracy, write ``artifact.json`` + ``resolved_config.yaml``;
5. delete the scratch dir (only after everything is published).

An interrupted run leaves ``step_N`` checkpoints in the scratch dir, which is keyed by the
run (config + inputs); re-running the stage lets NeMo-RL auto-resume from them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from alignpipe.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, canonical_adapter, is_adapter, merged_dir
from alignpipe.artifacts import RESOLVED_CONFIG, staged_dir, write_manifest, write_text_atomic
from alignpipe.config import get_path
from alignpipe.context import scratch_root
from alignpipe.engines.nemo_rl import convert as CV
from alignpipe.engines.nemo_rl import preflight
from alignpipe.engines.nemo_rl.checkpoints import Choice, select_checkpoint
from alignpipe.engines.nemo_rl.metrics import import_metrics
from alignpipe.engines.nemo_rl.render import (
    PATH_KEYS,
    RunPaths,
    dropped_training_knobs,
    entry_argv,
    render,
    uses_nemo_gym,
)
from alignpipe.errors import AlignpipeError, ConfigError, UnsupportedSetting

NEMO_RL_CONFIG = "nemo_rl_config.yaml"
DEFAULT_NEMO_RL_DIR = "/opt/nemo-rl"
POLICY_STAGES = ("sft", "dpo", "rlvr", "rlhf")

CommandRunner = Callable[[Sequence[str], Path], int]


class NemoRLFailed(AlignpipeError):
    def __init__(self, what: str, code: int):
        super().__init__(what)
        self.code = code


def nemo_rl_dir(ctx) -> Path:
    return Path(os.environ.get("NEMO_RL_DIR") or ctx.runtime.get("nemo_rl_dir") or DEFAULT_NEMO_RL_DIR)


def run_command(argv: Sequence[str], cwd: Path) -> int:
    """Run a NeMo-RL program in the foreground; Ctrl-C/SIGTERM stop it (its process group)."""
    from alignpipe.launch.interrupt import sigterm_as_interrupt
    from alignpipe.launch.process import run_foreground

    print(f"nemo_rl: (cd {cwd} && {' '.join(argv)})", flush=True)
    # `podman/docker stop` sends SIGTERM to this process: pass it on to NeMo-RL's process
    # group (run_foreground stops it on an exception) instead of dying and orphaning Ray.
    with sigterm_as_interrupt():
        return run_foreground(argv, cwd=cwd, env=os.environ)


def render_for(ctx, scratch: Path | None = None) -> dict[str, Any]:
    return render(
        ctx.name,
        ctx.config,
        root=ctx.root,
        scratch=scratch or ctx.scratch_dir,
        consumes_paths=[p.path for p in ctx.contract.consumes],
    )


def to_yaml(cfg: dict[str, Any], header: str = "") -> str:
    return header + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)


def config_header(ctx) -> str:
    return (
        f"# NeMo-RL v0.7.0 config for stage '{ctx.name}' (profile '{ctx.profile}'), rendered by alignpipe\n"
        f"# from stages/{ctx.name}/config/{ctx.profile}.yaml + params.yaml knobs + seed + pipeline paths.\n"
    )


# ----------------------------------------------------------------------------- inputs


def artifact_type(path: Path) -> str | None:
    manifest = Path(path) / "artifact.json"
    if not manifest.is_file():
        return None
    import json

    return json.loads(manifest.read_text()).get("type")


def convert_megatron_inputs(
    cfg: dict[str, Any], paths: RunPaths, runner: CommandRunner, workdir: Path
) -> None:
    """DTensor stages (rm, the RM env) need HF weights; a checkpoint_megatron input is converted first."""
    megatron_policy = bool(get_path(cfg, "policy.megatron_cfg.enabled", False))
    for key in ("policy.model_name", "env.reward_model.model_name"):
        value = get_path(cfg, key)
        if not value or (key == "policy.model_name" and megatron_policy):
            continue
        if artifact_type(Path(value)) != "checkpoint_megatron":
            continue
        out = paths.converted / Path(value).name
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            argv = CV.converter_argv(Path(value), CV.MEGATRON, out)
            code = runner(argv, workdir)
            if code != 0:
                raise NemoRLFailed(f"converting the Megatron input {value} to HF failed (exit {code})", code)
        section = key.rsplit(".", 1)[0]
        node = cfg
        for part in section.split("."):
            node = node[part]
        node["model_name"] = str(out)
        if isinstance(node.get("tokenizer"), dict):
            # The Megatron export may not carry the tokenizer; the artifact does (policy/tokenizer).
            has_tokenizer = (out / "tokenizer_config.json").is_file()
            node["tokenizer"]["name"] = str(out if has_tokenizer else Path(value) / "policy" / "tokenizer")


def published_artifact(path: Path) -> Path | None:
    """The published artifact ``path`` lies in (``models/sft`` for ``models/sft/policy/weights``)."""
    for candidate in (Path(path), *Path(path).parents):
        if (candidate / "artifact.json").is_file():
            return candidate
    return None


def start_from_published_adapter(cfg: dict[str, Any]) -> None:
    """On default_megatron, dpo, rlvr and rlhf start from sft's Megatron checkpoint
    (``checkpointing.pretrained_checkpoint``). When sft trained a LoRA adapter instead (a
    ``checkpoint_lora``: HF PEFT, no Megatron weights), the stage starts from that policy as HF
    weights, its chain merged (``merge_adapter_inputs``), as on DTensor and the local engine."""
    pretrained = (cfg.get("checkpointing") or {}).get("pretrained_checkpoint")
    artifact = published_artifact(Path(pretrained["path"])) if pretrained else None
    if artifact is None or artifact_type(artifact) != "checkpoint_lora":
        return
    del cfg["checkpointing"]["pretrained_checkpoint"]
    cfg["policy"]["model_name"] = str(artifact)
    if isinstance(cfg["policy"].get("tokenizer"), dict):
        cfg["policy"]["tokenizer"]["name"] = str(artifact)  # published with the adapter


def merge_adapter_inputs(ctx, cfg: dict[str, Any], paths: RunPaths) -> None:
    """NeMo-RL loads ``policy.model_name`` (and the RM environment's model) as full HF weights
    only: a LoRA stage's adapter input (a ``checkpoint_lora``) is merged with its chain first,
    as the local engine's trainers do, into the run's scratch dir."""
    from alignpipe.measure.logprobs import LOCAL_DTYPE

    for key in ("policy.model_name", "env.reward_model.model_name"):
        value = get_path(cfg, key)
        if not value or not is_adapter(value):
            continue
        merged = merged_dir(Path(value), ctx.root, paths.converted / "merged", LOCAL_DTYPE)
        print(f"nemo_rl: {key} {value} is a LoRA adapter: merged with its chain -> {merged}")
        section = key.rsplit(".", 1)[0]
        node = cfg
        for part in section.split("."):
            node = node[part]
        node["model_name"] = str(merged)


# Links, under the scratch root, through which Megatron stages name their HF starting weights.
MEGATRON_HF_LINKS = "megatron-hf"


def key_megatron_conversion(ctx, cfg: dict[str, Any], paths: RunPaths) -> None:
    """NeMo-RL converts a Megatron stage's HF ``policy.model_name`` once and caches it by path
    (``<megatron_checkpoint_dir>/model_<path>``), reusing it whatever the directory holds later:
    a new starting model at models/base would train on the old one's weights. So the stage names
    its HF weights through a link keyed by their content (a merged chain: its chain key), which
    NeMo-RL converts once per content, and a LoRA run's adapter names that exact base."""
    if not get_path(cfg, "policy.megatron_cfg.enabled") or get_path(
        cfg, "checkpointing.pretrained_checkpoint"
    ):
        return
    model = Path(cfg["policy"]["model_name"])
    if not model.is_dir():
        return  # a Hub id: NeMo-RL's cache is keyed by the id, as the Hub's files are
    if model.parent == paths.converted / "merged":
        label = f"merged-{model.name}"  # merged_dir's name is already the chain's content key
    else:
        label = f"{model.name}-{ctx.content_hash(model).removesuffix('.dir')[:16]}"
    link = scratch_root(ctx.params) / MEGATRON_HF_LINKS / label
    link.parent.mkdir(parents=True, exist_ok=True)
    staging = link.with_name(f".{label}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    staging.symlink_to(model.resolve(), target_is_directory=True)
    os.replace(staging, link)  # a merged chain is re-made in each run's scratch: point at this one
    cfg["policy"]["model_name"] = str(link)


def write_gym_data(ctx, cfg: dict[str, Any], paths: RunPaths) -> None:
    from alignpipe.engines.nemo_rl.nemo_gym_data import agent_ref, convert_file

    ref = agent_ref(
        get_path(ctx.config, "alignpipe.nemo_gym.default_agent_ref", "responses_api_agents/simple_agent")
    )
    for split in ("train", "validation"):
        src = get_path(ctx.config, f"data.{split}.data_path")
        if not src:
            continue
        count = convert_file(ctx.root / src, paths.gym_data / f"{split}.jsonl", ref)
        print(f"nemo_rl: {count} {split} rows -> {paths.gym_data / f'{split}.jsonl'} (NeMo-Gym format)")


# ----------------------------------------------------------------------------- publish


def _copy_tree_contents(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        target = dst / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target)


def mark_sequence_classifier(hf_dir: Path) -> None:
    """convert_dcp_to_hf.py saves AutoConfig of policy.model_name (a *ForCausalLM config);
    the RM's weights carry a 1-label ``score`` head, so say so for AutoModelFor* loaders."""
    import json

    path = hf_dir / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    archs = config.get("architectures") or []
    config["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification") for a in archs] or archs
    config["num_labels"] = 1
    config.pop("id2label", None)
    config.pop("label2id", None)
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")


def export_checkpoint(
    choice: Choice,
    fmt: str,
    out: Path,
    cfg: dict[str, Any],
    paths: RunPaths,
    runner: CommandRunner,
    workdir: Path,
) -> str:
    """Put the chosen checkpoint into ``out`` as HF files, a PEFT adapter or a Megatron step copy;
    returns which (the manifest's ``format``: hf, peft or megatron_bridge)."""
    policy = choice.path / "policy"
    if fmt == CV.MEGATRON_LORA:
        return export_megatron_lora(choice, out, cfg, paths, runner, workdir)
    if fmt == CV.HF_CONSOLIDATED:
        _copy_tree_contents(policy / "weights" / "model" / "consolidated", out)
        if (policy / "tokenizer").is_dir():
            _copy_tree_contents(policy / "tokenizer", out)
    elif fmt == CV.PEFT:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy2(policy / "weights" / "model" / name, out / name)
        if (policy / "tokenizer").is_dir():
            _copy_tree_contents(policy / "tokenizer", out)
    elif fmt == CV.DCP:
        converted = paths.converted / f"{choice.path.name}-hf"
        shutil.rmtree(converted, ignore_errors=True)  # the converter refuses an existing dir
        code = runner(CV.converter_argv(choice.path, CV.DCP, converted), workdir)
        if code != 0:
            raise NemoRLFailed(f"convert_dcp_to_hf.py failed on {choice.path} (exit {code})", code)
        _copy_tree_contents(converted, out)
    elif fmt == CV.MEGATRON:
        # Kept as NeMo-RL wrote it (a step_N copy without the optimizer state) so the next
        # stage loads it with checkpointing.pretrained_checkpoint and `convert` can export it.
        for name in ("config.yaml", "training_info.json"):
            if (choice.path / name).is_file():
                shutil.copy2(choice.path / name, out / name)
        shutil.copytree(policy / "weights", out / "policy" / "weights")
        if (policy / "tokenizer").is_dir():
            shutil.copytree(policy / "tokenizer", out / "policy" / "tokenizer")
    else:
        raise CV.CheckpointFormatError(f"cannot export checkpoint format '{fmt}'")
    return {CV.PEFT: "peft", CV.MEGATRON: "megatron_bridge"}.get(fmt, "hf")


def export_megatron_lora(
    choice: Choice, out: Path, cfg: dict[str, Any], paths: RunPaths, runner: CommandRunner, workdir: Path
) -> str:
    """A Megatron LoRA run's adapter, through NeMo-RL's convert_lora_to_hf.py with the base it was
    trained on. Over HF weights (NeMo-RL's cached conversion of ``policy.model_name``) the adapter
    alone is published, as HF PEFT, like a DTensor LoRA run's. Over a Megatron checkpoint (sft's,
    via ``pretrained_checkpoint``) there is no HF base for peft to apply it to, so the adapter is
    merged into it and the full HF model is published."""
    over_megatron = bool((cfg.get("checkpointing") or {}).get("pretrained_checkpoint"))
    converted = paths.converted / f"{choice.path.name}-hf"
    shutil.rmtree(converted, ignore_errors=True)  # the converter refuses an existing dir
    argv = CV.lora_converter_argv(
        choice.path,
        converted,
        base_ckpt=CV.megatron_base_checkpoint(cfg),
        hf_model_name=str(cfg["policy"]["model_name"]),
        adapter_only=not over_megatron,
    )
    code = runner(argv, workdir)
    if code != 0:
        raise NemoRLFailed(f"convert_lora_to_hf.py failed on {choice.path} (exit {code})", code)
    if over_megatron:
        _copy_tree_contents(converted, out)
    else:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy2(converted / name, out / name)
    if (choice.path / "policy" / "tokenizer").is_dir():
        _copy_tree_contents(choice.path / "policy" / "tokenizer", out)
    return "hf" if over_megatron else "peft"


def heldout_for(ctx, model_dir: Path) -> dict[str, float] | None:
    """Held-out accuracy of the published policy (an adapter: its chain merged), by the local
    engine's one definition. ``heldout.backend: vllm`` (the GPU profiles) draws the samples with
    vLLM, which the image has; else transformers does. The samples are published beside the
    weights (``heldout_samples.jsonl``), so evaluate reuses them when its settings match."""
    settings = dict(get_path(ctx.config, "alignpipe.heldout", {}) or {})
    if ctx.name not in POLICY_STAGES or not settings.get("enabled", False):
        return None
    from alignpipe.measure import heldout as H

    settings = H.heldout_settings(ctx)
    rows = H.heldout_rows(ctx, settings)
    system = ctx.system_prompt
    if H.drawing_backend(settings) == "vllm":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        completions = H.vllm_completions(ctx, model_dir, rows, settings, system)
    else:
        from alignpipe.measure.logprobs import load_policy

        model, tokenizer = load_policy(model_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        completions = H.heldout_completions(model, tokenizer, rows, settings, system)
        settings = {**settings, "backend": "hf"}  # what drew them
    held = H.HeldoutSamples(rows, completions, H.sampling_key(rows, settings, system), system=system)
    for name, text in H.samples_file(held).items():
        write_text_atomic(model_dir / name, text)
    return H.heldout_accuracy(None, tokenizer, rows, settings, completions=completions)


def adapter_record(ctx, out: Path) -> dict[str, Any]:
    """The published adapter's lineage (as the local engine records it): the policy it applies
    to, by repo-relative path (set in its adapter_config.json) and content hash, and its shape.
    The policy is the rendered ``policy.model_name`` input (or the adapter that replaces sft's
    Megatron checkpoint, ``start_from_published_adapter``), before any merge for NeMo-RL."""
    import json

    start = render_for(ctx)
    start_from_published_adapter(start)
    base = Path(get_path(start, "policy.model_name")).resolve()
    try:
        relative = base.relative_to(ctx.root.resolve()).as_posix()
    except ValueError as e:
        raise ConfigError(
            f"stage '{ctx.name}': policy.model_name {base} is outside the repository, so a LoRA adapter "
            "trained on it could not name its base; start LoRA from a pipeline model (models/...)"
        ) from e
    canonical_adapter(out, base=relative)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    return {
        "applies_to": {"path": relative, "hash": ctx.content_hash(base)},
        "peft_type": config.get("peft_type"),
        "rank": config.get("r"),
        "alpha": config.get("lora_alpha"),
    }


def _port(ctx, types: tuple[str, ...]):
    for port in ctx.contract.produces:
        if port.type in types:
            return port
    raise ConfigError(f"stages/{ctx.name}/stage.toml produces no output of type {' or '.join(types)}")


def publish(
    ctx,
    cfg: dict[str, Any],
    paths: RunPaths,
    *,
    runner: CommandRunner = run_command,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Publish the run's chosen checkpoint and metrics; returns the manifest."""
    workdir = workdir or nemo_rl_dir(ctx)
    ckpt = cfg.get("checkpointing") or {}
    choice = select_checkpoint(
        paths.checkpoints, ckpt.get("metric_name"), bool(ckpt.get("higher_is_better", True))
    )
    fmt = CV.checkpoint_format(choice.path)
    model_port = _port(ctx, ("checkpoint_hf", "checkpoint_megatron"))
    metrics_port = next((p for p in ctx.contract.produces if p.type == "dvclive"), None)
    print(
        f"nemo_rl: publishing {choice.path.name} ({choice.reason}, format {fmt}) -> {ctx.output(model_port.name)}"
    )

    with staged_dir(ctx.output(model_port.name)) as out:
        published = export_checkpoint(choice, fmt, out, cfg, paths, runner, workdir)
        is_hf = published != "megatron_bridge"
        is_lora = published == "peft"
        adapter = adapter_record(ctx, out) if is_lora else None
        if ctx.name == "rm" and is_hf:
            mark_sequence_classifier(out)
        heldout = heldout_for(ctx, out) if is_hf else None
        extra_summary = {"heldout": heldout} if heldout else None
        summary: dict[str, Any] = {}
        if metrics_port is not None:
            with staged_dir(ctx.output(metrics_port.name)) as mdir:
                summary = import_metrics(ctx.name, paths.logs, mdir, extra_summary, cfg)
                write_text_atomic(mdir / RESOLVED_CONFIG, ctx.resolved_config_yaml())
        elif heldout:
            summary = {"heldout": heldout}
        rendered = to_yaml(cfg, config_header(ctx))
        write_text_atomic(out / RESOLVED_CONFIG, ctx.resolved_config_yaml())
        write_text_atomic(out / NEMO_RL_CONFIG, rendered)
        manifest = write_manifest(
            out,
            type="checkpoint_lora" if is_lora else "checkpoint_hf" if is_hf else "checkpoint_megatron",
            format=published,
            stage=ctx.name,
            engine="nemo_rl",
            inputs=ctx.input_hashes,
            metrics=summary,
            image=ctx.runtime.get("image"),
            source_model=ctx.source_model,
            system_prompt=ctx.system_prompt,
            extra={
                **({"adapter": adapter} if adapter else {}),
                "nemo_rl": {
                    "version": "0.7.0",
                    "checkpoint": choice.path.name,
                    "step": choice.step,
                    "selected_by": choice.reason,
                    "checkpoint_format": fmt,
                    "entry": entry_argv(ctx.name, cfg, paths.config)[1:],
                },
            },
        )
    return manifest


# ----------------------------------------------------------------------------- run / plan


def prepare(ctx, paths: RunPaths, runner: CommandRunner, workdir: Path) -> dict[str, Any]:
    cfg = render_for(ctx, paths.scratch)
    paths.scratch.mkdir(parents=True, exist_ok=True)
    convert_megatron_inputs(cfg, paths, runner, workdir)
    start_from_published_adapter(cfg)
    merge_adapter_inputs(ctx, cfg, paths)
    key_megatron_conversion(ctx, cfg, paths)
    if uses_nemo_gym(cfg):
        write_gym_data(ctx, cfg, paths)
    write_text_atomic(paths.config, to_yaml(cfg, config_header(ctx)))
    return cfg


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
    """``<stage>.nemo_rl.yaml`` (the rendered config) and ``<stage>.launch.sh`` (container + entry)."""
    from alignpipe.context import OFFLINE_ENV, inner_argv
    from alignpipe.launch import get_launcher
    from alignpipe.launch.base import shell_join

    paths = RunPaths(ctx.scratch_dir)
    cfg = render_for(ctx, paths.scratch)
    entry = entry_argv(ctx.name, cfg, paths.config)
    launcher_name = ctx.launcher
    launcher = get_launcher(launcher_name, ctx.runtime, ctx.params)
    outer = launcher.command(inner_argv(ctx), stage=ctx.name, workdir=ctx.root)

    pinned_env = {**OFFLINE_ENV, "ALIGNPIPE_ROOT": str(ctx.root)}
    script = (
        "#!/usr/bin/env bash\n"
        f"# Stage '{ctx.name}', profile '{ctx.profile}', engine nemo_rl, launcher {launcher_name}.\n"
        f"# The {launcher_name} launcher runs `{shell_join(inner_argv(ctx))}` inside runtime.image; that\n"
        f"# writes the config below to {paths.config} and runs, with cwd {nemo_rl_dir(ctx)}:\n"
        f"#   {shell_join(entry)}\n"
        + (
            f"# then exports the best checkpoint's LoRA adapter with {CV.MCORE_PYTHON} {CV.LORA_TO_HF}\n"
            "# (alone, as HF PEFT; merged when its base is sft's Megatron checkpoint) and publishes it,\n"
            "# the metrics and artifact.json.\n"
            if get_path(cfg, "policy.megatron_cfg.enabled")
            and get_path(cfg, "policy.megatron_cfg.peft.enabled")
            else "# then publishes the best checkpoint, metrics and artifact.json.\n"
        )
        + "set -euo pipefail\n"
        f"cd {shell_join([str(ctx.root)])}\n"
        # What `alignpipe run` sets before launching; the launcher forwards them by name.
        + "".join(f"export {k}={shell_join([v])}\n" for k, v in sorted(pinned_env.items()))
        + f"{shell_join(outer)}\n"
    )
    return {f"{ctx.name}.nemo_rl.yaml": to_yaml(cfg, config_header(ctx)), f"{ctx.name}.launch.sh": script}


# Keys the renderer rewrites, for docs/tests.
__all__ = ["PATH_KEYS", "plan", "publish", "run"]
