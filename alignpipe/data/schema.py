"""Row schemas of ``data/prepared`` (DEVELOPING.md, "Prepared data") and content ids."""

from __future__ import annotations

import hashlib
import json
from typing import Any

FAMILIES = ("sft", "preference", "rlvr", "rlhf")
SPLITS = ("train", "validation", "test")
VERIFIERS = ("exact", "numeric", "math", "code")

_RL_FIELDS = {
    "id": "str",
    "task": "str",
    "prompt": "str",
    "answer": "str",
    "verifier": "str (" + "|".join(VERIFIERS) + ")",
    "tests": "list[str] (optional; required when verifier is code)",
    "extract": "str (optional; boxed: exact/numeric score the completion's last \\boxed{...})",
}

# Field names and types per family, as recorded in manifest.json.
SCHEMA: dict[str, dict[str, str]] = {
    "sft": {"id": "str", "task": "str", "messages": "list[{role: str, content: str}] (user, assistant)"},
    "preference": {"id": "str", "task": "str", "prompt": "str", "chosen": "str", "rejected": "str"},
    "rlvr": dict(_RL_FIELDS),
    "rlhf": dict(_RL_FIELDS),
}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def row_id(family: str, row: dict[str, Any]) -> str:
    """Content hash of a row (its family and every field but ``id``): equal content, equal id."""
    body = {k: v for k, v in row.items() if k != "id"}
    return hashlib.sha256(canonical_json({"family": family, "row": body}).encode()).hexdigest()[:16]


def with_id(family: str, row: dict[str, Any]) -> dict[str, Any]:
    """The row with ``id`` first and ``task`` second, as written to JSONL."""
    rid = row_id(family, row)
    out = {"id": rid, "task": row["task"]}
    out.update((k, v) for k, v in row.items() if k not in ("id", "task"))
    return out


def prompt_of(family: str, row: dict[str, Any]) -> str:
    """The prompt a row is keyed by for splitting: its user turn(s) in every family.

    ``prompt`` for preference/rlvr/rlhf; for sft the user turns of ``messages`` (joined by a
    newline), so a system turn or earlier assistant turns never move a prompt to another split.
    """
    if family == "sft":
        return "\n".join(m["content"] for m in row["messages"] if m.get("role") == "user")
    return row["prompt"]
