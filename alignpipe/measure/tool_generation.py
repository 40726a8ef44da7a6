"""Multi-turn generation in which the policy calls tools: the loop of NeMo-RL v0.7.0's
``run_multi_turn_rollout``, with the policy generating through transformers. Shared by GRPO's
rollouts (engines/local/tool_rollout.py) and held-out sampling (measure/heldout.py).

Each turn the active rollouts generate until their end-of-turn token, the environment
(:func:`alignpipe.tools.episode.respond`, shared with the NeMo-RL engine) runs every call of the
batch at once, and a rollout that called a tool gets the observation's tokens (its raw text
tokenised, as NeMo-RL does) and its next turn. A rollout ends when it answers without a call,
at ``max_turns``, or when its tokens reach the completion budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from alignpipe.tools.batch import ToolStats
from alignpipe.tools.episode import respond
from alignpipe.tools.toolset import Toolset

__all__ = ["Rollout", "tool_rollouts"]


@dataclass
class Rollout:
    """One rollout's tokens and what happened in it. ``env_mask`` is 1 on the policy's tokens."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    answer: str | None = None  # the final turn without its calls; None when cut off mid-call
    turns: int = 0
    calls: int = 0
    malformed: int = 0
    done: bool = False

    def extend(self, ids: list[int], policy: bool) -> None:
        self.completion_ids.extend(ids)
        self.env_mask.extend([int(policy)] * len(ids))


def _generate_turn(model, tokenizer, rollouts: list[Rollout], max_new_tokens: int, sampling: dict[str, Any]):
    """Each rollout's next assistant turn: new token ids up to and including the end-of-turn
    token (or the budget), from its prompt and completion so far (left-padded together)."""
    import torch

    rows = [r.prompt_ids + r.completion_ids for r in rollouts]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    attention = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    limits = {"max_new_tokens": max_new_tokens, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad}
    if "generation_config" in sampling:  # the trainer's: a copy with this turn's limits
        settings = {"generation_config": copy.deepcopy(sampling["generation_config"])}
        settings["generation_config"].update(**limits)
    else:
        settings = {**sampling, **limits}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attention, **settings)
    turns = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        turns.append(row)
    return turns


def tool_rollouts(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    toolset: Toolset,
    *,
    max_turns: int,
    max_new_tokens: int,
    max_seq_len: int,
    sampling: dict[str, Any],
) -> tuple[list[Rollout], ToolStats]:
    """Roll every prompt out until it answers, runs out of turns or fills its sequence, with
    NeMo-RL's budgets: each turn at most ``max_new_tokens`` (and what ``max_seq_len`` leaves),
    and an observation that would reach ``max_seq_len`` cut to fit, ending the rollout."""
    rollouts = [Rollout(list(ids)) for ids in prompt_ids]
    stats = ToolStats()
    for turn in range(max_turns):
        active = [r for r in rollouts if not r.done]
        if not active:
            break
        budgets = [
            min(max_new_tokens, max_seq_len - len(r.prompt_ids) - len(r.completion_ids)) for r in active
        ]
        generated = _generate_turn(model, tokenizer, active, max(budgets), sampling)
        generated = [ids[:budget] for ids, budget in zip(generated, budgets, strict=True)]
        for r, ids in zip(active, generated, strict=True):
            r.extend(ids, policy=True)
            r.turns += 1
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        answers, turn_stats = respond(tokenizer, toolset, texts, last_turn=turn == max_turns - 1)
        stats.calls += turn_stats.calls
        stats.truncated += turn_stats.truncated
        stats.seconds += turn_stats.seconds
        for kind, n in turn_stats.errors.items():
            stats.errors[kind] = stats.errors.get(kind, 0) + n
        for r, answer in zip(active, answers, strict=True):
            r.calls += len(answer.calls)
            r.malformed += answer.malformed
            if answer.done:
                r.done, r.answer = True, answer.answer
                continue
            obs = tokenizer(answer.observation, add_special_tokens=False)["input_ids"]
            room = max_seq_len - len(r.prompt_ids) - len(r.completion_ids)
            if len(obs) >= room:  # as NeMo-RL: the observation cut to fit, and the rollout ends
                obs, r.done = obs[: max(room, 0)], True
            r.extend(obs, policy=False)
    return rollouts, stats


def generate_with_tools(
    model,
    tokenizer,
    prompts: list,
    toolset: Toolset,
    *,
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    batch_size: int = 128,
    seed: int = 0,
    system: str | None = None,
) -> list[Rollout]:
    """:func:`alignpipe.measure.generation.generate` with tools: one seeded rollout per prompt,
    the toolset's schemas in every prompt, ``max_new_tokens`` per turn, within the model's
    context (``max_position_embeddings``)."""
    from alignpipe.measure.generation import prompt_messages, seeded_batches

    model.eval()
    sampling = {"do_sample": temperature > 0}
    if temperature > 0:
        sampling.update(temperature=temperature, top_p=top_p, top_k=0)
    rollouts: list[Rollout] = []
    for chunk in seeded_batches(prompts, batch_size, seed):
        ids = [
            tokenizer.apply_chat_template(
                prompt_messages(p, system),
                add_generation_prompt=True,
                tools=toolset.schemas(),
                return_dict=False,
            )
            for p in chunk
        ]
        batch, _ = tool_rollouts(
            model,
            tokenizer,
            ids,
            toolset,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            max_seq_len=model.config.max_position_embeddings,
            sampling=sampling,
        )
        rollouts.extend(batch)
    return rollouts
