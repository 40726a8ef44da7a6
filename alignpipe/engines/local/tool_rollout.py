"""Multi-turn GRPO rollouts in which the policy calls tools, on the local engine: the loop of
:mod:`alignpipe.measure.tool_generation` (NeMo-RL's ``run_multi_turn_rollout``) as TRL's
``rollout_func``.

It plugs into TRL's ``GRPOTrainer`` as its public ``rollout_func``: the completion is every
token after the prompt, policy and tool alike, and ``env_mask`` (TRL's name; the trainer's
``tool_mask``) is 0 on the tool tokens, so the loss, the KL term and the logged lengths cover
the policy's own tokens only. The reward reads ``tool_answer``, the final turn without its
calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignpipe.measure.tool_generation import tool_rollouts
from alignpipe.tools.toolset import Toolset

__all__ = ["ToolRollouts", "make_rollout_func"]


def make_rollout_func(toolset: Toolset, *, max_turns: int, max_new_tokens: int, max_seq_len: int):
    """TRL's ``rollout_func(prompts, trainer)``: the conversational prompts of a generation batch
    (each already repeated once per generation) rendered with the toolset's schemas, rolled out
    with tools, sampling as the trainer samples single turns (its generation config). Extra
    fields reach the reward function as columns: ``tool_answer``, ``tool_calls``,
    ``tool_malformed``, ``tool_turns``; ``tool_stats`` holds the batch's counters."""

    def rollout(prompts: list, trainer) -> dict[str, Any]:
        from trl.models import unwrap_model_for_generation

        tokenizer = trainer.processing_class
        prompt_ids = [
            tokenizer.apply_chat_template(
                p, add_generation_prompt=True, tools=toolset.schemas(), return_dict=False
            )
            for p in prompts
        ]
        # As TRL generates a single turn: gradient checkpointing off (with it, generation has no
        # cache and the tiny model's turns come out wrong), the trainer's sampling settings.
        with unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model:
            rollouts, stats = tool_rollouts(
                model,
                tokenizer,
                prompt_ids,
                toolset,
                max_turns=max_turns,
                max_new_tokens=max_new_tokens,
                max_seq_len=max_seq_len,
                sampling={"generation_config": trainer.generation_config},
            )
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": None,
            "env_mask": [r.env_mask for r in rollouts],
            "tool_answer": [r.answer for r in rollouts],
            "tool_calls": [r.calls for r in rollouts],
            "tool_malformed": [r.malformed for r in rollouts],
            "tool_turns": [r.turns for r in rollouts],
            "tool_stats": stats,
        }

    return rollout


@dataclass(frozen=True)
class ToolRollouts:
    """What a GRPO stage needs to roll out with tools (``alignpipe.tools``): the toolset, the turn
    limit and the reward's penalty per malformed call."""

    toolset: Toolset
    max_turns: int
    max_seq_len: int  # policy.max_total_sequence_length: prompt and every turn together
    malformed_penalty: float = 0.0

    @classmethod
    def from_settings(cls, settings, where: str, max_seq_len: int, repo: Path) -> ToolRollouts | None:
        """The stage's ``alignpipe.tools`` (alignpipe.settings.Tools), or None when it names no
        tool. A tool that does not exist, cannot be imported or is not tracked in ``repo``'s
        tools/ is refused here, before training."""
        from alignpipe.tools import build_toolset

        if not settings.enabled:
            return None
        toolset = build_toolset(settings.toolset_config(), where=f"{where}: alignpipe.tools", repo=repo)
        return cls(toolset, settings.max_rollout_turns, max_seq_len, settings.malformed_penalty)

    def rollout_func(self, args):
        """TRL's ``rollout_func`` for a GRPOConfig ``args``: each turn at most its
        ``max_completion_length`` (policy.generation.max_new_tokens) new tokens, as NeMo-RL."""
        return make_rollout_func(
            self.toolset,
            max_turns=self.max_turns,
            max_new_tokens=args.max_completion_length,
            max_seq_len=self.max_seq_len,
        )
