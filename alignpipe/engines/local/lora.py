"""LoRA on the local engine: NeMo-RL's ``policy.dtensor_cfg.lora_cfg`` as a peft adapter.

NeMo-RL v0.7.0 hands ``lora_cfg`` to NeMo Automodel (``nemo_automodel.components._peft.lora``,
0.7.0), so its semantics are Automodel's, and this module reproduces them with peft
(tests/test_lora.py runs Automodel's own code beside it):

| lora_cfg key       | Automodel                                            | here (peft ``LoraConfig``)              |
|--------------------|------------------------------------------------------|-----------------------------------------|
| target_modules     | wildcard patterns over full module names (``*_proj``) | the matched names, listed exactly        |
| exclude_modules    | every linear layer except these                       | the matched names, listed exactly        |
| match_all_linear   | every ``nn.Linear``, the lm_head included             | refused: TRL never trains an lm_head adapter |
| dim, alpha         | ``lora_B(lora_A(x)) * alpha / dim``                   | ``r``, ``lora_alpha`` (same scale)       |
| dropout, position  | on the input (pre) or on the adapter's output (post) | ``lora_dropout`` is pre; post needs 0.0  |
| lora_A_init        | ``xavier``: xavier-normal; else kaiming-uniform(a=√5) | the same draw on each ``lora_A``         |
| use_triton         | a Triton kernel for the product (GPU; in float32 not bit-equal, benchmarks/lora.md) | the plain product |

Every base weight is frozen and ``lora_B`` starts at zero, so the adapted policy starts equal to
its base. A trainer given the adapted model uses the base with the adapter disabled as its
reference (TRL's DPO and GRPO do this for a PEFT model): no second copy of the weights.
Stages that start from an adapter load its chain merged (``full_policy_dir``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from alignpipe.adapters import merged_dir, wildcard_match
from alignpipe.config import get_path
from alignpipe.context import StageContext, scratch_root
from alignpipe.engines.local.nemo_rl_keys import ProfileKeys, config_file
from alignpipe.errors import UnsupportedSetting

LORA_KEY = "policy.dtensor_cfg.lora_cfg"
# Stages that train a LoRA adapter (NeMo-RL v0.7.0 trains these with LoRA too).
LORA_STAGES = ("sft", "dpo", "rlvr", "rlhf")
# Why rm has no LoRA: Automodel freezes every base weight, and a reward model's score head is
# new (randomly initialised), so a LoRA reward model could never learn to score.
RM_REASON = (
    "NeMo-RL v0.7.0 (Automodel) freezes every base weight under LoRA, the reward model's freshly "
    "initialised score head included, so a LoRA reward model cannot learn its score; train rm with "
    "full weights (rm.policy.dtensor_cfg.lora_cfg.enabled=false)"
)


@dataclass(frozen=True)
class LoraSettings:
    target_modules: tuple[str, ...]
    exclude_modules: tuple[str, ...]
    match_all_linear: bool
    dim: int
    alpha: float
    dropout: float
    dropout_position: str
    lora_A_init: str


def lora_settings(ctx: StageContext) -> LoraSettings | None:
    """The stage's LoRA settings, or None when LoRA is off; anything this engine could not
    honour exactly is refused here, before a model loads. Every ``lora_cfg`` key is required
    (``nemo_rl_keys``): the local profiles set them all, off or on."""
    keys = ProfileKeys(ctx.config, config_file(ctx))
    where = f"stages/{ctx.name}/config/{ctx.profile}.yaml {LORA_KEY}"
    # A refusal: an absent megatron_cfg.peft asks for no Megatron LoRA.
    if get_path(ctx.config, "policy.megatron_cfg.peft.enabled"):
        raise UnsupportedSetting(
            f"stages/{ctx.name}/config/{ctx.profile}.yaml policy.megatron_cfg.peft.enabled: Megatron LoRA "
            f"needs the NeMo-RL engine; the local engine trains LoRA from {LORA_KEY}"
        )
    if not keys.flag(f"{LORA_KEY}.enabled"):
        return None
    if ctx.name not in LORA_STAGES:
        reason = RM_REASON if ctx.name == "rm" else f"stage '{ctx.name}' trains no policy"
        raise UnsupportedSetting(f"{where}.enabled=true: {reason}")
    # null lists mean none, as in Automodel
    targets = tuple(keys.raw(f"{LORA_KEY}.target_modules") or ())
    excludes = tuple(keys.raw(f"{LORA_KEY}.exclude_modules") or ())
    match_all = keys.flag(f"{LORA_KEY}.match_all_linear")
    problems = []
    if targets and excludes:
        problems.append("target_modules and exclude_modules are exclusive (Automodel refuses both)")
    if match_all and (targets or excludes):
        problems.append("match_all_linear=true needs target_modules and exclude_modules empty")
    dim, alpha = keys.integer(f"{LORA_KEY}.dim"), keys.number(f"{LORA_KEY}.alpha")
    dropout, position = keys.number(f"{LORA_KEY}.dropout"), keys.text(f"{LORA_KEY}.dropout_position")
    init = keys.text(f"{LORA_KEY}.lora_A_init")
    if dim <= 0:
        problems.append(f"dim must be a positive rank, got {dim}")
    if not 0.0 <= dropout < 1.0:
        problems.append(f"dropout must be in [0, 1), got {dropout}")
    if position not in ("pre", "post"):
        problems.append(f"dropout_position must be 'pre' or 'post', got {position!r}")
    elif position == "post" and dropout > 0:
        problems.append(
            "dropout_position='post' with dropout > 0: peft drops the adapter's input, not its output; "
            "set dropout_position='pre' (or dropout=0.0) so both engines train the same thing"
        )
    if init not in ("xavier", "uniform"):
        problems.append(f"lora_A_init must be 'xavier' or 'uniform' (Automodel's two), got {init!r}")
    if problems:
        raise UnsupportedSetting(f"{where}:\n  - " + "\n  - ".join(problems))
    return LoraSettings(targets, excludes, match_all, dim, alpha, dropout, position, init)


def linear_names(model) -> list[str]:
    import torch

    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def target_modules(model, settings: LoraSettings) -> list[str]:
    """Full names of the linear layers the adapter goes on, chosen as Automodel chooses them;
    none is an error that lists the model's linear layers."""
    linear = linear_names(model)
    # Nothing named: Automodel adapts '*_proj'.
    targets = settings.target_modules or (() if settings.exclude_modules else ("*_proj",))
    if settings.match_all_linear:
        chosen = linear
    elif targets:
        chosen = [n for n in linear if any(n == p or wildcard_match(p, n) for p in targets)]
    else:
        chosen = [
            n
            for n in linear
            if n not in settings.exclude_modules
            and not any(wildcard_match(p, n) for p in settings.exclude_modules)
        ]
    if not chosen:
        shown = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in linear})
        raise UnsupportedSetting(
            f"{LORA_KEY}: target_modules {list(settings.target_modules)} / exclude_modules "
            f"{list(settings.exclude_modules)} match no linear layer of the model. Its linear layers: "
            + ", ".join(shown)
            + " (patterns match full names: '*_proj', '*.self_attn.q_proj')"
        )
    return chosen


def peft_config(model, settings: LoraSettings):
    """The peft ``LoraConfig`` for ``model``: the layers Automodel would choose, listed exactly.
    Trainers get it as ``peft_config`` (TRL wraps the model, and uses it with the adapter
    disabled as the reference); :func:`init_adapter` then draws Automodel's initial weights."""
    from peft import LoraConfig

    chosen = target_modules(model, settings)
    if "lm_head" in chosen:
        raise UnsupportedSetting(
            f"{LORA_KEY}: the selection includes lm_head (match_all_linear does, as in Automodel), and "
            "TRL's trainers compute log-probabilities from lm_head.weight directly, so its adapter would "
            "never train; use target_modules ['*_proj'] or exclude_modules ['lm_head']"
        )
    return LoraConfig(
        r=settings.dim,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,  # refused unless it is 'pre' or zero (lora_settings)
        target_modules=chosen,
        bias="none",
        task_type="CAUSAL_LM",
    )


def init_adapter(model, settings: LoraSettings, seed: int) -> None:
    """Automodel's initial adapter on a PEFT model, drawn from ``seed``: ``lora_A`` xavier-normal
    (``lora_A_init: xavier``) or kaiming-uniform, ``lora_B`` zero (so the policy starts as its base)."""
    import torch
    from transformers import set_seed

    set_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                if settings.lora_A_init == "xavier":
                    torch.nn.init.xavier_normal_(param)
                else:
                    torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))
            elif ".lora_B." in name:
                param.zero_()


def prepare(ctx: StageContext, model, settings: LoraSettings, base_dir: Path | str, seed: int) -> None:
    """After a trainer wrapped ``model`` (``peft_config``): Automodel's initial adapter, and the
    policy it applies to named in what it will save."""
    init_adapter(model, settings, seed)
    adapter_of(ctx, Path(base_dir), model)


def adapter_of(ctx: StageContext, base_dir: Path, model) -> None:
    """Name the policy the adapter applies to, as a repo-relative path, in what it will save
    (``adapter_config.json``'s ``base_model_name_or_path``)."""
    relative = Path(base_dir).resolve().relative_to(ctx.root.resolve()).as_posix()
    for config in model.peft_config.values():
        config.base_model_name_or_path = relative


class AdapterDisabled:
    """A PEFT model's base as a reference model: its forward with the adapter switched off."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)


def full_policy_dir(ctx: StageContext, directory: Path | str, dtype: str) -> Path:
    """A directory of full weights for ``directory`` (an adapter chain merged once, in the scratch
    area beside the resumable checkpoints)."""
    return merged_dir(Path(directory), ctx.root, scratch_root(ctx.params) / "merged", dtype)
