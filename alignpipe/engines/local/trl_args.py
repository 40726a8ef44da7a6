"""NeMo-RL-schema config -> the arguments of TRL's and transformers' trainer configs on the
local engine: what every trainer shares (``trl_common_args``), the step budget NeMo-RL would
stop at, and the refusal of settings only the NeMo-RL engine can honour.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.errors import UnsupportedSetting

# (config key, value that means "on", why the local engine cannot do it)
_GPU_ONLY = [
    ("policy.megatron_cfg.enabled", True, "Megatron-Core parallelism needs the NeMo-RL engine"),
    ("policy.generation.backend", "vllm", "vLLM generation needs the NeMo-RL engine and a GPU"),
    ("policy.generation.backend", "megatron", "Megatron inference needs the NeMo-RL engine"),
    ("policy.dtensor_cfg.cpu_offload", True, "FSDP2 CPU offload is a NeMo-RL DTensor feature"),
    ("policy.dtensor_cfg.sequence_parallel", True, "sequence parallelism needs several GPUs"),
    ("policy.sequence_packing.enabled", True, "sequence packing is a NeMo-RL worker feature"),
    ("policy.dynamic_batching.enabled", True, "dynamic batching is a NeMo-RL worker feature"),
    ("grpo.async_grpo.enabled", True, "async GRPO needs NeMo-RL's Ray workers"),
    ("env.should_use_nemo_gym", True, "NeMo-Gym environments run only on the NeMo-RL engine"),
]
_MUST_BE_ONE = [
    ("policy.dtensor_cfg.tensor_parallel_size", "tensor parallelism"),
    ("policy.dtensor_cfg.context_parallel_size", "context parallelism"),
    ("cluster.num_nodes", "a multi-node cluster"),
]


def refuse_gpu_only_settings(ctx: StageContext) -> None:
    """Fail loudly on settings this engine would otherwise silently ignore."""
    problems = []
    for key, on_value, why in _GPU_ONLY:
        if get_path(ctx.config, key) == on_value:
            problems.append(f"{key}={on_value!r}: {why}")
    for key, what in _MUST_BE_ONE:
        value = get_path(ctx.config, key)
        if value is not None and value > 1:
            problems.append(f"{key}={value}: {what} needs the NeMo-RL engine")
    if problems:
        raise UnsupportedSetting(
            f"stage '{ctx.name}' (profile '{ctx.profile}') asks the local engine for:\n  - "
            + "\n  - ".join(problems)
            + "\nfix: turn these off for the tiny profile, or run with runtime.engine=nemo_rl "
            "(e.g. `dvc exp run -S profile=default`)."
        )


def trl_common_args(ctx: StageContext, algo: str, output_dir: Path) -> dict[str, Any]:
    """Arguments every TRL config takes, mapped from the NeMo-RL schema (over 60 lines: the mapping
    table below is most of it).

    | NeMo-RL key                                   | TRL / transformers argument        |
    |-----------------------------------------------|------------------------------------|
    | <algo>.max_num_steps                          | max_steps                          |
    | <algo>.seed (params.yaml seed)                | seed, data_seed                    |
    | <algo>.val_period                             | eval_steps (eval_strategy=steps)   |
    | policy.train_micro_batch_size                 | per_device_train_batch_size        |
    | train_global_batch_size / micro               | gradient_accumulation_steps        |
    | <algo>.val_micro_batch_size                   | per_device_eval_batch_size         |
    | policy.optimizer.kwargs.{lr,weight_decay,...} | learning_rate, weight_decay, adam_*|
    | policy.scheduler (LinearLR, ConstantLR)       | lr_factor (train_resumable)        |
    | policy.max_grad_norm                          | max_grad_norm                      |
    | checkpointing.save_period / keep_top_k        | save_steps / save_total_limit      |
    """
    import torch

    cfg = ctx.config
    micro = int(get_path(cfg, "policy.train_micro_batch_size", 8))
    global_bs = int(get_path(cfg, "policy.train_global_batch_size", micro))
    if global_bs % micro:
        raise UnsupportedSetting(
            f"policy.train_global_batch_size ({global_bs}) must be a multiple of "
            f"policy.train_micro_batch_size ({micro}) in stages/{ctx.name}/config/{ctx.profile}.yaml"
        )
    opt = get_path(cfg, "policy.optimizer.kwargs", {}) or {}
    betas = opt.get("betas", [0.9, 0.999])
    val_period = int(get_path(cfg, f"{algo}.val_period", 0) or 0)
    ckpt_on = bool(get_path(cfg, "checkpointing.enabled", True))
    seed = int(get_path(cfg, f"{algo}.seed", ctx.seed))
    use_cpu = not torch.cuda.is_available()
    return dict(
        output_dir=str(output_dir),
        max_steps=int(get_path(cfg, f"{algo}.max_num_steps", 100)),
        num_train_epochs=float(get_path(cfg, f"{algo}.max_num_epochs", 1) or 1),
        seed=seed,
        data_seed=seed,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=global_bs // micro,
        per_device_eval_batch_size=int(get_path(cfg, f"{algo}.val_micro_batch_size", micro) or micro),
        learning_rate=float(opt.get("lr", 1e-4)),
        weight_decay=float(opt.get("weight_decay", 0.0)),
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_epsilon=float(opt.get("eps", 1e-8)),
        lr_scheduler_type="constant",  # replaced by NeMo-RL's schedule (use_nemo_rl_schedule)
        max_grad_norm=float(get_path(cfg, "policy.max_grad_norm", 1.0) or 0.0),
        eval_strategy="steps" if val_period else "no",
        eval_steps=val_period or None,
        save_strategy="steps" if ckpt_on else "no",
        save_steps=int(get_path(cfg, "checkpointing.save_period", 50)),
        save_total_limit=int(get_path(cfg, "checkpointing.keep_top_k", 2) or 2),
        logging_steps=max(1, min(10, val_period or 10)),
        report_to=[],
        use_cpu=use_cpu,
        bf16=get_path(cfg, "policy.precision") == "bfloat16" and not use_cpu,
        gradient_checkpointing=bool(get_path(cfg, "policy.dtensor_cfg.activation_checkpointing", False)),
        dataloader_num_workers=0,
        disable_tqdm=True,
        save_only_model=False,
    )


def step_budget(ctx: StageContext, algo: str, num_examples: int) -> int:
    """NeMo-RL stops at ``min(max_num_steps, max_num_epochs x steps per epoch)``.

    HF's Trainer lets a positive ``max_steps`` override the epoch count, so the
    epoch bound is applied here; ``max_num_steps: -1`` means epoch-bounded (NeMo-RL rm).
    """
    cfg = ctx.config
    global_bs = int(get_path(cfg, "policy.train_global_batch_size", 1))
    epochs = float(get_path(cfg, f"{algo}.max_num_epochs", 1) or 1)
    by_epochs = math.ceil(epochs * math.ceil(num_examples / global_bs))
    max_steps = int(get_path(cfg, f"{algo}.max_num_steps", -1) or -1)
    return by_epochs if max_steps <= 0 else min(max_steps, by_epochs)
