"""Render a stage's profile into the exact config NeMo-RL v0.7.0's entry script reads.

The profile (``stages/<stage>/config/<profile>.yaml`` + params.yaml knobs + seed) is
already in NeMo-RL's schema; rendering only adds what belongs to this pipeline run:

* repository paths made absolute (the repository is mounted at the same path in the
  container, and NeMo-RL runs with cwd ``/opt/nemo-rl``);
* ``checkpointing.checkpoint_dir`` = the run's scratch dir (outside DVC outs, keyed by the
  run) so NeMo-RL's auto-resume picks up ``step_N`` after an interruption;
* ``logger.log_dir`` under the same scratch dir (NeMo-RL appends ``exp_NNN``), TensorBoard
  on so the engine can import the metrics into DVCLive;
* for NeMo-Gym runs, data paths pointing at the Gym-format copies the engine writes;
* with ``alignpipe.tools`` on (rlvr), multi-turn rollouts: ``grpo.max_rollout_turns`` from it,
  the verifier's task routed to alignpipe's tool environment (``env.alignpipe_tools``: the
  toolset, the policy's tokenizer section, the turn limit and malformed penalty), and the tool
  schemas in ``policy.tokenizer.chat_template_kwargs.tools`` so the prompt lists them;
* the ``alignpipe:`` section dropped (NeMo-RL's pydantic MasterConfig allows extra keys,
  but they do not belong in a config handed to another program).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from alignpipe.adapters import wildcard_match
from alignpipe.config import get_path
from alignpipe.errors import ConfigError
from alignpipe.settings import AlignpipeSettings, from_config
from alignpipe.tools import build_toolset

# Entry scripts (relative to the NeMo-RL checkout, /opt/nemo-rl in the image).
RUN_GRPO = "examples/run_grpo.py"
RUN_GRPO_NEMO_GYM = "examples/nemo_gym/run_grpo_nemo_gym.py"
ENTRY_SCRIPTS = {
    "sft": "examples/run_sft.py",
    "rm": "examples/run_rm.py",
    "dpo": "examples/run_dpo.py",
    "rlvr": RUN_GRPO,
    "rlhf": RUN_GRPO,
}
# Sections each entry script's MasterConfig needs (reference: nemo-rl.md §1).
REQUIRED_SECTIONS = {
    "sft": ("policy", "data", "sft", "logger", "cluster", "checkpointing"),
    "rm": ("policy", "data", "rm", "logger", "cluster", "checkpointing"),
    "dpo": ("policy", "data", "dpo", "logger", "cluster", "checkpointing"),
    "rlvr": ("policy", "loss_fn", "env", "data", "grpo", "logger", "cluster", "checkpointing"),
    "rlhf": ("policy", "loss_fn", "env", "data", "grpo", "logger", "cluster", "checkpointing"),
}
# The custom environments alignpipe registers inside NeMo-RL (environment.py).
VERIFIER_ENV = "alignpipe_verifier"
TOOLS_ENV = "alignpipe_tools"
GRPO_DRIVER_MODULE = "alignpipe.engines.nemo_rl.grpo_driver"
# Keys holding model/checkpoint paths that may name a pipeline artifact.
PATH_KEYS = (
    "policy.model_name",
    "policy.tokenizer.name",
    "env.reward_model.model_name",
    "env.reward_model.tokenizer.name",
    "env.reward_model.checkpoint_path",
    "checkpointing.pretrained_checkpoint.path",
)
DATA_SPLITS = ("train", "validation")


@dataclass(frozen=True)
class RunPaths:
    """Where one run's NeMo-RL state lives (all under the stage's scratch dir)."""

    scratch: Path

    @property
    def checkpoints(self) -> Path:
        return self.scratch / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.scratch / "logs"

    @property
    def config(self) -> Path:
        return self.scratch / "nemo_rl_config.yaml"

    @property
    def gym_data(self) -> Path:
        return self.scratch / "nemo_gym_data"

    @property
    def converted(self) -> Path:
        return self.scratch / "converted"


# alignpipe.reward_shaping options that change rewards when set (alignpipe.rl.shaping).
_SHAPING_ACTIVE = ("format_penalty", "length_penalty", "clip")


def dropped_training_knobs(stage: str, cfg: dict[str, Any]) -> list[str]:
    """Settings that change what the local engine trains but that NeMo-RL v0.7.0 would not
    honour: ``alignpipe:`` knobs rendering drops, and the system prompt file, which its SFT and
    preference processors never read (only the GRPO ones do). One line each, with what to do."""
    problems = []
    settings = from_config(cfg, f"stage '{stage}' profile")
    shaping = settings.reward_shaping
    active = {k: getattr(shaping, k) for k in _SHAPING_ACTIVE if getattr(shaping, k) not in (None, 0, 0.0)}
    if active:
        problems.append(
            f"alignpipe.reward_shaping {active} shapes rewards on the local engine only; NeMo-RL's own are "
            "grpo.reward_shaping (DAPO overlong length penalty) and grpo.reward_scaling (clamp and linear "
            "map): use those, or set these options to 0/null"
        )
    clip = settings.reward_clip
    if stage == "rlhf" and clip and any(bound is not None for bound in clip):
        problems.append(
            f"alignpipe.reward_clip={list(clip)} clips reward-model scores on the local engine only; NeMo-RL's "
            "reward-model environment passes them unclipped: use grpo.reward_scaling (source_min/source_max "
            "clamp), or set alignpipe.reward_clip: null"
        )
    problems += lora_problems(stage, cfg)
    if stage in ("sft", "rm", "dpo") and get_path(cfg, "data.default.system_prompt_file"):
        problems.append(
            f"data.default.system_prompt_file={get_path(cfg, 'data.default.system_prompt_file')!r}: NeMo-RL v0.7.0's "
            f"{'sft_processor' if stage == 'sft' else 'preference_preprocessor'} ignores it (the local engine "
            "prepends it); put the system turn in the data, or set the key to null"
        )
    return problems


def lm_head_adapted(cfg: dict[str, Any]) -> bool:
    """Whether Automodel would put the DTensor LoRA adapter on ``lm_head`` too (its selection
    rules, as ``alignpipe.engines.local.lora.target_modules`` applies them)."""
    lora = get_path(cfg, "policy.dtensor_cfg.lora_cfg", {}) or {}
    targets = list(lora.get("target_modules") or [])
    excluded = list(lora.get("exclude_modules") or [])
    if lora.get("match_all_linear"):
        return True
    if targets:
        return any(p == "lm_head" or wildcard_match(p, "lm_head") for p in targets)
    if excluded:  # every linear layer but these
        return not any(p == "lm_head" or wildcard_match(p, "lm_head") for p in excluded)
    return False  # nothing named: '*_proj'


def megatron_output_layer_adapted(cfg: dict[str, Any]) -> bool:
    """Whether Megatron-Bridge's LoRA would adapt ``output_layer`` (the lm_head): NeMo-RL passes
    ``peft.target_modules`` as given, and an empty list means every linear layer but
    ``exclude_modules`` (megatron.bridge.peft.module_matcher; ``*`` spans anything there)."""
    peft = get_path(cfg, "policy.megatron_cfg.peft", {}) or {}

    def names_output_layer(pattern: str) -> bool:
        regex = pattern.replace("*", "(.*)")  # megatron.bridge.peft.utils.wildcard_match: unescaped
        return pattern == "output_layer" or any(
            re.fullmatch(regex, n) for n in ("output_layer", "module.output_layer")
        )

    targets = list(peft.get("target_modules") or [])
    if targets:
        return any(names_output_layer(p) for p in targets)
    return not any(names_output_layer(p) for p in peft.get("exclude_modules") or [])


# Hugging Face projection names a Megatron peft target_modules would match nothing with, and the
# fused Megatron layer each lives in (megatron.bridge.models.llama's mapping).
MEGATRON_LAYER_OF = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
    "*_proj": "linear_qkv, linear_proj, linear_fc1, linear_fc2",
}  # fmt: skip


def lora_problems(stage: str, cfg: dict[str, Any]) -> list[str]:
    """LoRA keys NeMo-RL v0.7.0 would ignore (the other backend's) or refuse at start-up, and
    adapters alignpipe's engines could not train alike."""
    lora = bool(get_path(cfg, "policy.dtensor_cfg.lora_cfg.enabled"))
    peft = bool(get_path(cfg, "policy.megatron_cfg.peft.enabled"))
    megatron = bool(get_path(cfg, "policy.megatron_cfg.enabled"))
    problems = []
    if lora and megatron and not peft:
        problems.append(
            "policy.dtensor_cfg.lora_cfg.enabled=true with the Megatron backend: NeMo-RL reads LoRA from "
            "policy.megatron_cfg.peft there; set policy.megatron_cfg.peft.enabled=true instead"
        )
    if peft and not megatron:
        problems.append(
            "policy.megatron_cfg.peft.enabled=true with the DTensor backend: NeMo-RL reads LoRA from "
            "policy.dtensor_cfg.lora_cfg there; set policy.dtensor_cfg.lora_cfg.enabled=true instead"
        )
    if lora and not megatron and not get_path(cfg, "policy.dtensor_cfg._v2"):
        problems.append(
            "policy.dtensor_cfg.lora_cfg.enabled=true needs policy.dtensor_cfg._v2: true (NeMo-RL's "
            f"DTensorPolicyWorker V1 asserts 'LoRA is not supported'): -S '+{stage}.policy.dtensor_cfg._v2=true'"
        )
    tp = int(get_path(cfg, "policy.dtensor_cfg.tensor_parallel_size", 1) or 1)
    if lora and tp > 1 and get_path(cfg, "policy.dtensor_cfg.lora_cfg.use_triton"):
        problems.append(
            f"policy.dtensor_cfg.lora_cfg.use_triton=true with tensor_parallel_size={tp}: NeMo-RL asserts "
            "Triton LoRA needs tensor_parallel_size 1; set use_triton: false"
        )
    if lora and not megatron and lm_head_adapted(cfg):
        problems.append(
            "policy.dtensor_cfg.lora_cfg adapts the lm_head (match_all_linear: true, or a target_modules "
            "pattern matching 'lm_head'): the local engine cannot train that adapter (TRL reads "
            "lm_head.weight directly), and on a model with tied embeddings peft merges it into the shared "
            "embedding. Use target_modules ['*_proj'] with match_all_linear: false"
        )
    if peft and megatron and megatron_output_layer_adapted(cfg):
        problems.append(
            "policy.megatron_cfg.peft adapts output_layer (the lm_head): an empty target_modules means every "
            "linear layer to Megatron-Bridge, and a pattern may match it. The local engine cannot train that "
            "adapter, and peft merges it into tied embeddings. Use target_modules [linear_qkv, linear_proj, "
            "linear_fc1, linear_fc2] (every projection, as '*_proj' on DTensor)"
        )
    if peft and megatron:
        for pattern in get_path(cfg, "policy.megatron_cfg.peft.target_modules", []) or []:
            hf_name = str(pattern).rsplit(".", 1)[-1]
            if hf_name in MEGATRON_LAYER_OF:
                problems.append(
                    f"policy.megatron_cfg.peft.target_modules '{pattern}' is a Hugging Face module name, which "
                    f"matches nothing in Megatron's model: Megatron-Bridge names that layer "
                    f"{MEGATRON_LAYER_OF[hf_name]}"
                )
    if stage == "rm" and (lora or peft):
        problems.append(
            "LoRA on the reward model: NeMo-RL freezes every base weight under LoRA, the freshly "
            "initialised score head included, so it could not learn to score; train rm with full weights"
        )
    return problems


def uses_nemo_gym(cfg: dict[str, Any]) -> bool:
    return bool(get_path(cfg, "env.should_use_nemo_gym", False))


def env_names(cfg: dict[str, Any]) -> set[str]:
    """Environments the data section asks for (NeMo-RL's ``extract_necessary_env_names``)."""
    names = set()
    default = get_path(cfg, "data.default.env_name")
    if default:
        names.add(default)
    for split in DATA_SPLITS:
        entries = get_path(cfg, f"data.{split}")
        for entry in entries if isinstance(entries, list) else [entries]:
            if isinstance(entry, dict) and entry.get("env_name"):
                names.add(entry["env_name"])
    return names


def needs_registration(cfg: dict[str, Any]) -> bool:
    """The config names alignpipe's environment or one of its processors, which NeMo-RL finds
    only after ``environment.register()`` (grpo_driver) has run in the driver."""
    processors = {get_path(cfg, "data.default.processor")}
    for split in DATA_SPLITS:
        entries = get_path(cfg, f"data.{split}")
        for entry in entries if isinstance(entries, list) else [entries]:
            if isinstance(entry, dict):
                processors.add(entry.get("processor"))
    return bool(env_names(cfg) & {VERIFIER_ENV, TOOLS_ENV}) or any(
        str(p).startswith("alignpipe_") for p in processors if p
    )


def route_to_tools(stage: str, cfg: dict[str, Any], settings: AlignpipeSettings, root: Path) -> None:
    """With ``alignpipe.tools`` naming tools, make ``cfg`` (rendered, paths absolute) roll out
    multi-turn through alignpipe's tool environment. Every tool is built here (a user tool
    imported, in its sandbox too), so a bad one stops the stage before anything runs."""
    tools = settings.tools
    if not tools.enabled:
        return
    where = f"stage '{stage}' profile alignpipe.tools"
    if stage != "rlvr":
        raise ConfigError(f"{where}: tools are for rlvr rollouts; stage '{stage}' has none (set tools: [])")
    if uses_nemo_gym(cfg):
        raise ConfigError(
            f"{where}: a NeMo-Gym run gets its tools from its Gym agent and resources servers, not from "
            "alignpipe.tools; set alignpipe.tools.tools: [] or use the default profile"
        )
    toolset = build_toolset(tools.toolset_config(), where=where, repo=root)
    turns = get_path(cfg, "grpo.max_rollout_turns", 1)
    if turns not in (1, tools.max_rollout_turns):
        raise ConfigError(
            f"stage '{stage}': grpo.max_rollout_turns is {turns} but alignpipe.tools.max_rollout_turns is "
            f"{tools.max_rollout_turns}; with tools on, alignpipe.tools.max_rollout_turns sets it: set "
            f"grpo.max_rollout_turns to 1 or to {tools.max_rollout_turns}"
        )
    cfg["grpo"]["max_rollout_turns"] = tools.max_rollout_turns
    data = cfg.get("data") or {}
    entries = [data.get("default")] + [e for split in DATA_SPLITS for e in _entries(data.get(split))]
    for entry in entries:
        if isinstance(entry, dict) and entry.get("env_name") == VERIFIER_ENV:
            entry["env_name"] = TOOLS_ENV
    if TOOLS_ENV not in env_names(cfg):
        raise ConfigError(
            f"{where}: tools need the task scored by {VERIFIER_ENV}, which the tool environment stands in "
            f"for; data names {sorted(env_names(cfg))}"
        )
    tokenizer = cfg["policy"].setdefault("tokenizer", {})
    tokenizer["chat_template_kwargs"] = {
        **(tokenizer.get("chat_template_kwargs") or {}),
        "tools": toolset.schemas(),
    }
    env = cfg.setdefault("env", {})
    env[TOOLS_ENV] = {
        **(env.pop(VERIFIER_ENV, None) or {}),
        "tokenizer": copy.deepcopy(tokenizer),
        "toolset": tools.toolset_config(),
        "repo": str(root),  # user tools' modules are imported from its tools/
        "max_rollout_turns": tools.max_rollout_turns,
        "malformed_penalty": tools.malformed_penalty,
    }


def _entries(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def entry_script(stage: str, cfg: dict[str, Any]) -> str:
    if stage not in ENTRY_SCRIPTS:
        raise ConfigError(f"stage '{stage}' has no NeMo-RL entry script (known: {', '.join(ENTRY_SCRIPTS)})")
    if stage in ("rlvr", "rlhf") and uses_nemo_gym(cfg):
        return RUN_GRPO_NEMO_GYM
    return ENTRY_SCRIPTS[stage]


def entry_argv(stage: str, cfg: dict[str, Any], config_path: Path, python: str = "python") -> list[str]:
    """The command run with cwd = the NeMo-RL checkout.

    The image's project venv (/opt/nemo_rl_venv, first on PATH) is what ``uv run`` would use;
    NeMo-RL starts each Ray worker in its own prefetched venv (vLLM, Megatron), so plain
    ``python`` runs the entry script as upstream does, without uv writing to /opt. GRPO with alignpipe's
    verifier env goes through a small driver that registers the env, then runs
    examples/run_grpo.py itself unchanged.
    """
    script = entry_script(stage, cfg)
    if script == RUN_GRPO and needs_registration(cfg):
        return [python, "-m", GRPO_DRIVER_MODULE, "--entry", script, "--config", str(config_path)]
    return [python, script, "--config", str(config_path)]


def _artifact_prefixes(root: Path, consumes_paths: list[str]) -> list[str]:
    return sorted({p.rstrip("/") for p in consumes_paths}, key=len, reverse=True)


def absolutize(value: Any, root: Path, prefixes: list[str]) -> Any:
    """A repository-relative path (``models/sft``, ``data/prepared/...``) made absolute.

    Hugging Face ids (``meta-llama/Llama-3.2-1B-Instruct``) look like relative paths too, so
    only values under one of the stage's declared inputs (stage.toml ``consumes``) or that
    exist in the repository are rewritten.
    """
    if not isinstance(value, str) or not value or value.startswith(("/", "${")):
        return value
    if any(value == p or value.startswith(p + "/") for p in prefixes) or (root / value).exists():
        return str(root / value)
    return value


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    node = cfg
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def render(
    stage: str,
    config: dict[str, Any],
    *,
    root: Path,
    scratch: Path,
    consumes_paths: list[str],
) -> dict[str, Any]:
    """The complete NeMo-RL config for this run (a new dict; ``config`` is not modified)."""
    cfg = copy.deepcopy(config)
    settings = from_config(cfg, f"stage '{stage}' profile")
    cfg.pop("alignpipe", None)
    missing = [s for s in REQUIRED_SECTIONS.get(stage, ()) if s not in cfg]
    if missing:
        raise ConfigError(
            f"stage '{stage}': the profile lacks the section(s) {', '.join(missing)} that "
            f"{ENTRY_SCRIPTS.get(stage, 'the entry script')} requires (NeMo-RL v0.7.0 MasterConfig); "
            f"add them to stages/{stage}/config/<profile>.yaml"
        )
    paths = RunPaths(scratch)
    prefixes = _artifact_prefixes(root, consumes_paths)

    for key in PATH_KEYS:
        value = get_path(cfg, key)
        if value is not None:
            _set(cfg, key, absolutize(value, root, prefixes))

    gym = uses_nemo_gym(cfg)
    data = cfg.get("data") or {}
    for split in DATA_SPLITS:
        entries = data.get(split)
        for entry in entries if isinstance(entries, list) else [entries]:
            if not isinstance(entry, dict) or not entry.get("data_path"):
                continue
            if gym:
                # run() writes the Gym-format copy here (nemo_gym_data.py).
                entry["data_path"] = str(paths.gym_data / f"{split}.jsonl")
            else:
                entry["data_path"] = absolutize(entry["data_path"], root, prefixes)

    if "checkpointing" in cfg:
        cfg["checkpointing"]["checkpoint_dir"] = str(paths.checkpoints)
    logger = cfg.setdefault("logger", {})
    logger["log_dir"] = str(paths.logs)
    logger["tensorboard_enabled"] = True
    route_to_tools(stage, cfg, settings, root)
    return cfg


NEMO_RL_CONFIG = "nemo_rl_config.yaml"


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
