"""One turn of a tool-using rollout, the same on both engines.

After the policy writes an assistant turn, :func:`respond` reads its ``<tool_call>`` blocks, runs
every call of the batch at once (:func:`run_calls`) and says, per rollout, whether it is done
and, if not, the observation to append before the policy's next turn. The observation is text
that both engines tokenise as it is, without a chat template (NeMo-RL v0.7.0's
``run_multi_turn_rollout`` does ``tokenizer(content, add_special_tokens=False)``): so it is what
the policy's chat template writes for the tool turns plus the next assistant header
(:func:`observation_text`). Its tokens are context: the loss never trains on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignpipe.errors import ConfigError
from alignpipe.tools.batch import ToolStats, run_calls
from alignpipe.tools.calls import ToolCall, ToolResult, parse_tool_calls
from alignpipe.tools.toolset import Toolset

__all__ = ["Turn", "observation_text", "respond", "tool_messages"]

# A conversation the chat template renders before the tool turns, so that the observation is
# what the template adds after an assistant turn (TRL's tool loop takes the same difference).
_BEFORE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@dataclass(frozen=True)
class Turn:
    """What the environment answers to one assistant turn.

    ``done``: the rollout ends here (no call, or the turn limit); ``answer`` is then the text the
    reward reads (the turn without its call blocks). Otherwise ``observation`` is the text to
    append, one tool turn per call, in the calls' order.
    """

    done: bool
    answer: str | None
    observation: str | None
    calls: tuple[ToolCall, ...]
    results: tuple[ToolResult, ...]

    @property
    def malformed(self) -> int:
        return sum(1 for c in self.calls if c.problem)


def tool_messages(calls: list[ToolCall] | tuple[ToolCall, ...], results) -> list[dict]:
    """The OpenAI ``tool`` turns answering ``calls``, one per call."""
    return [
        {"role": "tool", "name": call.name, "content": result.text}
        for call, result in zip(calls, results, strict=True)
    ]


def observation_text(tokenizer, messages: list[dict]) -> str:
    """The text ``tokenizer``'s chat template writes for tool ``messages`` after an assistant
    turn, with the next assistant header. Refuses a template that rewrites earlier turns once
    later ones exist (it is not prefix-preserving, and a rollout could not append to it)."""
    before = tokenizer.apply_chat_template(_BEFORE, tokenize=False)
    after = tokenizer.apply_chat_template([*_BEFORE, *messages], tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ConfigError(
            "the policy's chat template renders earlier turns differently once tool turns follow, so a "
            "multi-turn rollout cannot append to it: use a prefix-preserving template (stages/base/config "
            "tokenizer.tools for the tiny model)"
        )
    return after[len(before) :]


def respond(
    tokenizer, toolset: Toolset, texts: list[str], *, last_turn: bool
) -> tuple[list[Turn], ToolStats]:
    """The environment's answer to a batch of assistant turns ``texts`` (decoded, special tokens
    dropped). On ``last_turn`` every rollout ends: its calls are not run."""
    parsed = [parse_tool_calls(text) for text in texts]
    pending = [] if last_turn else [(i, call) for i, (_, calls, _) in enumerate(parsed) for call in calls]
    results, stats = run_calls(toolset, [call for _, call in pending])
    by_rollout: dict[int, list[ToolResult]] = {}
    for (i, _), result in zip(pending, results, strict=True):
        by_rollout.setdefault(i, []).append(result)
    turns = []
    for i, (content, calls, _) in enumerate(parsed):
        answered = by_rollout.get(i)
        if not answered:
            turns.append(Turn(True, content, None, tuple(calls), ()))
            continue
        observation = observation_text(tokenizer, tool_messages(calls, answered))
        turns.append(Turn(False, None, observation, tuple(calls), tuple(answered)))
    return turns, stats
