"""Conversations to token ids and loss masks the way NeMo-RL v0.7.0 makes them, so the local
engine trains the tokens NeMo-RL trains (tests/test_equivalence_data.py compares the two row
for row, running NeMo-RL's own dataset classes and processors).

NeMo-RL (data/llm_message_utils.py ``get_formatted_message_log``) cuts a conversation into
turns by rendering the chat template over ``turns[:i+1]`` and keeping what turn ``i`` added:

* with ``add_generation_prompt: false`` the assistant header belongs to the assistant turn,
  so it is trained (TRL's completion mask leaves it out);
* a BOS goes in front when the template does not start with one (``add_bos``), an EOS at the
  end when the text does not end with one, trailing newlines aside (``add_eos``);
* each turn is tokenised on its own, without special tokens;
* ``data/processors.py``: a conversation too long for ``max_input_seq_length`` keeps at most
  ``min(4, max // turns)`` tokens per turn and weight 0 (sft: ``>=``; preference pairs: ``>``):
  it stays in its batch and trains nothing, where TRL would truncate or drop it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Turn = dict[str, Any]


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def turn_token_ids(
    tokenizer,
    turns: Sequence[Turn],
    *,
    add_bos: bool = True,
    add_eos: bool = True,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
) -> list[list[int]]:
    """Token ids of each turn, in order (``get_formatted_message_log``; ``tools``: the row's
    tool schemas, rendered by the template as NeMo-RL's ``sft_processor`` passes them)."""
    chunks: list[list[int]] = []
    previous = ""
    for i, turn in enumerate(turns):
        text = tokenizer.apply_chat_template(
            list(turns[: i + 1]),
            tokenize=False,
            add_generation_prompt=add_generation_prompt and turn["role"] in ("user", "tool"),
            tools=tools,
        )
        chunk = text[_first_difference(previous, text) :]
        if i == 0 and add_bos and tokenizer.bos_token and not chunk.startswith(tokenizer.bos_token):
            chunk = tokenizer.bos_token + chunk
        if i == len(turns) - 1 and add_eos and tokenizer.eos_token:
            if not chunk.rstrip("\n").endswith(tokenizer.eos_token):
                chunk += tokenizer.eos_token
        chunks.append(tokenizer(chunk, add_special_tokens=False)["input_ids"])
        previous = text
    return chunks


def _shorten(chunks: list[list[int]], max_length: int) -> list[list[int]]:
    keep = min(4, max_length // len(chunks))
    return [c[:keep] for c in chunks]


def sft_example(
    tokenizer,
    turns: Sequence[Turn],
    *,
    max_length: int,
    add_bos: bool = True,
    add_eos: bool = True,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
) -> dict[str, list[int]]:
    """One SFT row as TRL's pre-tokenised format: ``input_ids`` and ``completion_mask`` (1 on
    assistant turns), all-zero mask when NeMo-RL's ``sft_processor`` would give it weight 0."""
    chunks = turn_token_ids(
        tokenizer,
        turns,
        add_bos=add_bos,
        add_eos=add_eos,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
    )
    trained = [turn["role"] == "assistant" for turn in turns]
    if sum(map(len, chunks)) >= max_length:
        chunks, trained = _shorten(chunks, max_length), [False] * len(turns)
    ids = [t for c in chunks for t in c]
    mask = [int(on) for c, on in zip(chunks, trained, strict=True) for _ in c]
    return {"input_ids": ids, "completion_mask": mask}


def preference_example(
    tokenizer, context: Sequence[Turn], chosen: Turn, rejected: Turn, *, max_length: int
) -> dict[str, Any]:
    """One preference pair as NeMo-RL's ``preference_preprocessor`` makes it (BOS and EOS on,
    no generation prompt): per side the ids and the mask of its last turn (the completion),
    and ``weight`` 0 when the longer side exceeds ``max_length``."""
    sides = {}
    too_long = False
    for name, last in (("chosen", chosen), ("rejected", rejected)):
        sides[name] = turn_token_ids(tokenizer, [*context, last])
        too_long |= sum(map(len, sides[name])) > max_length
    out: dict[str, Any] = {"weight": 0.0 if too_long else 1.0}
    for name, chunks in sides.items():
        if too_long:
            chunks = _shorten(chunks, max_length)
        out[f"{name}_input_ids"] = [t for c in chunks for t in c]
        out[f"{name}_completion_mask"] = [0] * sum(map(len, chunks[:-1])) + [1] * len(chunks[-1])
    return out


def unrendered_tool_names(tokenizer, turns: Sequence[Turn], tools: list[dict] | None) -> list[str]:
    """Names of the tools and tool calls of a conversation that its chat template leaves out.

    Templates ignore what they do not know: one without tool support renders a tool-calling
    conversation with the calls (and the schemas) silently dropped, and the model would learn
    to answer without them. A name that is missing from the rendered text is that case."""
    names = [t.get("function", t)["name"] for t in tools or []]
    names += [c["function"]["name"] for turn in turns for c in turn.get("tool_calls") or []]
    if not names:
        return []
    text = tokenizer.apply_chat_template(list(turns), tokenize=False, tools=tools)
    return [n for n in dict.fromkeys(names) if n not in text]
