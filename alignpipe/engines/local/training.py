"""TRL trainer arguments and resumable training for the local engine: NeMo-RL keys -> TRL
arguments, refusal of settings the local engine cannot honour, scratch checkpoints,
and preference data.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alignpipe import console
from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.engines.local import live_log, publish
from alignpipe.engines.local.live_log import replay_history
from alignpipe.errors import UnsupportedSetting
from alignpipe.jsonl import read_jsonl
from alignpipe.measure.chat_tokens import preference_example
from alignpipe.measure.generation import prompt_messages

# ----------------------------------------------------------------------------- guards

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


# ----------------------------------------------------------------------------- TRL args


def lr_factor(cfg: dict[str, Any], where: str = "the stage's config") -> Callable[[int], float]:
    """NeMo-RL's ``policy.scheduler`` as a function of the optimizer step: the factor on the base
    learning rate that its ``SequentialLR`` over the listed ``LinearLR``/``ConstantLR`` gives
    (torch's closed forms). HF's ``constant_with_warmup`` would start the warm-up at 0, where
    NeMo-RL's ``LinearLR(start_factor=0.1)`` starts at a tenth. Other schedulers are refused."""
    entries = get_path(cfg, "policy.scheduler") or []
    if isinstance(entries, dict):
        entries = [entries]
    phases: list[tuple[str, dict[str, Any]]] = []
    milestones: list[int] = []
    for entry in entries:
        if "milestones" in entry and "name" not in entry:
            milestones = [int(m) for m in entry["milestones"]]
            continue
        name = str(entry.get("name", "")).rsplit(".", 1)[-1]
        if name not in ("LinearLR", "ConstantLR"):
            raise UnsupportedSetting(
                f"policy.scheduler {entry.get('name')!r} in {where}: the local engine reproduces "
                "torch.optim.lr_scheduler.LinearLR and ConstantLR (NeMo-RL's warm-up then constant)"
            )
        phases.append((name, dict(entry.get("kwargs") or {})))
    if not phases:
        return lambda step: 1.0
    if len(milestones) != len(phases) - 1:
        raise UnsupportedSetting(
            f"policy.scheduler in {where}: {len(phases)} schedulers need {len(phases) - 1} milestones"
        )

    def one(name: str, kw: dict[str, Any], t: int) -> float:
        if name == "LinearLR":
            start, end = float(kw.get("start_factor", 1 / 3)), float(kw.get("end_factor", 1.0))
            total = int(kw.get("total_iters", 5))
            return start + (end - start) * min(t, total) / total if total else end
        return float(kw.get("factor", 1 / 3)) if t < int(kw.get("total_iters", 5)) else 1.0

    def factor(step: int) -> float:
        k = sum(step >= m for m in milestones)
        return one(*phases[k], step - (milestones[k - 1] if k else 0))

    return factor


def use_nemo_rl_schedule(trainer, cfg: dict[str, Any], where: str = "the stage's config") -> None:
    """Make ``trainer`` (any HF Trainer) step :func:`lr_factor` instead of its own schedule."""
    from torch.optim.lr_scheduler import LambdaLR

    factor = lr_factor(cfg, where)

    def create_scheduler(num_training_steps: int, optimizer=None):
        if trainer.lr_scheduler is None:
            trainer.lr_scheduler = LambdaLR(optimizer or trainer.optimizer, factor)
        return trainer.lr_scheduler

    trainer.create_scheduler = create_scheduler


def length_sorted_micro_batches(trainer, length: Callable[[dict[str, Any]], int]) -> None:
    """Cut each optimizer step's rows into micro-batches by length: the rows of a step (a global
    batch) are drawn as the trainer draws them (accelerate's seeded sampler, ``data_seed``), then
    ordered shortest first, so a micro-batch pads to its own longest row instead of the step's.
    The step's gradient is unchanged (equal-size micro-batches, averaged), as with NeMo-RL's
    dynamic batching; padding is most of a step's work when a few rows (conversations) are
    several times longer than the rest. ``length(row)``: a row of the trainer's own (prepared)
    dataset, in tokens. One micro-batch per step: nothing to sort."""
    steps = trainer.args.gradient_accumulation_steps
    if steps == 1:
        return
    from accelerate.data_loader import SeedableRandomSampler
    from torch.utils.data import Sampler

    rows = trainer.args.per_device_train_batch_size * steps

    class SortedWithinSteps(Sampler):
        # Not a RandomSampler: accelerate would swap it for its own and drop the ordering.
        def __init__(self, dataset) -> None:
            self.drawn = SeedableRandomSampler(data_source=dataset, data_seed=trainer.args.data_seed)
            self.lengths = [length(row) for row in dataset]

        def set_epoch(self, epoch: int) -> None:  # the trainer's per-epoch reseed
            self.drawn.set_epoch(epoch)

        def __len__(self) -> int:
            return len(self.drawn)

        def __iter__(self):
            step: list[int] = []
            for index in self.drawn:
                step.append(index)
                if len(step) == rows:
                    yield from sorted(step, key=self.lengths.__getitem__)
                    step = []
            yield from sorted(step, key=self.lengths.__getitem__)

    trainer._get_train_sampler = lambda dataset=None: SortedWithinSteps(dataset or trainer.train_dataset)


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


def apply_torch_threads(ctx: StageContext) -> None:
    """``alignpipe.torch_threads`` from the profile: torch's intra-op CPU threads.

    A fixed count keeps results byte-identical across machines (a different count changes
    the floating-point sums, hence every hash in dvc.lock). The stage process lets idle
    OpenMP workers sleep (``context.CPU_ENV``), so a second thread no longer costs a busy
    machine the 2-10x that spinning did.
    """
    threads = ctx.settings.torch_threads
    if threads:
        import torch

        torch.set_num_threads(threads)


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


# ----------------------------------------------------------------------------- resume

_CKPT = re.compile(r"^checkpoint-(\d+)$")


def latest_checkpoint(scratch: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` in ``scratch`` (trainer_state.json written last)."""
    if not scratch.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in scratch.iterdir()
        if (m := _CKPT.match(p.name)) and (p / "trainer_state.json").is_file()
    ]
    return max(found)[1] if found else None


def train_resumable(ctx: StageContext, trainer, live, rename: dict[str, str]) -> None:
    """``trainer.train()``, resuming from the newest scratch checkpoint of this exact run.

    DVC deletes a stage's outputs before re-running it, so checkpoints live in
    ``ctx.scratch_dir``; after a resume the DVCLive curves are replayed from the
    checkpoint's trainer_state so they stay whole, and come out byte-identical to an
    uninterrupted run's (``log_at_checkpoints``; tests/test_resume.py).
    """
    show_progress(ctx, trainer)
    use_nemo_rl_schedule(trainer, ctx.config, f"stages/{ctx.name}/config/{ctx.profile}.yaml")
    trainer.add_callback(log_at_checkpoints())
    resume = latest_checkpoint(ctx.scratch_dir)
    if resume is not None:
        print(f"{ctx.name}: resuming from {resume}")
        replay_history(live, rename, resume)
        if restore_finished_run(trainer, resume):
            return
        trainer.args.eval_on_start = False  # step 0's validation is in the replayed history
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)


def log_at_checkpoints():
    """A callback that logs at every checkpoint step as well as every ``logging_steps``.

    transformers' ``loss`` (and TRL's averaged metrics) cover the steps since the last log,
    and a resumed run starts that window at its checkpoint: with a checkpoint between two
    logging steps, the next log would average fewer steps than an uninterrupted run's. Logging
    at each checkpoint closes the window there in both runs, so their curves are the same.
    """
    from transformers import TrainerCallback

    class LogAtCheckpoints(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save:
                control.should_log = True

    return LogAtCheckpoints()


# Trainer log keys shown on the progress bar, under short names.
HEADLINE = {"loss": "loss", "reward": "reward", "kl": "kl", "rewards/accuracies": "pref_acc"}


def show_progress(ctx: StageContext, trainer) -> None:
    """One progress bar (console.progress_callback) instead of HF's log-dict printer."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(
        console.progress_callback(ctx.name, HEADLINE, console.raw_log_path(ctx.root, ctx.name))
    )


def restore_finished_run(trainer, checkpoint: Path) -> bool:
    """If ``checkpoint`` is the run's last step, load it into ``trainer`` and say so.

    transformers' loop takes one more optimizer step when resumed at ``max_steps`` (it
    checks the limit after a step), so a run killed after its final checkpoint would end
    one step past an uninterrupted one. A finished run needs no training: its weights and
    state are the checkpoint's.
    """
    from transformers import TrainerState

    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    if state.global_step < state.max_steps:
        return False
    trainer._load_from_checkpoint(str(checkpoint))
    trainer.state = state
    return True


def train_then_validate(
    ctx: StageContext, trainer, live, rename: dict[str, str], validation, algo: str, has_validation: bool
):
    """``train_resumable``, then one last validation (``<algo>.val_at_end``) unless the last
    step already ran one; returns the trained model."""
    train_resumable(ctx, trainer, live, rename)
    if (
        has_validation
        and get_path(ctx.config, f"{algo}.val_at_end", True)
        and not validation.ran_at(trainer.state)
    ):
        validation.run(trainer.model, trainer.state)
    return trainer.model


def publish_trained(
    ctx: StageContext,
    output: str,
    model,
    tokenizer,
    live,
    *,
    extra: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> dict[str, Any]:
    """How every training stage ends: close its DVCLive run (the final metrics), publish the
    model with those metrics, then drop its resume checkpoints, which the published model
    supersedes. Returns the metrics."""
    metrics = live_log.close(ctx, live)
    publish.publish_model(ctx, output, model, tokenizer, metrics, extra=extra, files=files)
    shutil.rmtree(ctx.scratch_dir, ignore_errors=True)
    return metrics


# ----------------------------------------------------------------------------- data


def preference_examples(
    tokenizer, rows: list[dict[str, Any]], cfg: dict[str, Any], system: str | None = None
) -> list[dict[str, Any]]:
    """Prepared preference rows -> pairs tokenised as NeMo-RL's ``preference_preprocessor`` does
    (``alignpipe.measure.chat_tokens.preference_example``): the keys are NeMo-RL's
    ``data.default.{prompt,chosen,rejected}_key``, the length limit ``data.max_input_seq_length``,
    and the prompt follows the stage's system turn (``system``) when it has one."""
    keys = [get_path(cfg, f"data.default.{k}_key", k) or k for k in ("prompt", "chosen", "rejected")]
    limit = int(get_path(cfg, "data.max_input_seq_length"))
    return [
        preference_example(
            tokenizer,
            prompt_messages(row[keys[0]], system),
            {"role": "assistant", "content": row[keys[1]]},
            {"role": "assistant", "content": row[keys[2]]},
            max_length=limit,
        )
        for row in rows
    ]


def preference_splits(ctx: StageContext, algo: str, tokenizer) -> tuple[list[dict], list[dict]]:
    """Tokenised train and validation pairs of a preference stage; validation capped at
    ``<algo>.val_batches x val_global_batch_size`` pairs (``-1``: all, as in NeMo-RL).

    A pair NeMo-RL keeps at weight 0 (too long) trains and counts nothing there; TRL has no
    per-pair weight, so it is left out here (named on the console)."""
    cfg = ctx.config

    def pairs(path: str, split: str) -> list[dict]:
        rows = preference_examples(tokenizer, read_jsonl(ctx.root / path), cfg, ctx.system_prompt)
        kept = [r for r in rows if r["weight"] > 0]
        if len(kept) < len(rows):
            limit = get_path(cfg, "data.max_input_seq_length")
            print(f"{ctx.name}: {len(rows) - len(kept)} {split} pairs longer than data.max_input_seq_length={limit} "
                  "left out (NeMo-RL gives them weight 0)", flush=True)  # fmt: skip
        return kept

    train = pairs(cfg["data"]["train"]["data_path"], "train")
    val_path = get_path(cfg, "data.validation.data_path")
    val = pairs(val_path, "validation") if val_path else []
    batches = int(get_path(cfg, f"{algo}.val_batches", -1) or -1)
    if batches > 0:
        val = val[: batches * int(get_path(cfg, f"{algo}.val_global_batch_size", 32))]
    return train, val
