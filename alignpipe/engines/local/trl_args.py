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
from alignpipe.engines.local.nemo_rl_keys import stage_keys
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
    """Fail loudly on settings this engine would otherwise silently ignore. Each key may be
    absent (read without the typed view, nemo_rl_keys): an absent key asks for none of these."""
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


def trl_common_args(ctx: StageContext, output_dir: Path) -> dict[str, Any]:
    """Arguments every TRL config takes, mapped from the NeMo-RL schema (``nemo_rl_keys``; over
    60 lines: the mapping table below is most of it).

    | NeMo-RL key                                   | TRL / transformers argument        |
    |-----------------------------------------------|------------------------------------|
    | <algo>.max_num_steps                          | max_steps                          |
    | <algo>.seed (params.yaml seed)                | seed, data_seed                    |
    | <algo>.val_period                             | eval_steps (eval_strategy=steps)   |
    | policy.train_micro_batch_size                 | per_device_train_batch_size        |
    | train_global_batch_size / micro               | gradient_accumulation_steps        |
    | <algo>.val_micro_batch_size (grpo: val_batch_size) | per_device_eval_batch_size    |
    | policy.optimizer.kwargs.{lr,weight_decay,...} | learning_rate, weight_decay, adam_*|
    | policy.optimizer.kwargs.{foreach,fused}       | not read: optim=adamw_torch_fused  |
    | policy.scheduler (LinearLR, ConstantLR)       | lr_factor (checkpoints.scheduled)  |
    | policy.max_grad_norm (null: 0, no clipping)   | max_grad_norm                      |
    | checkpointing.save_period / keep_top_k        | save_steps / save_total_limit      |
    """
    import torch

    keys = stage_keys(ctx)
    algo, policy, ckpt = keys.algorithm, keys.policy, keys.checkpointing
    micro, global_bs = policy.train_micro_batch_size, policy.train_global_batch_size
    if global_bs % micro:
        raise UnsupportedSetting(
            f"policy.train_global_batch_size ({global_bs}) must be a multiple of "
            f"policy.train_micro_batch_size ({micro}) in stages/{ctx.name}/config/{ctx.profile}.yaml"
        )
    opt = policy.optimizer
    use_cpu = not torch.cuda.is_available()
    return dict(
        output_dir=str(output_dir),
        max_steps=algo.max_num_steps,
        num_train_epochs=float(algo.max_num_epochs),
        seed=algo.seed,
        data_seed=algo.seed,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=global_bs // micro,
        per_device_eval_batch_size=algo.eval_batch_size,
        learning_rate=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        # torch's fused CPU AdamW, whatever optimizer.kwargs.fused says (a kernel, not the math):
        # its root is exactly rounded; the single-tensor one's goes through torch.sqrt, whose
        # rounding depends on the CPU maker (benchmarks/RESULTS.md, "torch's sqrt").
        optim="adamw_torch_fused",
        lr_scheduler_type="constant",  # replaced by NeMo-RL's schedule (checkpoints.scheduled)
        # NeMo-RL's null (no clipping) is HF's 0.
        max_grad_norm=0.0 if policy.max_grad_norm is None else policy.max_grad_norm,
        eval_strategy="steps" if algo.val_period else "no",
        eval_steps=algo.val_period or None,
        save_strategy="steps" if ckpt.enabled else "no",
        save_steps=ckpt.save_period,
        save_total_limit=ckpt.keep_top_k,  # null: keep every checkpoint, as NeMo-RL
        logging_steps=max(1, min(10, algo.val_period or 10)),
        report_to=[],
        use_cpu=use_cpu,
        bf16=policy.precision == "bfloat16" and not use_cpu,
        gradient_checkpointing=policy.activation_checkpointing,
        dataloader_num_workers=0,
        disable_tqdm=True,
        save_only_model=False,
    )


def step_budget(ctx: StageContext, num_examples: int) -> int:
    """NeMo-RL stops at ``min(max_num_steps, max_num_epochs x steps per epoch)``.

    HF's Trainer lets a positive ``max_steps`` override the epoch count, so the
    epoch bound is applied here; ``max_num_steps: -1`` means epoch-bounded (NeMo-RL rm).
    """
    keys = stage_keys(ctx)
    global_bs = keys.policy.train_global_batch_size
    by_epochs = math.ceil(keys.algorithm.max_num_epochs * math.ceil(num_examples / global_bs))
    max_steps = keys.algorithm.max_num_steps
    return by_epochs if max_steps <= 0 else min(max_steps, by_epochs)
