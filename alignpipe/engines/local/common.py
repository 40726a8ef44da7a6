"""What every local (TRL) trainer shares: NeMo-RL keys -> TRL arguments, refusal of
settings the local engine cannot honour, DVCLive logging that survives a resume,
scratch checkpoints, the held-out verifier accuracy, and publishing a policy.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from alignpipe.artifacts import RESOLVED_CONFIG, staged_dir, write_manifest, write_text_atomic
from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.errors import UnsupportedSetting

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


def warmup_steps(cfg: dict[str, Any]) -> int:
    """NeMo-RL's scheduler list starts with a LinearLR warm-up; its total_iters is the warm-up."""
    for entry in get_path(cfg, "policy.scheduler", []) or []:
        if isinstance(entry, dict) and str(entry.get("name", "")).endswith("LinearLR"):
            return int(entry.get("kwargs", {}).get("total_iters", 0))
    return 0


def trl_common_args(ctx: StageContext, algo: str, output_dir: Path) -> dict[str, Any]:
    """Arguments every TRL config takes, mapped from the NeMo-RL schema.

    | NeMo-RL key                                   | TRL / transformers argument        |
    |-----------------------------------------------|------------------------------------|
    | <algo>.max_num_steps                          | max_steps                          |
    | <algo>.seed (params.yaml seed)                | seed, data_seed                    |
    | <algo>.val_period                             | eval_steps (eval_strategy=steps)   |
    | policy.train_micro_batch_size                 | per_device_train_batch_size        |
    | train_global_batch_size / micro               | gradient_accumulation_steps        |
    | <algo>.val_micro_batch_size                   | per_device_eval_batch_size         |
    | policy.optimizer.kwargs.{lr,weight_decay,...} | learning_rate, weight_decay, adam_*|
    | policy.scheduler[LinearLR].total_iters        | warmup_steps (constant_with_warmup)|
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
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=warmup_steps(cfg),
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

    For the ~1M-parameter tiny model, thread hand-offs cost more than they save, and on a
    busy machine spinning OpenMP workers burn the CPU others need: one DPO step took
    0.23 s of CPU with 1 thread and 1.6 s with 2 on the shared 2-core box.
    """
    threads = get_path(ctx.config, "alignpipe.torch_threads")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


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


# ----------------------------------------------------------------------------- metrics


def open_live(ctx: StageContext, resume: bool = False):
    """DVCLive writing into the stage's results dir, never touching dvc.yaml."""
    from dvclive import Live

    return Live(str(ctx.output("metrics")), dvcyaml=None, save_dvc_exp=False, resume=resume, report=None)


def make_live_callback(live, rename: dict[str, str]):
    """A TRL/transformers callback that logs chosen metrics to DVCLive under our names.

    ``rename`` maps trainer log keys (``loss``, ``eval_loss``, ``mean_token_accuracy``)
    to pipeline metric names (``train/loss``, ``val/loss``, ``train/token_accuracy``).
    """
    from transformers import TrainerCallback

    class LiveCallback(TrainerCallback):
        first_step_seen = False

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.first_step_seen:
                self.first_step_seen = True
                record_timing(Path(live.dir).name, "first_step")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                log_to_live(live, rename, logs, state.global_step)

    return LiveCallback()


def record_timing(stage: str, event: str) -> None:
    """``ALIGNPIPE_TIMING=<file>`` (or ``1`` for stderr): append how long after process start
    ``event`` happened, as a JSON line. ``benchmarks/`` uses it for start-up overhead."""
    target = os.environ.get("ALIGNPIPE_TIMING")
    if not target:
        return
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = json.dumps({"stage": stage, "event": event, "unix": time.time(),
                       "since_process_start_s": round(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 2),
                       "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)})
    if target == "1":
        print(f"alignpipe-timing {line}", file=sys.stderr)
    else:
        with open(target, "a") as f:
            f.write(line + "\n")


def log_to_live(live, rename: dict[str, str], logs: dict[str, Any], step: int) -> None:
    wrote = False
    for key, name in rename.items():
        value = logs.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            live.step = step
            live.log_metric(name, float(value))
            wrote = True
    if wrote:
        live.make_summary()


def make_validation_callback(live, rename: dict[str, str], period: int,
                             evaluate: Callable[[Any], dict[str, float]], *, at_start: bool = False):
    """A callback that runs ``evaluate(model)`` every ``period`` optimizer steps.

    For metrics the stage defines itself rather than reading TRL's log keys. Results go
    to DVCLive (through ``rename``) and into the trainer's ``log_history``, so they are
    saved in checkpoints and ``replay_history`` restores them after a resume. The
    callback's ``run(model, state)`` evaluates on demand (e.g. once more after training).
    """
    from transformers import TrainerCallback

    class ValidationCallback(TrainerCallback):
        last_step = -1

        def run(self, model, state) -> dict[str, float]:
            was_training = model.training
            model.eval()
            try:
                logs = evaluate(model)
            finally:
                model.train(was_training)
            state.log_history.append({**logs, "step": state.global_step})
            log_to_live(live, rename, logs, state.global_step)
            self.last_step = state.global_step
            return logs

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if at_start and state.global_step == 0 and model is not None:
                self.run(model, state)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if period > 0 and state.global_step % period == 0 and model is not None:
                self.run(model, state)

    return ValidationCallback()


def replay_history(live, rename: dict[str, str], checkpoint: Path) -> None:
    """After a resume, re-log what the checkpoint's trainer_state recorded, so curves are whole."""
    state_file = checkpoint / "trainer_state.json"
    if state_file.is_file():
        for entry in json.loads(state_file.read_text()).get("log_history", []):
            log_to_live(live, rename, entry, int(entry.get("step", 0)))


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
    checkpoint's trainer_state so they stay whole.
    """
    resume = latest_checkpoint(ctx.scratch_dir)
    if resume is not None:
        print(f"{ctx.name}: resuming from {resume}")
        replay_history(live, rename, resume)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)


def clear_scratch(ctx: StageContext) -> None:
    shutil.rmtree(ctx.scratch_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- data


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def user_turn(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def preference_pairs(rows: list[dict[str, Any]], prompt_key: str = "prompt", chosen_key: str = "chosen",
                     rejected_key: str = "rejected") -> list[dict[str, list[dict[str, str]]]]:
    """Prepared preference rows -> TRL's conversational preference format.

    Conversational, so the chat template wraps prompt and answers exactly as in SFT.
    The keys are NeMo-RL's ``data.default.{prompt,chosen,rejected}_key``.
    """
    return [
        {
            "prompt": user_turn(row[prompt_key]),
            "chosen": [{"role": "assistant", "content": row[chosen_key]}],
            "rejected": [{"role": "assistant", "content": row[rejected_key]}],
        }
        for row in rows
    ]


def preference_splits(ctx: StageContext, algo: str) -> tuple[list[dict], list[dict]]:
    """Train and validation pairs of a preference stage; validation capped at
    ``<algo>.val_batches x val_global_batch_size`` pairs (``-1``: all, as in NeMo-RL)."""
    cfg = ctx.config
    keys = {f"{k}_key": get_path(cfg, f"data.default.{k}_key", k) or k for k in ("prompt", "chosen", "rejected")}
    train = preference_pairs(read_jsonl(ctx.root / cfg["data"]["train"]["data_path"]), **keys)
    val_path = get_path(cfg, "data.validation.data_path")
    val = preference_pairs(read_jsonl(ctx.root / val_path), **keys) if val_path else []
    batches = int(get_path(cfg, f"{algo}.val_batches", -1) or -1)
    if batches > 0:
        val = val[: batches * int(get_path(cfg, f"{algo}.val_global_batch_size", 32))]
    return train, val


# ----------------------------------------------------------------------------- held-out


def heldout_settings(ctx: StageContext) -> dict[str, Any]:
    settings = dict(get_path(ctx.config, "alignpipe.heldout", {}) or {})
    settings.setdefault("data_path", "data/prepared/rlvr/test.jsonl")
    return settings


def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float,
             top_p: float = 1.0, batch_size: int = 128, seed: int = 0) -> list[str]:
    """Seeded sampling (greedy when temperature is 0) of one completion per prompt."""
    import torch

    tokenizer.padding_side = "left"
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    outputs: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(user_turn(p), tokenize=False, add_generation_prompt=True) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        # Seed per batch from our own generator so results do not depend on what ran before.
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None,
                top_k=0 if temperature > 0 else None,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        outputs.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return outputs


def heldout_completions(model, tokenizer, rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """The seeded samples ``heldout_accuracy`` scores (one per row), from ``alignpipe.heldout`` settings."""
    return generate(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        max_new_tokens=int(settings.get("max_new_tokens", 16)),
        temperature=float(settings.get("temperature", 1.0)),
        top_p=float(settings.get("top_p", 1.0)),
        batch_size=int(settings.get("batch_size", 128)),
        seed=int(settings.get("seed", 1234)),
    )


def heldout_accuracy(model, tokenizer, rows: Iterable[dict[str, Any]], settings: dict[str, Any],
                     completions: list[str] | None = None) -> dict[str, float]:
    """Verifier accuracy of sampled answers on held-out prompts, overall and per task.

    The one definition every policy stage reports as ``heldout/accuracy``. ``completions``:
    samples already drawn with ``heldout_completions`` (the evaluate stage reuses them).
    """
    from alignpipe.rewards import score_completions

    rows = list(rows)
    if completions is None:
        completions = heldout_completions(model, tokenizer, rows, settings)
    scores = score_completions(rows, completions)
    result = {
        "accuracy": sum(scores) / max(1, len(scores)),
        "mean_length": sum(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions)
        / max(1, len(completions)),
    }
    by_task: dict[str, list[float]] = {}
    for row, score in zip(rows, scores, strict=True):
        by_task.setdefault(row.get("task", "all"), []).append(score)
    for task, values in sorted(by_task.items()):
        result[f"accuracy_{task}"] = sum(values) / len(values)
    return result


def log_heldout(live, ctx: StageContext, model, tokenizer) -> dict[str, float]:
    settings = heldout_settings(ctx)
    rows = read_jsonl(ctx.root / settings["data_path"])
    result = heldout_accuracy(model, tokenizer, rows, settings)
    for key, value in result.items():
        live.summary.setdefault("heldout", {})[key] = value
    return result


# ----------------------------------------------------------------------------- publish


def publish_model(ctx: StageContext, output: str, model, tokenizer, metrics: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> Path:
    """Save an HF directory with its manifest and resolved config, atomically."""
    final = ctx.output(output)
    with staged_dir(final) as out:
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        write_text_atomic(out / RESOLVED_CONFIG, ctx.resolved_config_yaml())
        write_manifest(
            out,
            type="checkpoint_hf",
            format="hf",
            stage=ctx.name,
            engine="local",
            inputs=ctx.input_hashes,
            metrics=metrics,
            extra=extra,
        )
    return final


def flat_metrics(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"val": {"loss": 1}}`` -> ``{"val/loss": 1}`` for manifests and model cards."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_metrics(value, f"{name}/"))
        elif isinstance(value, (int, float)):
            out[name] = value
    return out
