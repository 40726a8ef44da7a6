"""GRPO on the local engine, shared by ``rlvr`` (verifier reward) and ``rlhf`` (reward model).

TRL's ``GRPOTrainer`` does rollouts, reference log-probs, the clipped policy-gradient
loss with a k3 KL penalty and its metrics; this module maps NeMo-RL's GRPO keys onto it
and replaces one piece, the advantages: TRL subtracts the group mean *including* the
sample itself, while NeMo-RL v0.7.0 (``grpo.use_leave_one_out_baseline``, on by default)
leaves each sample out of its own baseline and std. ``AlignGRPOTrainer`` therefore
recomputes every batch's advantages with ``alignpipe.rl.advantages``, the same
function the NeMo-RL conventions are tested against, so both settings mean what they
mean on the NeMo-RL engine (see stages/rlvr/README.md for the full key mapping).

A stage supplies a :class:`RewardFn` (rollouts -> one float or ``None`` per completion);
this module runs training, logs per-step metrics to DVCLive, measures the trained policy
against the SFT reference on held-out prompts and publishes the policy.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alignpipe import console
from alignpipe.config import get_path
from alignpipe.context import StageContext
from alignpipe.data.schema import as_conversation
from alignpipe.engines.local import live_log, lora
from alignpipe.engines.local.checkpoints import publish_trained, scheduled, train_resumable
from alignpipe.engines.local.nemo_rl_keys import ProfileKeys, config_file, grpo_keys, stage_keys
from alignpipe.engines.local.tool_rollout import ToolRollouts
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.engines.local.trl_args import refuse_gpu_only_settings, trl_common_args
from alignpipe.engines.local.trl_seams import Seams
from alignpipe.errors import NoLearningSignal, UnsupportedSetting
from alignpipe.jsonl import read_jsonl
from alignpipe.measure.generation import generate, prompt_messages
from alignpipe.measure.heldout import (
    headline,
    log_heldout,
    measures_file,
    sample_heldout,
    samples_file,
)
from alignpipe.measure.logprobs import LOCAL_DTYPE, kl_to_reference, load_policy
from alignpipe.measure.metrics import local_keys
from alignpipe.rewards.verifiers import ROW_FIELDS
from alignpipe.rl.shaping import scale_reward
from alignpipe.timing import record_timing

# NeMo-RL GRPO settings whose effect this engine cannot reproduce: (key, allowed values, why).
_UNSUPPORTED: list[tuple[str, tuple[Any, ...], str]] = [
    ("grpo.use_dynamic_sampling", (None, False), "dynamic sampling (DAPO) is a NeMo-RL loop feature"),
    (
        "grpo.reward_shaping.enabled",
        (None, False),
        "DAPO overlong shaping is NeMo-RL's; use alignpipe.reward_shaping (length_penalty) locally",
    ),
    ("grpo.adv_estimator.name", (None, "grpo"), "only the GRPO advantage estimator is implemented locally"),
    ("grpo.batch_multiplier", (None, 1), "batch_multiplier needs dynamic sampling"),
    ("loss_fn.reference_policy_kl_type", (None, "k3"), "TRL's KL penalty is the k3 estimator"),
    ("loss_fn.use_kl_in_reward", (None, False), "KL-in-reward is not implemented locally"),
    ("loss_fn.use_cispo", (None, False), "CISPO is not mapped to the local engine"),
    ("loss_fn.disable_ppo_ratio", (None, False), "REINFORCE without the PPO ratio is not mapped"),
    ("loss_fn.force_on_policy_ratio", (None, False), "not mapped to the local engine"),
    ("loss_fn.ratio_clip_c", (None,), "dual clipping is not implemented by TRL's GRPO loss"),
    ("loss_fn.positive_example_nll_weight", (None, 0, 0.0), "the positive-example NLL term is not mapped"),
    (
        "loss_fn.use_importance_sampling_correction",
        (None, False),
        "generation and training share one model locally, there is nothing to correct",
    ),
]


def refuse_unsupported_grpo(ctx: StageContext) -> None:
    """Fail with every GRPO setting the local engine would silently ignore, not just the first.
    Turns come from ``alignpipe.tools`` (the only environment that answers a turn): a
    ``grpo.max_rollout_turns`` above 1 without tools, or disagreeing with them, is refused.
    Read without the typed view (nemo_rl_keys): an absent key asks for none of these."""
    refuse_gpu_only_settings(ctx)
    problems = [
        f"{key}={get_path(ctx.config, key)!r}: {why}"
        for key, allowed, why in _UNSUPPORTED
        if get_path(ctx.config, key) not in allowed
    ]
    turns, tools = get_path(ctx.config, "grpo.max_rollout_turns"), ctx.settings.tools
    if not tools.enabled and turns not in (None, 1):
        problems.append(
            f"grpo.max_rollout_turns={turns!r}: a second turn answers a tool call; name tools in alignpipe.tools"
        )
    elif tools.enabled and turns not in (None, 1, tools.max_rollout_turns):
        problems.append(
            f"grpo.max_rollout_turns={turns!r} disagrees with alignpipe.tools.max_rollout_turns="
            f"{tools.max_rollout_turns}: set the turn limit there"
        )
    if problems:
        raise UnsupportedSetting(
            f"stage '{ctx.name}' (profile '{ctx.profile}') sets GRPO options the local engine cannot honour:\n  - "
            + "\n  - ".join(problems)
            + f"\nfix: change them in stages/{ctx.name}/config/{ctx.profile}.yaml (or params.yaml), "
            "or run on the NeMo-RL engine (runtime.engine=nemo_rl)."
        )


# ----------------------------------------------------------------------------- rewards


class RewardFn:
    """A TRL reward function: ``f(prompts, completions, completion_ids, **columns) -> list``.

    ``score(rows, texts, num_tokens, log_metric)`` is what a stage implements: rows are the
    dataset rows (prompt, answer, verifier, task, ...), texts the decoded completions. It
    returns one float per completion, or ``None`` where the reward is unknown (TRL stores
    NaN; the sample is left out of its group's baseline and gets advantage 0). The last
    batch's rewards are kept for :class:`AlignGRPOTrainer`'s advantages.
    """

    __name__ = "reward"
    columns: tuple[str, ...] = ("answer", *ROW_FIELDS, "id")

    def __init__(
        self,
        score: Callable[..., list[float | None]],
        name: str = "reward",
        scaling: dict[str, Any] | None = None,
    ) -> None:
        self.score = score
        self.__name__ = name
        self.scaling = scaling or {}
        self.last: list[float] | None = None
        self.guard: ZeroRewardGuard | None = None  # set by run_grpo

    # Per malformed <tool_call> block of a tool rollout, subtracted from its reward (alignpipe.tools).
    malformed_penalty: float = 0.0

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float | None]:
        answers = kwargs.get("tool_answer")  # a tool rollout: the final turn, without its calls
        if answers is not None:
            texts = ["" if a is None else a for a in answers]
        else:
            texts = [completion_text(c) for c in completions]
        rows = []
        conversations = kwargs.get("conversation") or prompts
        for i in range(len(prompts)):
            # The row's own conversation (without the stage's system turn): what the reward
            # model, which adds its own, and the judge read.
            row = {"prompt": conversations[i]}
            for col in self.columns:
                values = kwargs.get(col)
                if values is not None and values[i] is not None:
                    row[col] = values[i]
            rows.append(row)
        log_metric = kwargs.get("log_metric") or (lambda name, value: None)
        num_tokens = [len(ids) for ids in completion_ids]
        rewards = self.score(rows, texts, num_tokens, log_metric)
        if self.guard is not None:
            self.guard.observe(rows, texts, num_tokens, rewards)
        if answers is not None:
            rewards = self._tool_rewards(rewards, kwargs, log_metric)
        rewards = [None if r is None else scale_reward(float(r), self.scaling) for r in rewards]
        self.last = [math.nan if r is None else r for r in rewards]
        return rewards

    def _tool_rewards(self, rewards: list, columns: dict[str, Any], log_metric) -> list:
        """A tool rollout's reward: less ``malformed_penalty`` per malformed call; and what the
        step's rollouts did with tools (calls per answer, malformed share, turns, time in tools,
        the reward with and without a call)."""
        calls, malformed = columns["tool_calls"], columns["tool_malformed"]
        stats = columns["tool_stats"][0]  # the generation batch's counters, one object per row
        n = max(1, len(calls))
        log_metric("tools/calls_per_answer", sum(calls) / n)
        log_metric("tools/malformed_share", sum(malformed) / max(1, sum(calls)))
        log_metric("tools/turns_per_rollout", sum(columns["tool_turns"]) / n)
        log_metric("tools/errors", float(sum(stats.errors.values())))
        log_metric("tools/seconds", stats.seconds)
        for name, pick in (("with_call", True), ("without_call", False)):
            chosen = [r for r, c in zip(rewards, calls, strict=True) if (c > 0) == pick and r is not None]
            if chosen:
                log_metric(f"tools/reward_{name}", sum(chosen) / len(chosen))
        if not self.malformed_penalty:
            return rewards
        return [
            None if r is None else float(r) - self.malformed_penalty * m
            for r, m in zip(rewards, malformed, strict=True)
        ]


class ZeroRewardGuard:
    """Stops an RL stage whose reward is exactly 0 for every completion of its first ``batches``
    rollout batches. GRPO's advantages are then all 0: the run would publish its starting
    policy as if it had learnt. The error names what it sees of the usual causes: completions
    cut off by the generation cap, answers missing the format the verifier reads, the verifier.
    ``alignpipe.zero_reward_batches: 0`` turns it off."""

    def __init__(self, stage: str, batches: int, max_new_tokens: int) -> None:
        self.stage, self.batches, self.max_new_tokens = stage, batches, max_new_tokens
        self.seen = self.completions = self.capped = self.boxed_asked = self.boxed_found = 0
        self.verifiers: set[str] = set()
        self.example: tuple[str, Any] | None = None
        self.signal = batches <= 0

    def observe(self, rows: list[dict], texts: list[str], num_tokens: list[int], rewards: list) -> None:
        if self.signal:
            return
        if any(r is not None and not math.isnan(float(r)) and float(r) != 0.0 for r in rewards):
            self.signal = True
            return
        self.seen += 1
        self.completions += len(texts)
        self.capped += sum(n >= self.max_new_tokens for n in num_tokens)
        boxed = [i for i, row in enumerate(rows) if row.get("extract") == "boxed"]
        self.boxed_asked += len(boxed)
        self.boxed_found += sum("\\boxed{" in texts[i] for i in boxed)
        self.verifiers.update(str(row.get("verifier") or "exact") for row in rows)
        self.example = self.example or (texts[0], rows[0].get("answer"))
        if self.seen >= self.batches:
            raise NoLearningSignal(self.diagnosis())

    def diagnosis(self) -> str:
        text, answer = self.example or ("", None)
        lines = [
            f"{self.stage}: the reward was 0 for all {self.completions} completions of the first {self.seen} "
            f"rollout batches, so every GRPO advantage is 0 and training would teach nothing.",
            f"  - generation cap: {self.capped / max(1, self.completions):.0%} of completions stopped at "
            f"policy.generation.max_new_tokens={self.max_new_tokens}; raise it if answers are cut off",
        ]
        if self.boxed_asked:
            lines.append(
                f"  - answer format: {self.boxed_found}/{self.boxed_asked} completions contain the \\boxed{{}} "
                f"answer their rows' verifier reads (extract: boxed); teach it in sft or ask for it in the prompt"
            )
        lines.append(
            f"  - verifier(s): {', '.join(sorted(self.verifiers))}; e.g. {text[:80]!r} for answer {answer!r}"
        )
        lines.append(f"  (turn this check off with {self.stage}.alignpipe.zero_reward_batches=0)")
        return "\n".join(lines)


def completion_text(completion: Any) -> str:
    """TRL passes conversational completions as ``[{"role": "assistant", "content": ...}]``."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


# ----------------------------------------------------------------------------- trainer


# What AlignGRPOTrainer overrides and calls of TRL's GRPOTrainer (trl_seams.py).
GRPO_SEAMS = Seams(
    overrides={
        "_generate_and_score_completions": ("self", "inputs"),
        "_compute_loss": ("self", "model", "inputs"),
    },
    calls={
        "_get_per_token_logps_and_entropies": (
            "model",
            "input_ids",
            "attention_mask",
            "logits_to_keep",
            "compute_entropy",
        ),
        "_prepare_inputs": ("generation_batch",),
        "__init__": ("rollout_func",),  # TRL-experimental: the tool rollouts (tool_rollout.py)
    },
)

# TRL options that change GRPOTrainer's loss, at the values the owned loss (AlignGRPOTrainer
# ._compute_loss) assumes: grpo_args never sets them, so a change here is a TRL default that moved.
_LOSS_DEFAULTS = {
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "delta": None,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "use_vllm": False,
    "loss_type": ("dapo", "grpo"),
}


def make_trainer_class():
    """Built lazily so importing this module does not import TRL."""
    import torch
    from transformers import Trainer
    from trl import GRPOTrainer

    from alignpipe.engines.local.trl_seams import check_seams
    from alignpipe.measure.intervals import wilson
    from alignpipe.rl.advantages import reward_std, step_advantages
    from alignpipe.rl.policy_gradient import grpo_loss

    check_seams(GRPOTrainer, GRPO_SEAMS)

    class ValidationInterval(Trainer):
        """Validation accuracy with its 95% Wilson interval over the answers it scored. Sits
        between GRPOTrainer and Trainer in the MRO: GRPOTrainer.log adds the averaged
        ``eval_*`` metrics, and Trainer.log records them in the history a resume replays."""

        def log(self, logs, *args, **kwargs):
            if "eval_verifier_accuracy" in logs and self.eval_dataset is not None:
                n = len(self.eval_dataset) * self.args.num_generations_eval
                low, high = wilson(round(logs["eval_verifier_accuracy"] * n), n)
                logs = {**logs, "eval_verifier_accuracy_low": low, "eval_verifier_accuracy_high": high}
            return super().log(logs, *args, **kwargs)

    class AlignGRPOTrainer(GRPOTrainer, ValidationInterval):
        """TRL's GRPOTrainer for rollouts, reference log-probs and bookkeeping; NeMo-RL v0.7.0's
        advantages and loss, computed by ``alignpipe.rl``. Two seams, both TRL private methods
        (``GRPO_SEAMS``, checked against TRL's signatures when the class is built):
        ``_generate_and_score_completions`` (the advantages) and ``_compute_loss`` (the loss)."""

        def __init__(
            self,
            *args,
            advantage_settings: dict[str, Any],
            kl_settings: dict[str, Any] | None = None,
            **kwargs,
        ):
            with warnings.catch_warnings():  # rollout_func (tool rollouts) is TRL-experimental: the
                warnings.filterwarnings("ignore", "You are using 'rollout_func'")  # seams check pins it
                super().__init__(*args, **kwargs)
            moved = {
                k: getattr(self.args, k, None)
                for k, v in _LOSS_DEFAULTS.items()
                if getattr(self.args, k, None) not in (v if isinstance(v, tuple) else (v,))
            }
            if moved:
                raise UnsupportedSetting(
                    f"GRPOConfig sets {moved}: the local GRPO loss does not implement them"
                )
            self.advantage_settings = advantage_settings  # see nemo_rl_keys.advantage_settings()
            self.kl_settings = kl_settings or {}  # see nemo_rl_keys.LossFnKeys.kl_settings

        def _generate_and_score_completions(self, inputs):
            """Seam 1: TRL's rollout and scoring, then the advantages recomputed by
            :func:`step_advantages` from the rewards the stage's reward function returned."""
            output = super()._generate_and_score_completions(inputs)
            reward_fn = self.reward_funcs[0]
            rewards = torch.tensor(reward_fn.last, dtype=torch.float32)
            advantages = output["advantages"]
            if rewards.shape[0] != advantages.shape[0]:
                raise RuntimeError(
                    f"reward function scored {rewards.shape[0]} completions but the batch has {advantages.shape[0]}"
                )
            # Groups by identical prompt tokens, as NeMo-RL does (padding masked out).
            prompt_ids = output["prompt_ids"].masked_fill(output["prompt_mask"] == 0, -1).cpu()
            adv = step_advantages(rewards, prompt_ids, **self.advantage_settings)
            output["advantages"] = adv.to(device=advantages.device, dtype=advantages.dtype)
            # TRL's own reward_std went through torch.sqrt: the same statistic, exactly rounded.
            self._metrics["train" if self.model.training else "eval"]["reward_std"][-1] = reward_std(rewards)
            return output

        def evaluate(self, *args, **kwargs):
            """NeMo-RL's validation: each validation prompt sampled once (``num_generations_eval``
            is 1) and scored by the stage's reward. It draws from its own copy of the random
            state, so turning validation on or off leaves what trains unchanged, and the zero-reward
            guard watches rollouts only."""
            reward_fn = self.reward_funcs[0]
            guard, reward_fn.guard = reward_fn.guard, None
            try:
                with torch.random.fork_rng(devices=[]):
                    return super().evaluate(*args, **kwargs)
            finally:
                reward_fn.guard = guard

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            """A validation batch is generated and scored, as NeMo-RL's validate() does, and that
            is all: no validation metric reports a loss, so none is computed."""
            self._prepare_inputs(inputs)  # eval mode: generates, scores, records the metrics
            return None, None, None

        def _compute_loss(self, model, inputs):
            """Seam 2: :func:`alignpipe.rl.policy_gradient.grpo_loss` on the policy's log-probs
            (TRL's fused head), reduced over the tokens the policy wrote (a ``tool_mask`` from
            TRL's tool loop leaves tool results out), and the metrics TRL's own loss logs."""
            completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                model,
                torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                completion_ids.size(1),
                compute_entropy=True,
            )
            old = inputs.get("old_per_token_logps")  # None when every step is on-policy
            mode = "train" if self.model.training else "eval"
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            token_level = self.loss_type == "dapo"
            if token_level:  # the generation batch's token count, scaled to this micro-batch
                normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
                if mode == "train":
                    normalizer = normalizer * accumulation / self.args.steps_per_generation
            else:
                normalizer = accumulation
            clip = (self.epsilon_low, self.epsilon_high)
            out = grpo_loss(
                logps,
                logps.detach() if old is None else old,
                inputs["advantages"],
                mask,
                clip_low=clip[0],
                clip_high=clip[1],
                sequence_level=self.importance_sampling_level == "sequence",
                token_level=token_level,
                normalizer=normalizer,
                kl_penalty=self.beta,
                ref_logps=inputs.get("ref_per_token_logps"),
                kl_input_clamp=self.kl_settings.get("input_clamp", 20.0),
                kl_output_clamp=self.kl_settings.get("output_clamp", 10.0),
            )

            def global_mean(x):  # over the tokens (or, [B, 1], the sequences) of every process
                if x.shape != mask.shape:  # one value per sequence
                    local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
                else:
                    local = torch.stack([(x * mask).sum(), mask.sum().float()])
                totals = self.accelerator.reduce(local, reduction="sum")
                return (totals[0] / totals[1].clamp(min=1.0)).item()

            if out.kl is not None:
                self._metrics[mode]["kl"].append(global_mean(out.kl))
            self._metrics[mode]["entropy"].append(global_mean(entropies))
            clipped = out.clipped(inputs["advantages"], *clip).float()
            self._metrics[mode]["clip_ratio/region_mean"].append(global_mean(clipped))
            return out.loss

    return AlignGRPOTrainer


def grpo_args(ctx: StageContext, output_dir: Path) -> dict[str, Any]:
    """GRPOConfig arguments from NeMo-RL's grpo/loss_fn/policy keys (table in stages/rlvr/README.md)."""
    keys, grpo = stage_keys(ctx), grpo_keys(ctx)
    args = trl_common_args(ctx, output_dir)
    prompts, group = grpo.num_prompts_per_step, grpo.num_generations_per_prompt
    global_bs = keys.policy.train_global_batch_size
    rollouts = prompts * group
    if rollouts % global_bs:
        raise UnsupportedSetting(
            f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt ({prompts} x {group} = {rollouts}) "
            f"must be a multiple of policy.train_global_batch_size ({global_bs}) in "
            f"stages/{ctx.name}/config/{ctx.profile}.yaml: NeMo-RL takes rollouts/global optimizer steps per GRPO step"
        )
    # NeMo-RL counts GRPO steps (one rollout batch each); TRL counts optimizer steps.
    opt_per_grpo = rollouts // global_bs
    # Validation needs validation prompts: without them run_grpo has no set to pass (NeMo-RL
    # would fail at its dataloader), so the period is ignored rather than TRL refusing to start.
    val_period = grpo.val_period if keys.data.validation_path else 0
    gen, loss = grpo.generation, grpo.loss_fn
    args.update(
        max_steps=grpo.max_num_steps * opt_per_grpo,
        save_steps=args["save_steps"] * opt_per_grpo,
        eval_strategy="steps" if val_period else "no",
        eval_steps=val_period * opt_per_grpo if val_period else None,
        eval_on_start=bool(val_period and grpo.val_at_start),
        per_device_eval_batch_size=grpo.val_batch_size,
        logging_steps=1,
        generation_batch_size=rollouts,
        num_generations=group,
        num_generations_eval=1,  # NeMo-RL's validate() samples each validation prompt once
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k or 0,  # TRL's 0: no top-k, NeMo-RL's null
        beta=loss.reference_policy_kl_penalty,
        epsilon=loss.ratio_clip_min,
        epsilon_high=loss.ratio_clip_max,
        importance_sampling_level="sequence" if loss.sequence_level_importance_ratios else "token",
        # token_level_loss: a token mean over the whole global batch (DAPO); else per-sequence means.
        loss_type="dapo" if loss.token_level_loss else "grpo",
        # TRL's own scaling is superseded by AlignGRPOTrainer's advantages; kept consistent for its logs.
        scale_rewards="group" if grpo.advantages["normalize_rewards"] else "none",
        mask_truncated_completions=grpo.overlong_filtering,
        shuffle_dataset=grpo.shuffle,
        num_iterations=1,
        log_completions=False,
        # Local generation keeps every token id; nothing to re-tokenise.
        remove_unused_columns=False,
    )
    return args


def validated(state) -> bool:
    """Whether the current step already ran a validation (periodic, or before a resume)."""
    return any(e.get("step") == state.global_step and "eval_reward" in e for e in state.log_history)


def conversational(rows: list[dict[str, Any]], system: str | None = None) -> list[dict[str, Any]]:
    """Prepared rows -> TRL conversational prompts (after the stage's system turn, if any), with
    the row's own conversation and the columns rewards need kept."""
    keep = [c for c in RewardFn.columns if any(c in r for r in rows)]
    return [
        {
            "prompt": prompt_messages(r["prompt"], system),
            "conversation": as_conversation(r["prompt"]),
            **{c: r.get(c) for c in keep},
        }
        for r in rows
    ]


# ----------------------------------------------------------------------------- run


def validation_rows(ctx: StageContext) -> list[dict[str, Any]] | None:
    """The rows GRPO validates on (the first ``grpo.max_val_samples``), or ``None`` when the
    stage does not validate (no ``grpo.val_period`` or no validation data)."""
    val_path, grpo = stage_keys(ctx).data.validation_path, grpo_keys(ctx)
    if not (val_path and grpo.val_period):
        return None
    rows = read_jsonl(ctx.root / val_path)
    return rows[: grpo.max_val_samples] if grpo.max_val_samples else rows


def policy_answers(ctx: StageContext, rows: list[dict[str, Any]]) -> list[str]:
    """The starting policy's answer to each row, sampled as the stage's rollouts and validation
    answers are (``policy.generation``: token budget, temperature, top-p; ``grpo.seed``), with
    the stage's system prompt."""
    apply_torch_threads(ctx)  # the profile's count, whatever runs first: the same bytes anywhere
    grpo = grpo_keys(ctx)
    gen = grpo.generation
    model, tokenizer = load_policy(lora.full_policy_dir(ctx, str(ctx.input("policy")), LOCAL_DTYPE))
    return generate(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        batch_size=grpo.val_batch_size,
        seed=grpo.seed,
        system=ctx.system_prompt,
    )


def run_grpo(
    ctx: StageContext,
    reward_fn: RewardFn,
    *,
    data_key: str = "data.train.data_path",
    after_training: Callable[[Any, Any, Any, dict], dict[str, Any]] | None = None,
) -> dict[str, float]:
    """Train, evaluate against the SFT reference, publish ``policy_out``. Returns the flat metrics.

    With ``alignpipe.tools``, rollouts are multi-turn (engines/local/tool_rollout.py): the policy
    may call them, up to ``alignpipe.tools.max_rollout_turns`` turns; the reward reads its answer.

    ``after_training(live, samples, reference_samples, measures)`` lets a stage add its own
    held-out metrics (rlhf: reward-model scores) before the summary is written, and per-sample
    measures to publish with the samples (``heldout.measures_file``).
    """
    refuse_unsupported_grpo(ctx)  # before the imports below: a refused setting fails in a second
    max_seq_len = stage_keys(ctx).policy.max_total_sequence_length
    tools = ToolRollouts.from_settings(ctx.settings.tools, config_file(ctx), max_seq_len, ctx.root)
    from datasets import Dataset
    from trl import GRPOConfig

    grpo = grpo_keys(ctx)
    apply_torch_threads(ctx)  # ~9x less CPU per GRPO step on a busy box (benchmarks/grpo_stages.md)
    adapter = lora.lora_settings(ctx)
    policy_path = str(ctx.input("policy"))
    # An SFT adapter stands for its base with the adapter merged (adapters.merged_dir).
    full_path = lora.full_policy_dir(ctx, policy_path, LOCAL_DTYPE)
    model, tokenizer = load_policy(full_path)
    # With LoRA, TRL's reference is this policy with its adapter disabled: no second copy.
    peft = {"peft_config": lora.peft_config(model, adapter)} if adapter else {}
    tokenizer.padding_side = "left"  # TRL generates from left-padded prompts

    train_rows = read_jsonl(ctx.root / ProfileKeys(ctx.config, config_file(ctx)).text(data_key))
    train = Dataset.from_list(conversational(train_rows, ctx.system_prompt))
    val_rows = validation_rows(ctx)
    val = Dataset.from_list(conversational(val_rows, ctx.system_prompt)) if val_rows is not None else None

    args = GRPOConfig(**grpo_args(ctx, ctx.scratch_dir))
    reward_fn.guard = ZeroRewardGuard(
        ctx.name,
        ctx.settings.zero_reward_batches,
        grpo.generation.max_new_tokens,
    )
    live = live_log.open_live(ctx)
    names = local_keys(ctx.name)  # TRL log key -> pipeline metric (measure/metrics.py)
    trainer_cls = scheduled(ctx, make_trainer_class())
    rollout = {}
    if tools is not None:
        reward_fn.malformed_penalty = tools.malformed_penalty
        rollout = {"rollout_func": tools.rollout_func(args)}
    trainer = trainer_cls(
        model=model,
        reward_funcs=[reward_fn],
        args=args,
        **rollout,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tokenizer,
        callbacks=[live_log.make_live_callback(live, names)],
        advantage_settings=dict(grpo.advantages),
        kl_settings=grpo.loss_fn.kl_settings,
        **peft,
    )
    if adapter:
        lora.prepare(ctx, trainer.model, adapter, policy_path, grpo.seed)
    train_resumable(ctx, trainer, live, names)
    if val is not None and grpo.val_at_end and not validated(trainer.state):
        trainer.evaluate()  # logged through the live callback, as the periodic ones are
    policy = trainer.model
    policy.eval()

    heldout_started = time.monotonic()
    reference, _ = load_policy(full_path)
    # Each policy sampled once: this one now, the SFT reference's samples come with models/sft.
    samples = sample_heldout(ctx, policy, tokenizer)
    ref_samples = sample_heldout(ctx, reference, tokenizer, model_dir=policy_path)
    heldout = log_heldout(live, tokenizer, samples)
    ref = log_heldout(live, tokenizer, ref_samples, suffix="_reference")
    max_new = ctx.settings.heldout.max_new_tokens
    kl = kl_to_reference(
        policy, reference, tokenizer, samples.prompts, samples.completions, max_new, samples.system
    )
    live.summary.setdefault("heldout", {})["kl_to_reference"] = kl
    # The hash lineage already took (ctx.input_hashes is cached): no second pass over the files.
    measures = {"kl_to_reference": {"model": ctx.input_hashes["policy"]["hash"], "value": kl}}
    extra = after_training(live, samples, ref_samples, measures) if after_training else {}
    record_timing(ctx.name, "heldout", seconds=time.monotonic() - heldout_started)
    files = {**samples_file(samples), **measures_file(samples, measures)}
    metrics = publish_trained(ctx, "policy_out", policy, tokenizer, live, files=files)
    console.outcome(
        ctx.name,
        {
            "heldout/accuracy": headline(heldout),
            "sft": headline(ref, "_reference"),
            "kl_to_reference": kl,
            **extra,
        },
        ctx.output("policy_out").relative_to(ctx.root),
        ctx.started,
    )
    return metrics
