"""Tool calls in model text and their results: the Hermes/Qwen ``<tool_call>`` convention.

A policy asks for a tool by writing, anywhere in its reply, one block per call::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

which is what Qwen2.5/Qwen3 chat templates render for an assistant turn's ``tool_calls`` and
what their tokenizers were trained on. ``parse_tool_calls`` is the reader, ``render_tool_calls``
the writer; they round-trip. Both are pure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["ERROR_KINDS", "ToolCall", "ToolError", "ToolResult", "parse_tool_calls", "render_tool_calls"]

# Why a call did not produce a result, as counted in batch metrics (ToolResult.error).
ERROR_KINDS = (
    "malformed",  # a <tool_call> block that is not JSON, or names no tool
    "unknown_tool",  # a name the toolset does not have
    "bad_json",  # arguments text that is not JSON
    "bad_arguments",  # arguments that do not match the tool's parameters schema
    "raised",  # the tool ran and raised (or its sandboxed program failed)
    "timeout",  # the tool ran past its wall-clock limit
    "sandbox",  # the sandbox stopped it: a write outside its dir, network, memory, a signal
)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


class ToolError(Exception):
    """Raised by an in-process tool for a refusal the policy should read as is (no type name)."""


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI shapes it: a tool ``name`` and its ``arguments`` as JSON text.

    ``problem`` is set (and ``name`` may be empty) when the call came from a block that could not
    be read: calling it gives the policy an observation that says so, in the block's place.
    """

    name: str
    arguments: str = "{}"
    id: str = ""
    problem: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What one call produced. ``text`` is the observation the policy reads, an error's too.

    ``error`` is "" when the call succeeded, else one of :data:`ERROR_KINDS`; ``seconds`` is the
    wall time from the call's start to its result; ``truncated`` says ``text`` was cut at the
    toolset's output cap (a marker at its end says so too).
    """

    name: str
    text: str
    error: str = ""
    seconds: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.error


def _call_from_block(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCall("", body.strip(), problem=f"the <tool_call> block is not JSON ({e})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(
            "", body.strip(), problem='the <tool_call> block needs {"name": "...", "arguments": {...}}'
        )
    args = obj.get("arguments", {})
    # Models trained on OpenAI traces sometimes write arguments as a JSON string; keep it as text.
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], int]:
    """``text`` -> (content without the calls, calls in order, malformed count).

    Every ``<tool_call>...</tool_call>`` block becomes one ToolCall, a malformed one too (its
    ``problem`` says why), so ``len(calls)`` is the number of blocks and the policy gets one
    observation per block. An unclosed ``<tool_call>`` at the end (a reply cut at max tokens) is
    malformed. Arguments come back as JSON text (``json.dumps`` of the object written).
    """
    calls = [_call_from_block(m.group(1)) for m in _BLOCK.finditer(text)]
    content = _BLOCK.sub("", text)
    if _OPEN in content:
        head, _, tail = content.partition(_OPEN)
        calls.append(ToolCall("", tail.strip(), problem="a <tool_call> block without </tool_call>"))
        content = head
    content = re.sub(r"\n{3,}", "\n\n", content).strip()
    return content, calls, sum(1 for c in calls if c.problem)


def render_tool_calls(content: str, calls: list[ToolCall]) -> str:
    """The text a model writes for ``content`` followed by ``calls`` (parse_tool_calls' inverse)."""
    blocks = []
    for call in calls:
        try:
            args = json.loads(call.arguments)
        except ValueError:
            args = call.arguments
        body = json.dumps({"name": call.name, "arguments": args}, ensure_ascii=False)
        blocks.append(f"{_OPEN}\n{body}\n{_CLOSE}")
    return "\n".join([content.strip(), *blocks] if content.strip() else blocks)
