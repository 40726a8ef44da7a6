"""NeMo-RL record formats -> prepared rows, with checks that name the source's own keys.

Formats (``format:``) and the families they can feed (``family:``); each matches what a
NeMo-RL v0.7.0 dataset class reads:

* ``binary_preference`` (BinaryPreferenceDataset: ``prompt_key``/``chosen_key``/``rejected_key``) -> preference
* ``preference`` (PreferenceDataset: ``context`` messages + exactly two ``completions`` with ``rank``) -> preference
* ``ultrafeedback`` (``chosen``/``rejected`` conversations sharing their prompt turns, optional
  ``prompt``; the shape Tulu3PreferenceDataset reads, e.g. HuggingFaceH4/ultrafeedback_binarized) -> preference
* ``helpsteer3`` (HelpSteer3Dataset: ``context``, ``response1``/``response2``,
  ``overall_preference`` in -3..3; < 0 prefers response1, > 0 response2, 0 is a tie and dropped) -> preference
* ``response`` (ResponseDataset: ``input_key``/``output_key``, default ``input``/``output``) -> sft, rlvr, rlhf
* ``messages`` (OpenAI ``messages``) -> sft, rlvr, rlhf; for sft also tool calling: assistant
  ``tool_calls``, ``tool`` turns and the record's ``tools`` (``tools_key``), as OpenAIFormatDataset reads them

and the community formats (data-formats conventions of LLaMA-Factory, Axolotl and TRL):

* ``sharegpt`` (``conversations`` of ``{from, value}`` turns; ``human``/``user``, ``gpt``/
  ``assistant``/``model``, ``system``, ``tool``; an optional ``system`` column) -> every family
  (preference: the conversation ends with the user's turn, ``chosen``/``rejected`` the replies);
  for sft also function calling as glaive, LLaMA-Factory and Axolotl write it: ``function_call``
  turns (JSON ``{name, arguments}``, or a list of them) become assistant ``tool_calls``,
  ``observation`` turns ``tool`` turns, and the ``tools`` column (a JSON string) the row's tools
* ``alpaca`` (``instruction``, optional ``input`` joined to it by a newline, ``output``; optional
  ``system`` and ``history`` of earlier ``[instruction, response]`` pairs) -> every family
  (preference: ``chosen``/``rejected`` instead of ``output``)
* ``hh_rlhf`` (Anthropic HH-RLHF: ``chosen``/``rejected`` transcripts of ``\n\nHuman: ``/
  ``\n\nAssistant: `` turns sharing all but the last reply) -> preference

A prompt (``prompt``/``context``/``input``, or the turns before the reply) may be a string or a
conversation (an optional system turn first, earlier turns, a last user turn); every family
keeps it whole as a message list (``alignpipe.data.schema``).

``answer_format: gsm8k`` keeps only the final answer after GSM8K's ``#### `` marker (as
NeMo-RL's GSM8KDataset does with ``extract_answer``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from alignpipe.data.schema import VERIFIERS
from alignpipe.errors import DataError

FORMATS: dict[str, tuple[str, ...]] = {
    "binary_preference": ("preference",),
    "preference": ("preference",),
    "ultrafeedback": ("preference",),
    "helpsteer3": ("preference",),
    "hh_rlhf": ("preference",),
    "response": ("sft", "rlvr", "rlhf"),
    "messages": ("sft", "rlvr", "rlhf"),
    "sharegpt": ("sft", "preference", "rlvr", "rlhf"),
    "alpaca": ("sft", "preference", "rlvr", "rlhf"),
}
# ShareGPT speakers (``from``) -> roles, as LLaMA-Factory's and Axolotl's defaults read them.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
# ShareGPT's function-calling speakers (glaive, LLaMA-Factory, Axolotl): a call and its result.
SHAREGPT_TOOL_TURNS = ("function_call", "observation")
# Anthropic HH-RLHF transcripts: each turn opens with one of these markers.
HH_MARKERS = {"Human": "user", "Assistant": "assistant"}
ANSWER_FORMATS = ("text", "gsm8k")
ROLES = ("system", "user", "assistant", "tool")
GSM8K_MARKER = "####"


class SourceRecord:
    """One record of a source, with field checks that name the source's own key in errors."""

    def __init__(self, where: str, line: int, rec: Any):
        self.where, self.line, self.rec = where, line, rec
        if not isinstance(rec, dict):
            raise DataError(
                where,
                line,
                None,
                f"expected a JSON object, found {type(rec).__name__}",
                "one object per record",
            )

    def fail(self, field: str | None, problem: str, fix: str = "") -> DataError:
        return DataError(self.where, self.line, field, problem, fix)

    def get(self, key: str, required: bool = True) -> Any:
        if key not in self.rec or self.rec[key] is None:
            if not required:
                return None
            have = ", ".join(sorted(map(str, self.rec))) or "none"
            raise self.fail(
                key, f"is missing (record has: {have})", f"add '{key}', or set the source's key option"
            )
        return self.rec[key]

    def text(self, key: str, value: Any = None, role: str = "assistant") -> str:
        """A non-empty string; a message list is accepted when it is a single turn of ``role``."""
        value = self.get(key) if value is None else value
        if isinstance(value, list):
            msgs = self.messages(key, value)
            if len(msgs) != 1 or msgs[0]["role"] != role:
                fix = "flatten multi-turn conversations to one turn"
                if role == "assistant" and msgs[-1]["role"] == "assistant":
                    fix = "for conversations that end with the reply (UltraFeedback, Tulu 3), use format: ultrafeedback"
                raise self.fail(
                    key, f"must be a string or a single '{role}' message, found {len(msgs)} message(s)", fix
                )
            value = msgs[0]["content"]
        if not isinstance(value, str):
            raise self.fail(
                key, f"must be a string, found {type(value).__name__}", "store text as a JSON string"
            )
        if not value.strip():
            raise self.fail(key, "is empty", "drop the record or fill the field")
        return value

    def messages(self, key: str, value: Any = None, tools: bool = False) -> list[dict[str, Any]]:
        """A non-empty list of ``{role, content}`` messages. With ``tools``, assistant turns may
        carry OpenAI ``tool_calls`` (content then may be empty) and tool turns their
        ``tool_call_id``/``name`` (``tool_turn``)."""
        value = self.get(key) if value is None else value
        if not isinstance(value, list) or not value:
            raise self.fail(
                key, "must be a non-empty list of {role, content} messages", "use OpenAI chat format"
            )
        out = []
        for j, m in enumerate(value):
            if isinstance(m, dict) and (m.get("tool_calls") is not None or "tool_call_id" in m):
                if not tools:
                    raise self.fail(
                        f"{key}[{j}]",
                        "is a tool-call turn; tool-call conversations feed the sft family only",
                        "use family: sft for tool-calling data (format: messages), or drop the record",
                    )
                out.append(self.tool_turn(f"{key}[{j}]", m))
                continue
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise self.fail(
                    f"{key}[{j}]",
                    "must be an object with string 'role' and 'content'",
                    "use OpenAI chat format",
                )
            if m["role"] not in ROLES:
                raise self.fail(
                    f"{key}[{j}].role", f"unknown role '{m['role']}'", f"use one of {', '.join(ROLES)}"
                )
            if not m["content"].strip():
                raise self.fail(f"{key}[{j}].content", "is empty", "drop the message or fill it")
            out.append({"role": m["role"], "content": m["content"]})
        return out

    def tool_turn(self, key: str, m: dict[str, Any]) -> dict[str, Any]:
        """An assistant turn with ``tool_calls`` or a tool result, in the shape transformers'
        chat templates read: ``{"type": "function", "function": {"name", "arguments": {...}}}``
        (OpenAI's JSON-string ``arguments`` parsed into the object templates expect)."""
        role, content = m.get("role"), m.get("content")
        if role == "tool":
            if not isinstance(content, str) or not content.strip():
                raise self.fail(
                    f"{key}.content", "a tool result must be a non-empty string", "fill it or drop the turn"
                )
            turn = {"role": "tool", "content": content}
            for k in ("tool_call_id", "name"):
                if m.get(k) is not None:
                    if not isinstance(m[k], str):
                        raise self.fail(
                            f"{key}.{k}", f"must be a string, found {m[k]!r}", "store it as a string"
                        )
                    turn[k] = m[k]
            return turn
        if role != "assistant":
            raise self.fail(
                f"{key}.role", f"'{role}' turn carries tool_calls", "only assistant turns call tools"
            )
        if content is not None and not isinstance(content, str):
            raise self.fail(f"{key}.content", f"must be a string or null, found {type(content).__name__}")
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not calls:
            raise self.fail(
                f"{key}.tool_calls", "must be a non-empty list", "drop the key when there is no call"
            )
        out_calls = []
        for c, call in enumerate(calls):
            where = f"{key}.tool_calls[{c}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
                raise self.fail(
                    where,
                    "must be {type: function, function: {name, arguments}}",
                    "use OpenAI's tool_calls shape",
                )
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise self.fail(
                        f"{where}.function.arguments", f"is not JSON ({e.msg})", "store a JSON object"
                    ) from None
            if not isinstance(args, dict):
                raise self.fail(
                    f"{where}.function.arguments",
                    f"must be a JSON object, found {type(args).__name__}",
                    "store an object",
                )
            one = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            if isinstance(call.get("id"), str):
                one["id"] = call["id"]
            out_calls.append(one)
        return {"role": "assistant", "content": content or "", "tool_calls": out_calls}

    def tools(self, key: str) -> list[dict[str, Any]] | None:
        """The record's tool schemas (OpenAI ``tools``: a list, or that list as a JSON string
        as LLaMA-Factory and Axolotl store it), each with a function name; None when absent."""
        value = self.rec.get(key)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise self.fail(key, f"is not JSON ({e.msg})", "store a list of tool schemas") from None
        if not isinstance(value, list) or not value:
            raise self.fail(
                key, "must be a non-empty list of tool schemas", "drop the key when there are no tools"
            )
        for j, tool in enumerate(value):
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
                raise self.fail(
                    f"{key}[{j}]",
                    "must be a tool schema with a name ({type: function, function: {name, parameters}})",
                    "use OpenAI's tools shape",
                )
        return value

    def conversation(self, key: str, msgs: list[dict[str, str]]) -> list[dict[str, str]]:
        """The conversation before a reply: an optional system turn first, then the turns so
        far, ending with a user turn (what preference, rlvr and rlhf rows carry as ``prompt``)."""
        self.system_first(key, msgs)
        if msgs[-1]["role"] != "user":
            raise self.fail(
                f"{key}[{len(msgs) - 1}].role",
                f"the prompt must end with a user turn, found '{msgs[-1]['role']}'",
                "drop the trailing turn (it is the reply) or end the context with the user's message",
            )
        return msgs

    def system_first(self, key: str, msgs: list[dict[str, str]]) -> None:
        for j, m in enumerate(msgs):
            if m["role"] == "system" and j > 0:
                raise self.fail(
                    f"{key}[{j}].role",
                    "a system turn can only be the first message",
                    "move it to the front or merge it into the first system turn",
                )

    def prompt(self, key: str, value: Any = None) -> list[dict[str, str]]:
        """A prompt: a string (one user turn) or a list of messages ending with a user turn."""
        value = self.get(key) if value is None else value
        if isinstance(value, list):
            return self.conversation(key, self.messages(key, value))
        return [{"role": "user", "content": self.text(key, value, role="user")}]


def _task(r: SourceRecord, src: dict[str, Any], default: str) -> str:
    key = src.get("task_key", "task")
    value = r.rec.get(key)
    if value is None:
        return str(src.get("task") or default)
    if not isinstance(value, str) or not value.strip():
        raise r.fail(key, "must be a non-empty string", "name the task (e.g. 'sort') or drop the field")
    return value


def final_answer(r: SourceRecord, src: dict[str, Any], answer: str, field: str) -> str:
    """The gold answer under the source's ``answer_format`` (``gsm8k``: the text after ``#### ``)."""
    if src.get("answer_format", "text") != "gsm8k":
        return answer
    if GSM8K_MARKER not in answer:
        raise r.fail(
            field,
            f"has no '{GSM8K_MARKER} <answer>' line (answer_format: gsm8k), found {answer[-60:]!r}",
            "end the solution with '#### <final answer>', or drop answer_format",
        )
    final = answer.rsplit(GSM8K_MARKER, 1)[1].strip()
    if not final:
        raise r.fail(field, f"is empty after '{GSM8K_MARKER}'", "write the final answer after '#### '")
    return final


def _tests(r: SourceRecord, src: dict[str, Any], verifier: str) -> list[str] | None:
    tkey = src.get("tests_key", "tests")
    tests = r.rec.get(tkey)
    if verifier != "code" and tests is None:
        return None
    if tests is None:
        raise r.fail(
            tkey, "is missing: verifier 'code' needs tests", f"add '{tkey}': a list of Python assert strings"
        )
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise r.fail(tkey, "must be a non-empty list of non-empty strings (Python asserts)", "fix the tests")
    return tests


def _rl_fields(
    r: SourceRecord, src: dict[str, Any], prompt: list[dict[str, str]], answer: str, answer_field: str
) -> dict[str, Any]:
    vkey = src.get("verifier_key", "verifier")
    verifier = r.rec.get(vkey, src.get("verifier"))
    if verifier is None:
        raise r.fail(
            vkey,
            "is missing: RLVR/RLHF rows need a verifier",
            f"add '{vkey}' ({'/'.join(VERIFIERS)}) to each row, or set `verifier:` on the source",
        )
    if verifier not in VERIFIERS:
        raise r.fail(vkey, f"unknown verifier {verifier!r}", f"use one of {', '.join(VERIFIERS)}")
    answer = final_answer(r, src, answer, answer_field)
    # _answer_field names the field in a later error (the math gold check); readers drop it.
    row: dict[str, Any] = {
        "prompt": prompt,
        "answer": answer,
        "verifier": verifier,
        "_answer_field": answer_field,
    }
    if verifier == "numeric":
        from alignpipe.rewards.verifiers import parse_number

        if parse_number(answer) is None:
            fix = "fix it or use verifier exact"
            if GSM8K_MARKER in answer:
                fix = "for GSM8K worked solutions ending '#### <answer>', set answer_format: gsm8k on the source"
            raise r.fail(answer_field, f"answer {answer[:80]!r} is not a number (verifier numeric)", fix)
    tests = _tests(r, src, verifier)
    if tests is not None:
        row["tests"] = tests
    return row


def _binary_preference(src: dict[str, Any], r: SourceRecord) -> dict[str, str]:
    pk, ck, rk = (
        src.get("prompt_key", "prompt"),
        src.get("chosen_key", "chosen"),
        src.get("rejected_key", "rejected"),
    )
    return {"prompt": r.prompt(pk), **_pair(r, rk, r.text(ck), r.text(rk))}


def _pair(r: SourceRecord, field: str, chosen: str, rejected: str) -> dict[str, Any]:
    if chosen == rejected:
        raise r.fail(field, "is identical to the chosen response", "drop the pair: it carries no preference")
    return {"chosen": chosen, "rejected": rejected}


def _ranked_preference(src: dict[str, Any], r: SourceRecord) -> dict[str, Any]:
    xk, ck = src.get("context_key", "context"), src.get("completions_key", "completions")
    prompt = r.prompt(xk)
    comps = r.get(ck)
    if not isinstance(comps, list) or len(comps) != 2:
        n = len(comps) if isinstance(comps, list) else type(comps).__name__
        raise r.fail(
            ck, f"must hold exactly two completions, found {n}", "keep one preferred and one rejected"
        )
    ranked = []
    for j, c in enumerate(comps):
        if not isinstance(c, dict) or "completion" not in c:
            raise r.fail(
                f"{ck}[{j}]",
                "must be an object with 'rank' and 'completion'",
                "see NeMo-RL PreferenceDataset",
            )
        rank = c.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int | float):
            raise r.fail(f"{ck}[{j}].rank", f"must be a number, found {rank!r}", "lower rank = preferred")
        ranked.append((rank, r.text(f"{ck}[{j}].completion", c["completion"])))
    if ranked[0][0] == ranked[1][0]:
        raise r.fail(
            f"{ck}[1].rank",
            f"ties rank {ranked[0][0]} of completions[0]",
            "give the preferred one the lower rank",
        )
    (_, chosen), (_, rejected) = sorted(ranked, key=lambda t: t[0])
    return {"prompt": prompt, **_pair(r, ck, chosen, rejected)}


def _ultrafeedback(src: dict[str, Any], r: SourceRecord) -> dict[str, Any]:
    pk, ck, rk = (
        src.get("prompt_key", "prompt"),
        src.get("chosen_key", "chosen"),
        src.get("rejected_key", "rejected"),
    )
    convs = {}
    for key in (ck, rk):
        msgs = r.messages(key)
        if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
            raise r.fail(
                key,
                f"must be a conversation that ends with the assistant's reply, found {len(msgs)} message(s)",
                "store [prompt turns..., {role: assistant, content: reply}]",
            )
        convs[key] = msgs
    if convs[rk][:-1] != convs[ck][:-1]:
        raise r.fail(
            rk,
            f"has other turns before the reply than '{ck}'",
            "both conversations must share the prompt turns (NeMo-RL's Tulu3PreferenceDataset asserts the same)",
        )
    prompt = r.conversation(ck, convs[ck][:-1])
    # UltraFeedback's string ``prompt`` repeats the last user turn; a list must be the context.
    given = r.get(pk, required=False)
    if given is not None:
        same = (
            r.text(pk, role="user").strip() == prompt[-1]["content"].strip()
            if isinstance(given, str)
            else r.prompt(pk) == prompt
        )
        if not same:
            raise r.fail(
                pk, f"differs from the turns before the reply in '{ck}'", f"drop '{pk}' or make it match"
            )
    return {"prompt": prompt, **_pair(r, rk, convs[ck][-1]["content"], convs[rk][-1]["content"])}


def _helpsteer3(src: dict[str, Any], r: SourceRecord) -> dict[str, Any] | None:
    """HelpSteer3's ``overall_preference``: -3..-1 prefer response1, 1..3 response2, 0 = tie (None)."""
    xk, pk = src.get("context_key", "context"), src.get("preference_key", "overall_preference")
    k1, k2 = src.get("response1_key", "response1"), src.get("response2_key", "response2")
    prompt = r.prompt(xk)
    one, two = r.text(k1), r.text(k2)
    pref = r.get(pk)
    if isinstance(pref, float) and pref.is_integer():
        pref = int(pref)
    if isinstance(pref, bool) or not isinstance(pref, int) or not -3 <= pref <= 3:
        raise r.fail(
            pk,
            f"must be an integer in -3..3, found {pref!r}",
            "HelpSteer3: negative prefers response1, positive response2, 0 is a tie",
        )
    if pref == 0:
        return None
    chosen, rejected = (one, two) if pref < 0 else (two, one)
    return {"prompt": prompt, **_pair(r, k2 if pref < 0 else k1, chosen, rejected)}


def _sharegpt_turns(
    src: dict[str, Any], r: SourceRecord, tools: bool = False
) -> tuple[list[dict[str, Any]], str]:
    """A ShareGPT record's ``conversations`` as messages (after its ``system`` column, if any);
    with ``tools`` (sft), function calls and their results as OpenAI tool turns."""
    mk, rk, ck = (
        src.get("messages_key", "conversations"),
        src.get("role_key", "from"),
        src.get("content_key", "value"),
    )
    turns = r.get(mk)
    if not isinstance(turns, list) or not turns:
        raise r.fail(mk, f"must be a non-empty list of {{{rk}, {ck}}} turns", "see the ShareGPT format")
    msgs = [_sharegpt_turn(r, f"{mk}[{j}]", t, rk, ck, tools) for j, t in enumerate(turns)]
    sk = src.get("system_key", "system")
    if r.get(sk, required=False) is not None and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": r.text(sk)})
    return msgs, mk


def _sharegpt_turn(
    r: SourceRecord, where: str, turn: Any, rk: str, ck: str, tools: bool = False
) -> dict[str, Any]:
    if not isinstance(turn, dict) or not isinstance(turn.get(rk), str) or not isinstance(turn.get(ck), str):
        raise r.fail(where, f"must be an object with string '{rk}' and '{ck}'", "see the ShareGPT format")
    if turn[rk] in SHAREGPT_TOOL_TURNS:
        if not tools:
            raise r.fail(
                f"{where}.{rk}",
                f"is a tool-call turn ('{turn[rk]}'); tool-call conversations feed the sft family only",
                "use family: sft for function-calling data, or drop the record",
            )
        return _sharegpt_tool_turn(r, where, turn[rk], turn[ck], ck)
    role = SHAREGPT_ROLES.get(turn[rk])
    if role is None:
        known = ", ".join([*SHAREGPT_ROLES, *SHAREGPT_TOOL_TURNS])
        raise r.fail(
            f"{where}.{rk}", f"unknown role '{turn[rk]}'", f"use one of {known} (or rename it with columns)"
        )
    if not turn[ck].strip():
        raise r.fail(f"{where}.{ck}", "is empty", "drop the turn or fill it")
    return {"role": role, "content": turn[ck]}


def _sharegpt_tool_turn(r: SourceRecord, where: str, speaker: str, value: str, ck: str) -> dict[str, Any]:
    """``observation`` -> a tool turn; ``function_call`` (JSON ``{name, arguments}`` or a list of
    them, ``arguments`` an object or a JSON string) -> an assistant turn calling them."""
    if speaker == "observation":
        return r.tool_turn(where, {"role": "tool", "content": value})
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as e:
        raise r.fail(
            f"{where}.{ck}",
            f"a function_call must be JSON {{name, arguments}} ({e.msg})",
            "store the call as JSON",
        ) from None
    calls = calls if isinstance(calls, list) else [calls]
    return r.tool_turn(
        f"{where}.{ck}",
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": c} for c in calls],
        },
    )


def _sharegpt_preference(src: dict[str, Any], r: SourceRecord) -> dict[str, Any]:
    msgs, mk = _sharegpt_turns(src, r)
    ck, rk = src.get("chosen_key", "chosen"), src.get("rejected_key", "rejected")
    role, content = src.get("role_key", "from"), src.get("content_key", "value")

    def reply(key: str) -> str:
        value = r.get(key)
        if isinstance(value, dict):
            turn = _sharegpt_turn(r, key, value, role, content)
            if turn["role"] != "assistant":
                raise r.fail(f"{key}.{role}", "must be the assistant's reply", "use gpt/assistant")
            return turn["content"]
        return r.text(key, value)

    return {"prompt": r.conversation(mk, msgs), **_pair(r, rk, reply(ck), reply(rk))}


def _alpaca_prompt(src: dict[str, Any], r: SourceRecord) -> list[dict[str, str]]:
    """An Alpaca record's prompt as LLaMA-Factory builds it: ``system``, the ``history`` pairs as
    earlier turns, then ``instruction`` and ``input`` joined by a newline (an empty input adds
    nothing) as the user turn."""
    ik, nk = src.get("instruction_key", "instruction"), src.get("input_key", "input")
    sk, hk = src.get("system_key", "system"), src.get("history_key", "history")
    user = r.text(ik)
    extra = r.get(nk, required=False)
    if extra is not None and not isinstance(extra, str):
        raise r.fail(
            nk, f"must be a string, found {type(extra).__name__}", "store the input as text or leave it empty"
        )
    if extra and extra.strip():
        user = f"{user}\n{extra}"
    msgs = [{"role": "system", "content": r.text(sk)}] if r.get(sk, required=False) is not None else []
    history = r.get(hk, required=False) or []
    if not isinstance(history, list):
        raise r.fail(hk, "must be a list of [instruction, response] pairs", "see the Alpaca format")
    for j, pair in enumerate(history):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise r.fail(f"{hk}[{j}]", "must be an [instruction, response] pair", "see the Alpaca format")
        msgs.append({"role": "user", "content": r.text(f"{hk}[{j}][0]", pair[0])})
        msgs.append({"role": "assistant", "content": r.text(f"{hk}[{j}][1]", pair[1])})
    return [*msgs, {"role": "user", "content": user}]


def _alpaca_preference(src: dict[str, Any], r: SourceRecord) -> dict[str, Any]:
    ck, rk = src.get("chosen_key", "chosen"), src.get("rejected_key", "rejected")
    return {"prompt": _alpaca_prompt(src, r), **_pair(r, rk, r.text(ck), r.text(rk))}


def _hh_transcript(r: SourceRecord, key: str) -> list[dict[str, str]]:
    """An HH-RLHF transcript (``\n\nHuman: ...\n\nAssistant: ...``) as messages."""
    text = r.text(key)
    if "\n\nAssistant:" not in text:
        raise r.fail(
            key,
            "has no '\\n\\nAssistant:' turn",
            "an HH-RLHF transcript alternates '\\n\\nHuman: ' and '\\n\\nAssistant: ' turns, ending with the reply",
        )
    head, *parts = re.split(r"\n\n(Human|Assistant):[ ]?", text)
    if head.strip():
        raise r.fail(
            key, f"starts with text before its first turn: {head[:40]!r}", "start with '\\n\\nHuman: '"
        )
    msgs = []
    for j, (who, body) in enumerate(zip(parts[::2], parts[1::2], strict=True)):
        if not body.strip():
            raise r.fail(key, f"turn {j + 1} ({who}) is empty", "drop the record or fill the turn")
        msgs.append({"role": HH_MARKERS[who], "content": body.strip()})
    return msgs


def _hh_rlhf(src: dict[str, Any], r: SourceRecord) -> dict[str, Any]:
    ck, rk = src.get("chosen_key", "chosen"), src.get("rejected_key", "rejected")
    chosen, rejected = _hh_transcript(r, ck), _hh_transcript(r, rk)
    for key, msgs in ((ck, chosen), (rk, rejected)):
        if msgs[-1]["role"] != "assistant":
            raise r.fail(
                key,
                "must end with the assistant's reply",
                "end the transcript with '\\n\\nAssistant: <reply>'",
            )
    if chosen[:-1] != rejected[:-1]:
        raise r.fail(
            rk,
            f"has other turns before the reply than '{ck}'",
            "both transcripts must share all turns but the last reply",
        )
    prompt = r.conversation(ck, chosen[:-1])
    return {"prompt": prompt, **_pair(r, rk, chosen[-1]["content"], rejected[-1]["content"])}


PREFERENCE_READERS = {
    "binary_preference": _binary_preference,
    "preference": _ranked_preference,
    "ultrafeedback": _ultrafeedback,
    "helpsteer3": _helpsteer3,
    "hh_rlhf": _hh_rlhf,
    "sharegpt": _sharegpt_preference,
    "alpaca": _alpaca_preference,
}


def _conversation(
    fmt: str, family: str, src: dict[str, Any], r: SourceRecord
) -> tuple[list[dict[str, Any]], str, str]:
    """A record of a conversation format as (messages ending with the answer, the key that
    names them in errors, the answer's field)."""
    if fmt == "sharegpt":
        msgs, mk = _sharegpt_turns(src, r, tools=family == "sft")
        return msgs, mk, f"{mk}[{len(msgs) - 1}].{src.get('content_key', 'value')}"
    if fmt == "alpaca":
        ok = src.get("output_key", "output")
        prompt = _alpaca_prompt(src, r)
        return (
            [*prompt, {"role": "assistant", "content": r.text(ok)}],
            src.get("instruction_key", "instruction"),
            ok,
        )
    mk = src.get("messages_key", "messages")
    if fmt == "messages" or mk in r.rec:
        msgs = r.messages(mk, tools=family == "sft")
        return msgs, mk, f"{mk}[{len(msgs) - 1}].content"
    ik, ok = src.get("input_key", "input"), src.get("output_key", "output")  # response
    return [*r.prompt(ik), {"role": "assistant", "content": r.text(ok)}], ik, ok


def convert(
    fmt: str, family: str, src: dict[str, Any], r: SourceRecord, default_task: str
) -> dict[str, Any] | None:
    """One source record -> one prepared row (without id) of ``family``; None for a dropped tie."""
    task = _task(r, src, default_task)
    if family == "preference":
        pair = PREFERENCE_READERS[fmt](src, r)
        return None if pair is None else {"task": task, **pair}

    msgs, key, answer_field = _conversation(fmt, family, src, r)
    if msgs[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in msgs):
        raise r.fail(
            key, "must contain a user turn and end with an assistant turn", "append the assistant reply"
        )
    r.system_first(key, msgs)
    if family == "sft":
        last = msgs[-1]
        if "tool_calls" not in last:  # a conversation may end with the call the model learns to make
            last = {"role": "assistant", "content": final_answer(r, src, last["content"], answer_field)}
        tools = r.tools(src.get("tools_key", "tools")) if fmt in ("messages", "sharegpt") else None
        return {"task": task, "messages": [*msgs[:-1], last], **({"tools": tools} if tools else {})}
    prompt = r.conversation(key, msgs[:-1])
    return {"task": task, **_rl_fields(r, src, prompt, msgs[-1]["content"], answer_field)}


def math_gold_error(where: str, line: int, field: str, answer: str) -> DataError:
    """The error for a gold answer math-verify cannot parse (so every reward would be 0)."""
    fix = "keep only the final answer in the field (e.g. '72', '\\frac{1}{2}', 'x^2+1')"
    if GSM8K_MARKER in answer:
        fix = "for GSM8K worked solutions ending '#### <answer>', set answer_format: gsm8k on the source"
    shown = answer if len(answer) <= 80 else answer[:40] + " ... " + answer[-30:]
    return DataError(
        where,
        line,
        field,
        f"gold answer {shown!r} is not an expression math-verify can parse (verifier math: every reward would be 0)",
        fix,
    )
