"""Prepared RL rows -> NeMo-Gym rows (``NemoGymDataset``, nemo-rl.md §6 "NeMo-Gym data").

Gym reads raw JSONL where each line is ``{"responses_create_params": {"input": [...]},
"agent_ref": {...}, <task fields>}`` (``agent_ref`` is what Gym's ``ng_prepare_data`` adds).
The prepared ``rlvr``/``rlhf`` rows (``prompt`` -- the conversation, system turn included --,
``answer``, ``verifier``) become that shape, the conversation as the Responses API ``input``,
with the answer kept as ``expected_answer`` (math_with_judge's field) and the original row
fields kept alongside, as the Nemotron runner's ``materialize_nemo_gym_response_data`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from alignpipe.artifacts import write_text_atomic
from alignpipe.data.schema import as_conversation
from alignpipe.errors import ConfigError


def agent_ref(spec: str | dict[str, Any]) -> dict[str, Any]:
    """``"responses_api_agents/math_with_judge_simple_agent"`` -> ``{"type": ..., "name": ...}``."""
    if isinstance(spec, dict):
        return dict(spec)
    kind, sep, name = str(spec).partition("/")
    if not sep or not kind or not name:
        raise ConfigError(
            f"alignpipe.nemo_gym.default_agent_ref '{spec}' must look like '<type>/<name>', "
            f"e.g. responses_api_agents/math_with_judge_simple_agent"
        )
    return {"type": kind, "name": name}


# Gym's math_with_judge reads the final answer from \boxed{}; its own data asks for one in these
# words (resources_servers/math_with_judge/data/example.jsonl). Rows for a math_with_judge agent
# get them; prompts that already ask for a box keep theirs.
BOXED_INSTRUCTION = (
    "Solve the following math problem. Make sure to put the answer (and only answer) inside \\boxed{}.\n\n"
)


def to_gym_row(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    if "responses_create_params" in row:  # already Gym-shaped
        return {"agent_ref": ref, **row}
    if "prompt" not in row:
        raise ConfigError(
            f"row {row.get('id', '?')} has no 'prompt' (prepared rlvr/rlhf rows need prompt and answer)"
        )
    turns = as_conversation(row["prompt"])
    question = turns[-1]["content"]  # the user turn the reply answers
    if "math_with_judge" in str(ref.get("name", "")) and "\\boxed" not in question:
        turns[-1] = {**turns[-1], "content": BOXED_INSTRUCTION + question}
    gym = {
        "responses_create_params": {"input": turns},
        "agent_ref": ref,
        "question": question,
    }
    if "answer" in row:
        gym["expected_answer"] = str(row["answer"])
    for key, value in row.items():
        gym.setdefault(key, value)
    return gym


def convert_file(src: Path, dst: Path, ref: dict[str, Any]) -> int:
    """Write ``dst`` (atomically) from ``src``; returns the number of rows."""
    lines = []
    with open(src) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{src}:{n}: not valid JSON ({e})") from e
            lines.append(json.dumps(to_gym_row(row, ref), ensure_ascii=False))
    write_text_atomic(dst, "\n".join(lines) + ("\n" if lines else ""))
    return len(lines)
