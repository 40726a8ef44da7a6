"""Row schemas of ``data/prepared`` (DEVELOPING.md, "Prepared data"), conversations and content ids.

Every family carries conversations as OpenAI-style messages (``{"role", "content"}``): ``sft``
rows a whole ``messages`` list; ``preference``, ``rlvr`` and ``rlhf`` rows a ``prompt`` that is
the conversation before the reply (an optional system turn first, then the turns so far, ending
with a user turn) -- NeMo-RL's ``BinaryPreferenceDataset`` list prompt and TRL's conversational
prompt.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

FAMILIES = ("sft", "preference", "rlvr", "rlhf")
SPLITS = ("train", "validation", "test")
VERIFIERS = ("exact", "numeric", "math", "code")

CONVERSATION = "list[{role: str, content: str}] (optional system first, turns so far, last a user turn)"

_RL_FIELDS = {
    "id": "str",
    "task": "str",
    "prompt": CONVERSATION,
    "answer": "str",
    "verifier": "str (" + "|".join(VERIFIERS) + ")",
    "tests": "list[str] (optional; required when verifier is code)",
    "extract": "str (optional; boxed: exact/numeric score the completion's last \\boxed{...})",
    "tools": "list[tool schema] (optional; the tools a tool rollout offers, alignpipe.tools)",
}

# Field names and types per family, as recorded in manifest.json.
SCHEMA: dict[str, dict[str, str]] = {
    "sft": {
        "id": "str",
        "task": "str",
        "messages": "list[{role: str, content: str}] (optional system first, last an assistant turn; "
        "assistant turns may carry tool_calls, tool turns tool_call_id/name)",
        "tools": "list[tool schema] (optional; tool-calling rows)",
    },
    "preference": {"id": "str", "task": "str", "prompt": CONVERSATION, "chosen": "str", "rejected": "str"},
    "rlvr": dict(_RL_FIELDS),
    "rlhf": dict(_RL_FIELDS),
}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


Message = dict[str, str]


def as_conversation(prompt: str | list[Message]) -> list[Message]:
    """A prompt as messages: a string is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def single_turn(prompt: str | list[Message]) -> str | None:
    """The text of a prompt that is one user turn (no system turn, no earlier turns), else None."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and prompt[0].get("role") == "user":
        return prompt[0]["content"]
    return None


def user_text(prompt: str | list[Message]) -> str:
    """The user turn(s) of a prompt, joined by a newline: what a split is keyed by."""
    return "\n".join(m["content"] for m in as_conversation(prompt) if m.get("role") == "user")


def transcript(prompt: str | list[Message]) -> str:
    """A prompt as plain text for a judge's template: a single user turn is its text; a
    conversation is one ``role: content`` line per turn."""
    text = single_turn(prompt)
    if text is not None:
        return text
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def row_id(family: str, row: dict[str, Any]) -> str:
    """Content hash of a row (its family and every field but ``id``): equal content, equal id.

    A prompt that is one user turn is hashed as its text, so a single-turn row keeps the id it
    had when prompts were strings, and a string or a one-message prompt give the same row."""
    body = {k: v for k, v in row.items() if k != "id"}
    if "prompt" in body and single_turn(body["prompt"]) is not None:
        body["prompt"] = single_turn(body["prompt"])
    return hashlib.sha256(canonical_json({"family": family, "row": body}).encode()).hexdigest()[:16]


def with_id(family: str, row: dict[str, Any]) -> dict[str, Any]:
    """The row with ``id`` first and ``task`` second and its prompt as messages, as written to JSONL."""
    rid = row_id(family, row)
    out = {"id": rid, "task": row["task"]}
    out.update((k, v) for k, v in row.items() if k not in ("id", "task"))
    if "prompt" in out:  # written as messages in every family (builtin rows carry a string)
        out["prompt"] = as_conversation(out["prompt"])
    return out


def prompt_of(family: str, row: dict[str, Any]) -> str:
    """The prompt a row is keyed by for splitting: its user turn(s) in every family (joined by a
    newline), so a system turn or earlier assistant turns never move a prompt to another split."""
    return user_text(row["messages"] if family == "sft" else row["prompt"])
