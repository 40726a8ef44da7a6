"""The NeMo-RL keys each local trainer reads, typed, read once per stage from its resolved profile.

Every field is required: the local profiles (``stages/<stage>/config/{tiny,small}.yaml`` with
their ``defaults:``) set every key a trainer reads, so a missing one is a profile mistake and is
refused here, naming the key and the file, instead of being filled by a default that only says
something when it is wrong. A key NeMo-RL itself lets be null (``grpo.advantage_clip_low``,
``data.validation.data_path``, ``policy.generation.top_k``) is ``Optional`` here, and still has
to be in the profile. A trainer gets its view with ``stage_keys(ctx)`` (or ``sft_keys(ctx)``,
``dpo_keys``, ``rm_keys``, ``grpo_keys``: its algorithm's section); ``alignpipe:`` settings
are typed apart, in ``alignpipe.settings``.

Reads that stay outside these views, on purpose: the refusals (``trl_args.refuse_gpu_only_settings``,
``grpo.refuse_unsupported_grpo``, ``lora``'s Megatron check), where an absent key asks for
nothing the local engine cannot do; and ``advantage_settings`` on a config without
``grpo.adv_estimator``, which reads the top-level keys with NeMo-RL's own fallbacks (the
equivalence suite passes it NeMo-RL's configs; a local profile always has the section).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.errors import ConfigError, UnsupportedSetting

_MISSING = object()


class ProfileKeys:
    """Reads dotted NeMo-RL keys from a resolved config, each required, each of one type;
    ``where`` names the file that should set them, for the error."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def raw(self, key: str) -> Any:
        value = get_path(self.cfg, key, _MISSING)
        if value is _MISSING:
            raise ConfigError(
                f"{key} is missing: the local engine reads it and has no default for it; "
                f"set it in {self.where}"
            )
        return value

    def wrong(self, key: str, value: Any, expected: str) -> ConfigError:
        return ConfigError(f"{key}={value!r}: expected {expected}; fix it in {self.where}")

    def integer(self, key: str) -> int:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.wrong(key, value, "an integer")
        return value

    def number(self, key: str) -> float:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.wrong(key, value, "a number")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise self.wrong(key, value, "true or false")
        return value

    def text(self, key: str) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise self.wrong(key, value, "a string")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self.raw(key) is None else self.integer(key)

    def optional_number(self, key: str) -> float | None:
        return None if self.raw(key) is None else self.number(key)

    def optional_text(self, key: str) -> str | None:
        return None if self.raw(key) is None else self.text(key)

    def mapping(self, key: str) -> Mapping[str, Any]:
        value = self.raw(key)
        if not isinstance(value, Mapping):
            raise self.wrong(key, value, "a mapping")
        return MappingProxyType(dict(value))


def config_file(ctx: StageContext) -> str:
    """The file a stage's NeMo-RL keys come from (params.yaml knobs override it)."""
    return f"stages/{ctx.name}/config/{ctx.profile}.yaml (or params.yaml)"


# ----------------------------------------------------------------------------- shared sections


@dataclass(frozen=True)
class OptimizerKeys:
    """``policy.optimizer.kwargs`` (AdamW's)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float


@dataclass(frozen=True)
class PolicyKeys:
    """``policy.*`` as every local trainer reads it."""

    model_name: str
    tokenizer_name: str
    train_global_batch_size: int
    train_micro_batch_size: int
    max_total_sequence_length: int
    precision: str
    max_grad_norm: float | None  # null: no clipping (NeMo-RL)
    activation_checkpointing: bool  # policy.dtensor_cfg.activation_checkpointing
    optimizer: OptimizerKeys
    # NeMo-RL's scheduler entries as written (schedule.lr_factor reads them); null: none, constant.
    scheduler: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class CheckpointingKeys:
    enabled: bool
    save_period: int
    keep_top_k: int | None  # null: keep every checkpoint (NeMo-RL)


@dataclass(frozen=True)
class DataKeys:
    """``data.*`` paths, repo-relative."""

    train_path: str
    validation_path: str | None  # null: no validation set


@dataclass(frozen=True)
class SftDataKeys:
    """What NeMo-RL's ``sft_processor`` reads from ``data``."""

    max_input_seq_length: int
    add_bos: bool
    add_eos: bool
    add_generation_prompt: bool


@dataclass(frozen=True)
class PreferenceDataKeys:
    """What NeMo-RL's ``preference_preprocessor`` reads from ``data``."""

    max_input_seq_length: int
    prompt_key: str  # data.default.prompt_key, ...
    chosen_key: str
    rejected_key: str


# ----------------------------------------------------------------------------- algorithm sections


@dataclass(frozen=True)
class LoopKeys:
    """What every algorithm section has: the step budget, validation schedule, seed."""

    max_num_steps: int
    max_num_epochs: int
    val_period: int  # 0: no periodic validation
    val_at_start: bool
    val_at_end: bool
    seed: int


@dataclass(frozen=True)
class SupervisedKeys(LoopKeys):
    """The sft, dpo and rm sections' validation batches."""

    val_batches: int  # -1: the whole validation split
    val_global_batch_size: int
    val_micro_batch_size: int

    @property
    def eval_batch_size(self) -> int:
        return self.val_micro_batch_size


@dataclass(frozen=True)
class SftKeys(SupervisedKeys):
    data: SftDataKeys


@dataclass(frozen=True)
class DpoKeys(SupervisedKeys):
    reference_policy_kl_penalty: float  # beta
    preference_average_log_probs: bool
    sft_average_log_probs: bool
    preference_loss_weight: float
    sft_loss_weight: float
    data: PreferenceDataKeys


@dataclass(frozen=True)
class RmKeys(SupervisedKeys):
    reward_model_enabled: bool  # policy.reward_model_cfg.enabled
    reward_model_type: str  # policy.reward_model_cfg.reward_model_type
    data: PreferenceDataKeys


@dataclass(frozen=True)
class GenerationKeys:
    """``policy.generation.*`` (GRPO's sampling)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None  # null: no top-k


@dataclass(frozen=True)
class LossFnKeys:
    """``loss_fn.*`` (GRPO's ClippedPGLossFn) as the local engine maps it."""

    reference_policy_kl_penalty: float
    ratio_clip_min: float
    ratio_clip_max: float
    sequence_level_importance_ratios: bool
    token_level_loss: bool
    kl_input_clamp_value: float | None  # null: no clamp
    kl_output_clamp_value: float | None

    @property
    def kl_settings(self) -> dict[str, float | None]:
        """The clamps of ``AlignGRPOTrainer``'s reference KL."""
        return {"input_clamp": self.kl_input_clamp_value, "output_clamp": self.kl_output_clamp_value}


@dataclass(frozen=True)
class GrpoKeys(LoopKeys):
    num_prompts_per_step: int
    num_generations_per_prompt: int
    val_batch_size: int
    max_val_samples: int | None  # null: every validation row
    overlong_filtering: bool
    # step_advantages' settings (advantage_settings): normalize_rewards, leave_one_out_baseline, clip
    advantages: Mapping[str, Any]
    reward_scaling: Mapping[str, Any]  # grpo.reward_scaling as written (rl.shaping.scale_reward)
    shuffle: bool  # data.shuffle
    generation: GenerationKeys
    loss_fn: LossFnKeys

    @property
    def eval_batch_size(self) -> int:
        return self.val_batch_size


@dataclass(frozen=True)
class StageKeys:
    """Every NeMo-RL key a local trainer stage reads: its algorithm's section and the shared ones."""

    algorithm: SftKeys | DpoKeys | RmKeys | GrpoKeys
    policy: PolicyKeys
    checkpointing: CheckpointingKeys
    data: DataKeys


# ----------------------------------------------------------------------------- reading


def advantage_settings(cfg: dict[str, Any], where: str = "the stage's config") -> dict[str, Any]:
    """``step_advantages`` settings read as NeMo-RL v0.7.0 reads them
    (grpo.py ``_create_advantage_estimator``, ``_clip_grpo_advantages``): ``grpo.adv_estimator``
    when the config has it, else the top-level keys with *its* fallbacks (normalise on,
    leave-one-out off). Top-level keys that disagree with the section are refused: NeMo-RL
    would silently ignore them."""
    section = get_path(cfg, "grpo.adv_estimator")
    if section is None:
        section = {
            "normalize_rewards": get_path(cfg, "grpo.normalize_rewards", True),
            "use_leave_one_out_baseline": get_path(cfg, "grpo.use_leave_one_out_baseline", False),
        }
    settings = {}
    for key in ("normalize_rewards", "use_leave_one_out_baseline"):
        if key not in section:
            raise ConfigError(
                f"grpo.adv_estimator.{key} is missing (NeMo-RL's estimator requires it): set it in {where}"
            )
        top = get_path(cfg, f"grpo.{key}")
        if top is not None and bool(top) != bool(section[key]):
            raise UnsupportedSetting(
                f"grpo.{key}={top!r} but grpo.adv_estimator.{key}={section[key]!r}: NeMo-RL v0.7.0 uses the "
                f"adv_estimator section and ignores the top-level key; make them agree in {where}"
            )
        settings[key] = bool(section[key])
    return {
        "normalize_rewards": settings["normalize_rewards"],
        "leave_one_out_baseline": settings["use_leave_one_out_baseline"],
        "clip": (get_path(cfg, "grpo.advantage_clip_low"), get_path(cfg, "grpo.advantage_clip_high")),
    }


def _loop(k: ProfileKeys, section: str) -> dict[str, Any]:
    return {
        "max_num_steps": k.integer(f"{section}.max_num_steps"),
        "max_num_epochs": k.integer(f"{section}.max_num_epochs"),
        "val_period": k.integer(f"{section}.val_period"),
        "val_at_start": k.flag(f"{section}.val_at_start"),
        "val_at_end": k.flag(f"{section}.val_at_end"),
        "seed": k.integer(f"{section}.seed"),
    }


def _supervised(k: ProfileKeys, section: str) -> dict[str, Any]:
    return {
        **_loop(k, section),
        "val_batches": k.integer(f"{section}.val_batches"),
        "val_global_batch_size": k.integer(f"{section}.val_global_batch_size"),
        "val_micro_batch_size": k.integer(f"{section}.val_micro_batch_size"),
    }


def sft_data_keys(k: ProfileKeys) -> SftDataKeys:
    return SftDataKeys(
        max_input_seq_length=k.integer("data.max_input_seq_length"),
        add_bos=k.flag("data.add_bos"),
        add_eos=k.flag("data.add_eos"),
        add_generation_prompt=k.flag("data.add_generation_prompt"),
    )


def preference_data_keys(k: ProfileKeys) -> PreferenceDataKeys:
    return PreferenceDataKeys(
        max_input_seq_length=k.integer("data.max_input_seq_length"),
        prompt_key=k.text("data.default.prompt_key"),
        chosen_key=k.text("data.default.chosen_key"),
        rejected_key=k.text("data.default.rejected_key"),
    )


def _sft(k: ProfileKeys) -> SftKeys:
    return SftKeys(**_supervised(k, "sft"), data=sft_data_keys(k))


def _dpo(k: ProfileKeys) -> DpoKeys:
    return DpoKeys(
        **_supervised(k, "dpo"),
        reference_policy_kl_penalty=k.number("dpo.reference_policy_kl_penalty"),
        preference_average_log_probs=k.flag("dpo.preference_average_log_probs"),
        sft_average_log_probs=k.flag("dpo.sft_average_log_probs"),
        preference_loss_weight=k.number("dpo.preference_loss_weight"),
        sft_loss_weight=k.number("dpo.sft_loss_weight"),
        data=preference_data_keys(k),
    )


def _rm(k: ProfileKeys) -> RmKeys:
    return RmKeys(
        **_supervised(k, "rm"),
        reward_model_enabled=k.flag("policy.reward_model_cfg.enabled"),
        reward_model_type=k.text("policy.reward_model_cfg.reward_model_type"),
        data=preference_data_keys(k),
    )


def _grpo(k: ProfileKeys) -> GrpoKeys:
    # advantage_settings falls back to the top-level keys without the section: a profile has both.
    for key in ("grpo.adv_estimator", "grpo.normalize_rewards", "grpo.use_leave_one_out_baseline"):
        k.raw(key)
    k.optional_number("grpo.advantage_clip_low"), k.optional_number("grpo.advantage_clip_high")
    advantages = advantage_settings(k.cfg, k.where)
    return GrpoKeys(
        **_loop(k, "grpo"),
        num_prompts_per_step=k.integer("grpo.num_prompts_per_step"),
        num_generations_per_prompt=k.integer("grpo.num_generations_per_prompt"),
        val_batch_size=k.integer("grpo.val_batch_size"),
        max_val_samples=k.optional_integer("grpo.max_val_samples"),
        overlong_filtering=k.flag("grpo.overlong_filtering"),
        advantages=MappingProxyType(advantages),
        reward_scaling=k.mapping("grpo.reward_scaling"),
        shuffle=k.flag("data.shuffle"),
        generation=GenerationKeys(
            max_new_tokens=k.integer("policy.generation.max_new_tokens"),
            temperature=k.number("policy.generation.temperature"),
            top_p=k.number("policy.generation.top_p"),
            top_k=k.optional_integer("policy.generation.top_k"),
        ),
        loss_fn=LossFnKeys(
            reference_policy_kl_penalty=k.number("loss_fn.reference_policy_kl_penalty"),
            ratio_clip_min=k.number("loss_fn.ratio_clip_min"),
            ratio_clip_max=k.number("loss_fn.ratio_clip_max"),
            sequence_level_importance_ratios=k.flag("loss_fn.sequence_level_importance_ratios"),
            token_level_loss=k.flag("loss_fn.token_level_loss"),
            kl_input_clamp_value=k.optional_number("loss_fn.kl_input_clamp_value"),
            kl_output_clamp_value=k.optional_number("loss_fn.kl_output_clamp_value"),
        ),
    )


_ALGORITHMS = {"sft": _sft, "dpo": _dpo, "rm": _rm, "grpo": _grpo}


def _policy(k: ProfileKeys) -> PolicyKeys:
    betas = k.raw("policy.optimizer.kwargs.betas")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise k.wrong("policy.optimizer.kwargs.betas", betas, "two numbers, [beta1, beta2]")
    scheduler = k.raw("policy.scheduler")
    entries = [] if scheduler is None else [scheduler] if isinstance(scheduler, Mapping) else list(scheduler)
    return PolicyKeys(
        model_name=k.text("policy.model_name"),
        tokenizer_name=k.text("policy.tokenizer.name"),
        train_global_batch_size=k.integer("policy.train_global_batch_size"),
        train_micro_batch_size=k.integer("policy.train_micro_batch_size"),
        max_total_sequence_length=k.integer("policy.max_total_sequence_length"),
        precision=k.text("policy.precision"),
        max_grad_norm=k.optional_number("policy.max_grad_norm"),
        activation_checkpointing=k.flag("policy.dtensor_cfg.activation_checkpointing"),
        optimizer=OptimizerKeys(
            lr=k.number("policy.optimizer.kwargs.lr"),
            weight_decay=k.number("policy.optimizer.kwargs.weight_decay"),
            betas=(float(betas[0]), float(betas[1])),
            eps=k.number("policy.optimizer.kwargs.eps"),
        ),
        scheduler=tuple(MappingProxyType(dict(e)) for e in entries),
    )


def read_stage_keys(cfg: dict[str, Any], algorithm: str, where: str) -> StageKeys:
    """The view of a resolved config whose algorithm section is ``algorithm`` (sft, dpo, rm, grpo)."""
    if algorithm not in _ALGORITHMS:
        raise ConfigError(f"no local trainer reads NeMo-RL's '{algorithm}' section ({where})")
    k = ProfileKeys(cfg, where)
    return StageKeys(
        algorithm=_ALGORITHMS[algorithm](k),
        policy=_policy(k),
        checkpointing=CheckpointingKeys(
            enabled=k.flag("checkpointing.enabled"),
            save_period=k.integer("checkpointing.save_period"),
            keep_top_k=k.optional_integer("checkpointing.keep_top_k"),
        ),
        data=DataKeys(
            train_path=k.text("data.train.data_path"),
            validation_path=k.optional_text("data.validation.data_path"),
        ),
    )


_CACHE = "_nemo_rl_keys"


def stage_keys(ctx: StageContext) -> StageKeys:
    """The stage's view, read once from ``ctx.config`` (again only if the config is replaced)."""
    cached = ctx.__dict__.get(_CACHE)
    if cached is None or cached[0] is not ctx.config:
        keys = read_stage_keys(ctx.config, str(ctx.contract.algorithm), config_file(ctx))
        cached = ctx.__dict__[_CACHE] = (ctx.config, keys)
    return cached[1]


def _algorithm(ctx: StageContext, kind: type) -> Any:
    keys = stage_keys(ctx).algorithm
    if not isinstance(keys, kind):
        raise TypeError(f"stage '{ctx.name}' trains with {type(keys).__name__}, not {kind.__name__}")
    return keys


def sft_keys(ctx: StageContext) -> SftKeys:
    return _algorithm(ctx, SftKeys)


def dpo_keys(ctx: StageContext) -> DpoKeys:
    return _algorithm(ctx, DpoKeys)


def rm_keys(ctx: StageContext) -> RmKeys:
    return _algorithm(ctx, RmKeys)


def grpo_keys(ctx: StageContext) -> GrpoKeys:
    return _algorithm(ctx, GrpoKeys)
